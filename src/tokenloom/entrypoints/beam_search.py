"""Beam search in the caller: vLLM's `LLM.beam_search` and the server's `use_beam_search`.

As in vLLM, the engine knows nothing of beams. Each step asks it, for every live beam, for one
token and the log probabilities of the beam's 2 * beam_width most likely next tokens; every
(beam, token) pair is a candidate, a candidate ending in EOS is a finished sequence, and the
beam_width best of the others are the next step's beams. The prefix cache keeps each beam's
earlier tokens computed, so a step costs the engine about one decode step per beam (plus up to a
block of tokens past the last full block, which the cache does not hold).

Scores are vLLM's (and transformers'): a sequence's cumulative log probability divided by its
length (prompt included, a final EOS not counted) to the power `length_penalty`.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenloom.outputs import CompletionOutput, Logprob, RequestOutput
from tokenloom.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from tokenloom.engine.async_llm import AsyncLLM


@dataclass
class BeamSearchSequence:
    """One sequence: `tokens` are the prompt's followed by the generated ones (vLLM's layout),
    `logprobs` one dict per generated token (that step's candidates). `text` is filled when the
    sequence is returned."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS), "length", "abort" or "error"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(tokens: Sequence[int], cum_logprob: float, eos_token_ids: frozenset[int], length_penalty: float) -> float:
    seq_len = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (max(seq_len, 1) ** length_penalty)


class BeamSearch:
    """One prompt's search: its live beams, the finished sequences, and one step's advance."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: Sequence[int],
                 prompt: str | None = None) -> None:
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.beams = [BeamSearchSequence(tokens=list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.num_steps = 0
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return not self.beams or self.num_steps >= self.params.max_tokens

    def step_params(self) -> SamplingParams:
        """Each beam's request: one token (sampled at `temperature`, greedy at 0) with the log
        probabilities of the 2 * beam_width most likely."""
        return SamplingParams(max_tokens=1, temperature=self.params.temperature, logprobs=2 * self.params.beam_width,
                              ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)

    def _score(self, seq: BeamSearchSequence) -> float:
        return beam_score(seq.tokens, seq.cum_logprob, self.eos_token_ids, self.params.length_penalty)

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """Takes the final output of each live beam's request, in `beams` order."""
        assert len(outputs) == len(self.beams), (len(outputs), len(self.beams))
        ended = next((o for o in outputs if o.error or o.outputs[0].finish_reason in ("abort", "error")), None)
        if ended is not None:  # the engine ended a beam's request: the search ends with it
            reason = "error" if ended.error or ended.outputs[0].finish_reason == "error" else "abort"
            self.error = ended.error or (f"a beam's request ended with {reason}" if reason == "error" else None)
            for beam in self.beams:
                beam.finish_reason = reason
            self.completed += self.beams
            self.beams = []
            return
        candidates = []
        for beam, out in zip(self.beams, outputs):
            step = (out.outputs[0].logprobs or [{}])[0]
            for token_id, lp in step.items():
                seq = BeamSearchSequence(tokens=beam.tokens + [token_id], logprobs=beam.logprobs + [step],
                                         cum_logprob=beam.cum_logprob + lp.logprob)
                if token_id in self.eos_token_ids and not self.params.ignore_eos:
                    seq.finish_reason, seq.stop_reason = "stop", token_id
                    self.completed.append(seq)
                else:
                    candidates.append(seq)
        candidates.sort(key=self._score, reverse=True)
        self.beams = candidates[: self.params.beam_width]
        self.num_steps += 1

    def best(self) -> list[BeamSearchSequence]:
        """The best `beam_width` sequences, finished or not (a live one ended by max_tokens)."""
        for beam in self.beams:
            beam.finish_reason = beam.finish_reason or "length"
        return sorted(self.completed + self.beams, key=self._score, reverse=True)[: self.params.beam_width]

    def output(self, tokenizer: Any) -> BeamSearchOutput:
        """vLLM's `LLM.beam_search` result: each sequence's text is the prompt's and the generated
        tokens' (as vLLM's)."""
        ranked = self.best()
        for seq in ranked:
            seq.text = tokenizer.decode(seq.tokens, skip_special_tokens=self.params.skip_special_tokens)
        return BeamSearchOutput(ranked)

    def request_output(self, request_id: str, tokenizer: Any) -> RequestOutput:
        """The search as one finished RequestOutput whose choices are the best sequences (the
        server's view): generated tokens only, a final EOS and its text kept only with
        `include_stop_str_in_output`."""
        choices = []
        for i, seq in enumerate(self.best()):
            generated = seq.tokens[len(self.prompt_token_ids):]
            logprobs = seq.logprobs
            if seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                generated, logprobs = generated[:-1], logprobs[:-1]
            seq.text = tokenizer.decode(generated, skip_special_tokens=self.params.skip_special_tokens)
            choices.append(CompletionOutput(index=i, text=seq.text, token_ids=generated,
                                            cumulative_logprob=seq.cum_logprob, logprobs=logprobs,
                                            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        return RequestOutput(request_id=request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             prompt_logprobs=None, outputs=choices, finished=True, error=self.error)


async def _final(gen: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    last = None
    async for out in gen:
        last = out
    assert last is not None and last.finished
    return last


async def run_beam_search(engine: "AsyncLLM", request_id: str, search: BeamSearch, priority: int = 0,
                          lora_request: Any = None) -> RequestOutput:
    """Runs `search` to its end on `engine`, each step's beams as concurrent requests
    (`{request_id}-beam-{step}-{i}`, with `lora_request`'s adapter). Cancelling it aborts the
    step's requests."""
    params = search.step_params()
    while not search.done:
        step = search.num_steps
        outputs = await asyncio.gather(*[
            _final(engine.generate({"prompt_token_ids": beam.tokens}, params, f"{request_id}-beam-{step}-{i}", priority,
                                   lora_request=lora_request))
            for i, beam in enumerate(search.beams)])
        search.advance(outputs)
    return search.request_output(request_id, engine.tokenizer)
