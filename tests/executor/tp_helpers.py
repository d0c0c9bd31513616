"""What the tensor-parallel tests compare: greedy tokens and the logprobs of the prompt and of each
sampled token (log-softmax of the full-vocabulary logits: every logit of the all-gathered LM head
and every all-reduce before it shows in them)."""
from __future__ import annotations

from tokenloom import SamplingParams

PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "1, 2, 3,", "Hi"]
# float32 on both sides; the partial sums of the row-parallel layers add in another order.
ATOL = 1e-4
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=5)


def run(llm, prompts=PROMPTS, params=PARAMS) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Per prompt: (greedy tokens, the top-5 logprobs at every prompt and output position)."""
    results = []
    for out in llm.generate(prompts, params, use_tqdm=False):
        c = out.outputs[0]
        positions = [p for p in (out.prompt_logprobs or []) if p] + list(c.logprobs or [])
        results.append((list(c.token_ids), [{t: lp.logprob for t, lp in p.items()} for p in positions]))
    return results


def assert_same(got, want, atol: float = ATOL) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        assert len(logprobs) == len(ref_logprobs)
        for pos, (a, b) in enumerate(zip(logprobs, ref_logprobs)):
            common = a.keys() & b.keys()
            assert len(common) >= 4, (pos, a, b)  # the top 5 agree (a near-tie at the edge may swap)
            worst = max(abs(a[t] - b[t]) for t in common)
            assert worst < atol, f"position {pos}: logprobs differ by {worst:.2e}"
