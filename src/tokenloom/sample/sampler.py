"""The batched sampler: the sampling state of the persistent batch and one step's sampling.

The model runner keeps each request in a fixed row of its persistent batch; the sampler mirrors
that: every per-request parameter lives at the request's row of a preallocated tensor, written
once by `add_request`, and each step's `sample(logits, rows)` gathers the rows it is given. The
running history a penalty needs (output token counts, prompt token presence) is kept per row too
and updated by `sample()` itself with one scatter, so no step re-reads a request's history.

One step, in vLLM's order (each stage skipped when no row of the step uses it):

0. structured outputs: a grammar's bitmask (sample/grammar.py), in place, as vLLM applies it to
   the model's logits before its sampler;
1. logprobs are of the raw logits (vLLM's default `raw_logprobs`), for rows that asked;
2. token constraints: allowed_token_ids, bad_words, min_tokens' stop-token suppression (-inf),
   then logit_bias (added). Stored sparsely per row; the Python work of a step is proportional
   to the rows that use them;
3. penalties: repetition, frequency, presence;
4. greedy rows: argmax. Random rows: temperature, min_p, top-k, top-p, and a draw by inverse CDF
   (`ops`).

Randomness. Each random row draws its token by inverse CDF from uniform numbers (`ops`). A
seeded request's uniforms at each step are a hash of (seed, number of tokens it has generated so
far, draw index), so its tokens depend only on its seed and its own history: not on the batch
around it, on chunked prefill, or on preemption (re-adding the request with its output history
resumes the same stream). The uniforms are the same on every device. The hash is computed with numpy for all
seeded rows of a step at once: no per-row generator, no Python loop. Unseeded rows draw from one
sampler-wide generator seeded with the engine seed. Greedy rows draw nothing.

Contract with the caller: pass to `sample()` only rows whose sampled token will be kept (a prefill
chunk that stops short of the end of the prompt is not sampled), because `sample()` counts the
token into the row's history.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from tokenloom.messages import LogprobsLists
from tokenloom.ops.elementwise import argmax
from tokenloom.sample import ops
from tokenloom.sample.grammar import GrammarMask, apply_grammar_mask
from tokenloom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Draws per row for top-p without top-k (see ops.sample_full): rows still rejected after these
# (about (1 - p) ** 8 of them) fall back to a sort.
TOP_P_DRAWS = 8

_U64 = np.uint64


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def seeded_uniforms(seeds: np.ndarray, steps: np.ndarray, count: int) -> np.ndarray:
    """`[len(seeds), count]` uniforms in [0, 1): row i, column j is a hash of (seeds[i] as
    uint64, steps[i], j) alone. Chained mixing, so nearby seeds or steps give unrelated values."""
    golden = _U64(0x9E3779B97F4A7C15)
    z = _mix(seeds.astype(np.uint64) + golden)
    z = _mix(z ^ (steps.astype(np.uint64) * golden))
    z = _mix(z[:, None] ^ (np.arange(1, count + 1, dtype=np.uint64)[None, :] * golden))
    return (z >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))


# Workspace buffers (Sampler._buffer): the constrained copy of the logits, the penalised block,
# and a scratch block (penalty counts, then the sampling weights).
_CONSTRAINED, _PENALISED, _SCRATCH = 0, 1, 2


@dataclass(slots=True)
class SamplerOutput:
    # [N] int64 on the CPU: the token sampled for logits row i (the request at rows[i]).
    sampled_token_ids: Tensor
    # None when no row of the step asked for logprobs; otherwise aligned with the N logits rows:
    # a one-position LogprobsLists (sampled token first, then its top-k) or None for a row that
    # did not ask.
    logprobs: list[LogprobsLists | None] | None = None


@dataclass(slots=True)
class _BadWords:
    # Single-token words are always forbidden; a longer word forbids its last token when the
    # output ends with the rest of the word.
    always: Tensor
    prefixed: list[tuple[tuple[int, ...], int]]
    # The output tail those prefixes are matched against (only as long as the longest prefix).
    tail: deque[int]


class Sampler:
    def __init__(
        self,
        max_num_reqs: int,
        vocab_size: int,
        device: torch.device | str = "cpu",
        *,
        seed: int | None = 0,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        dev, n = self.device, max_num_reqs

        # Per-row parameters, on the device, indexed by row.
        self.temperature = torch.ones(n, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(n, dtype=torch.float32, device=dev)
        self.top_k = torch.full((n,), vocab_size, dtype=torch.int64, device=dev)  # V: off
        self.min_p = torch.zeros(n, dtype=torch.float32, device=dev)
        self.repetition_penalty = torch.ones(n, dtype=torch.float32, device=dev)
        self.frequency_penalty = torch.zeros(n, dtype=torch.float32, device=dev)
        self.presence_penalty = torch.zeros(n, dtype=torch.float32, device=dev)
        # Running history for the penalties, kept current by sample() for the rows that use a
        # penalty only. Left uninitialised (a row is zeroed when a penalised request takes it) so
        # that the n x vocab pages (30 MiB at 128 x 49k) stay untouched, off the resident set,
        # for a workload without penalties.
        self.output_token_counts = torch.empty(n, vocab_size, dtype=torch.int32, device=dev)
        self.prompt_token_mask = torch.empty(n, vocab_size, dtype=torch.bool, device=dev)

        # Host-side mirrors that decide, with one numpy gather per step, which stages run for
        # which rows (no device sync, no Python loop over the batch).
        self._active = np.zeros(n, dtype=bool)
        self._greedy = np.zeros(n, dtype=bool)
        self._uses_penalty = np.zeros(n, dtype=bool)
        self._uses_repetition = np.zeros(n, dtype=bool)
        self._uses_frequency = np.zeros(n, dtype=bool)
        self._uses_presence = np.zeros(n, dtype=bool)
        self._uses_min_p = np.zeros(n, dtype=bool)
        self._top_k = np.zeros(n, dtype=np.int64)  # 0: off
        self._uses_top_p = np.zeros(n, dtype=bool)
        self._seeded = np.zeros(n, dtype=bool)
        self._seed = np.zeros(n, dtype=np.uint64)
        self._num_logprobs = np.full(n, -1, dtype=np.int64)  # -1: none asked
        self._num_output_tokens = np.zeros(n, dtype=np.int64)
        self._min_tokens = np.zeros(n, dtype=np.int64)
        self._uses_constraint = np.zeros(n, dtype=bool)  # any of the sparse features below

        # Sparse per-row constraints, only for the rows that use them.
        self._allowed: dict[int, Tensor] = {}
        self._bad_words: dict[int, _BadWords] = {}
        self._min_tokens_stop_ids: dict[int, Tensor] = {}
        self._logit_bias: dict[int, tuple[Tensor, Tensor]] = {}

        # Step-local [max_num_reqs, V] float32 buffers, allocated on first use (see _buffer).
        self._workspace: list[Tensor | None] = [None] * 3
        self._grammar_rows: Tensor | None = None  # int32 bitmask rows, on the first grammar step

        # Unseeded random rows share this generator (seeded rows hash their own uniforms).
        self._rng = np.random.Generator(np.random.PCG64(seed))

    # ---- persistent batch -------------------------------------------------------------------

    def add_request(
        self,
        row: int,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
    ) -> None:
        """Installs a request at `row` (replacing whatever was there). `output_token_ids` is the
        history of a request resumed after preemption: counts, min_tokens and the seeded stream
        continue from it."""
        if not 0 <= row < self.max_num_reqs:
            raise ValueError(f"row must be in [0, {self.max_num_reqs}), got {row}.")
        params.verify_against_vocab(self.vocab_size)
        if self._active[row]:
            self.remove_request(row)
        V, dev = self.vocab_size, self.device
        self._active[row] = True

        greedy = params.sampling_type_greedy
        self._greedy[row] = greedy
        self.temperature[row] = 1.0 if greedy else params.temperature
        top_k = params.top_k if 0 < params.top_k < V and not greedy else 0  # k >= V keeps all
        self._top_k[row] = top_k
        self.top_k[row] = top_k or V
        self._uses_top_p[row] = params.top_p < 1.0 and not greedy
        self.top_p[row] = params.top_p
        self._uses_min_p[row] = params.min_p > 0.0 and not greedy
        self.min_p[row] = params.min_p
        self._seeded[row] = params.seed is not None
        self._seed[row] = (params.seed or 0) % (1 << 64)

        self.repetition_penalty[row] = params.repetition_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.presence_penalty[row] = params.presence_penalty
        self._uses_repetition[row] = params.repetition_penalty != 1.0
        self._uses_frequency[row] = params.frequency_penalty != 0.0
        self._uses_presence[row] = params.presence_penalty != 0.0
        self._uses_penalty[row] = self._uses_repetition[row] or self._uses_frequency[row] or self._uses_presence[row]
        if self._uses_penalty[row]:
            counts = self.output_token_counts[row]
            counts.zero_()
            if len(output_token_ids):
                out = torch.as_tensor(list(output_token_ids), dtype=torch.int64, device=dev)
                counts.index_put_((out,), torch.ones_like(out, dtype=torch.int32), accumulate=True)
            mask = self.prompt_token_mask[row]
            mask.zero_()
            if params.repetition_penalty != 1.0 and len(prompt_token_ids):
                mask[torch.as_tensor(list(prompt_token_ids), dtype=torch.int64, device=dev)] = True

        self._num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self._num_output_tokens[row] = len(output_token_ids)
        self._min_tokens[row] = params.min_tokens
        self._add_constraints(row, params, output_token_ids)

    def _add_constraints(self, row: int, params: SamplingParams, output_token_ids: Sequence[int]) -> None:
        dev = self.device
        if params.allowed_token_ids:
            self._allowed[row] = torch.tensor(params.allowed_token_ids, dtype=torch.int64, device=dev)
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=dev)
            values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=dev)
            self._logit_bias[row] = (ids, values)
        stop_ids = params.all_stop_token_ids
        if params.min_tokens > 0 and stop_ids:
            self._min_tokens_stop_ids[row] = torch.tensor(sorted(stop_ids), dtype=torch.int64, device=dev)
        words = params._bad_words_token_ids
        if params.bad_words and words is None:
            logger.warning(
                "bad_words %r arrived without _bad_words_token_ids (the input processor tokenizes "
                "them); they are not enforced.",
                params.bad_words,
            )
        if words:
            always = sorted({w[0] for w in words if len(w) == 1})
            prefixed = sorted({(tuple(w[:-1]), w[-1]) for w in words if len(w) > 1})
            longest = max((len(p) for p, _ in prefixed), default=0)
            self._bad_words[row] = _BadWords(
                always=torch.tensor(always, dtype=torch.int64, device=dev),
                prefixed=prefixed,
                tail=deque(list(output_token_ids)[-longest:] if longest else (), maxlen=longest),
            )
        self._uses_constraint[row] = (
            row in self._allowed or row in self._logit_bias or row in self._min_tokens_stop_ids or row in self._bad_words
        )

    def remove_request(self, row: int) -> None:
        """Frees `row`. Its tensors are left as they are; add_request overwrites them."""
        self._active[row] = False
        self._uses_constraint[row] = False
        self._allowed.pop(row, None)
        self._logit_bias.pop(row, None)
        self._min_tokens_stop_ids.pop(row, None)
        self._bad_words.pop(row, None)

    # ---- one step ---------------------------------------------------------------------------

    def sample(self, logits: Tensor, rows: Sequence[int] | Tensor | np.ndarray,
               grammar: GrammarMask | None = None, offsets: np.ndarray | None = None) -> SamplerOutput:
        """Samples one token for each logits row; `logits[i]` belongs to the request at
        `rows[i]`. `logits` is not modified, except by `grammar`, which constrains some rows to
        the tokens a grammar allows in place (as vLLM masks the model's logits: a constrained
        row's logprobs are those of its masked distribution; and a copy of a [64, 49152] block
        costs milliseconds a step on a CPU). Counts the sampled tokens into the rows' histories.

        Speculative decoding: a request may have several logits rows, its next position and
        the positions after its draft tokens; `offsets[i]` says which (0, 1, ...). Such rows
        draw as the request would draw its (offset + 1)-th next token (a seeded request's
        uniforms follow its output count), so verifying drafts keeps a seeded request's tokens
        those of a run without them. Only rows with `speculation_ok` may have an offset > 0; the
        history counts one token for them, and `accept` adds the drafts kept."""
        rows_np = _as_numpy(rows)
        n = len(rows_np)
        if logits.dim() != 2 or logits.shape[0] != n or logits.shape[1] != self.vocab_size:
            raise ValueError(
                f"logits must have shape [len(rows)={n}, vocab_size={self.vocab_size}], got {tuple(logits.shape)}."
            )
        if n == 0:
            return SamplerOutput(sampled_token_ids=torch.empty(0, dtype=torch.int64))
        if not self._active[rows_np].all():
            raise ValueError(f"sample() got rows with no request: {rows_np[~self._active[rows_np]].tolist()}.")
        dev = self.device
        rows_t = torch.from_numpy(rows_np).to(dev, non_blocking=True)
        logits = logits.to(device=dev, dtype=torch.float32)
        if grammar is not None:
            if self._grammar_rows is None:
                width = -(-self.vocab_size // 32)
                self._grammar_rows = torch.empty(self.max_num_reqs, width, dtype=torch.int32, device=dev)
            apply_grammar_mask(logits, grammar, self._grammar_rows)

        # 1. Logprobs are of the model's own distribution: `raw` is never written to, so they
        # are read from it after the token is known.
        raw = logits

        # 2-3. Constraints and penalties.
        logits = self._process(logits, rows_np, rows_t)

        # 4. Greedy and random rows of one step, each group in one pass.
        greedy = self._greedy[rows_np]
        if greedy.all():
            sampled = argmax(logits)
        else:
            sampled = torch.empty(n, dtype=torch.int64, device=dev)
            if greedy.any():
                g_idx = _index(np.flatnonzero(greedy), dev)
                sampled[g_idx] = argmax(logits[g_idx])
            rand_pos = np.flatnonzero(~greedy)
            sampled[_index(rand_pos, dev)] = self._sample_random(logits, rows_np, rand_pos, offsets)

        sampled_cpu = sampled.cpu()
        lp_pos = np.flatnonzero(self._num_logprobs[rows_np] >= 0)
        logprobs = self._logprobs(raw, sampled, rows_np, lp_pos, n) if lp_pos.size else None
        if offsets is None:
            self._record(rows_np, rows_t, sampled, sampled_cpu)
        else:  # one history entry per request; accept() adds the drafts it keeps
            first = np.flatnonzero(offsets == 0)
            idx = _index(first, dev)
            self._record(rows_np[first], rows_t[idx], sampled[idx], sampled_cpu[torch.from_numpy(first)])
        return SamplerOutput(sampled_token_ids=sampled_cpu, logprobs=logprobs)

    def speculation_ok(self, rows: np.ndarray) -> np.ndarray:
        """Which rows may verify draft tokens: those whose next tokens are drawn independently of
        the ones before them (no penalty, no bad words, min_tokens reached). Structured outputs
        are the caller's to exclude."""
        no_bad_words = np.fromiter((int(r) not in self._bad_words for r in rows), dtype=bool, count=len(rows)) \
            if self._bad_words else True
        return (self._active[rows] & ~self._uses_penalty[rows] & no_bad_words
                & (self._num_output_tokens[rows] >= self._min_tokens[rows]))

    def accept(self, rows: np.ndarray, num_extra: np.ndarray) -> None:
        """Counts `num_extra[i]` more tokens (accepted drafts) into row `rows[i]`'s history."""
        np.add.at(self._num_output_tokens, rows, num_extra)

    def process_logits(self, logits: Tensor, rows: Sequence[int] | Tensor | np.ndarray) -> Tensor:
        """The logits after constraints and penalties (what greedy rows take the argmax of,
        before temperature), without sampling or changing any state. For tests and debugging."""
        rows_np = _as_numpy(rows)
        rows_t = torch.from_numpy(rows_np).to(self.device)
        return self._process(logits.to(device=self.device, dtype=torch.float32), rows_np, rows_t).clone()

    def _process(self, logits: Tensor, rows_np: np.ndarray, rows_t: Tensor) -> Tensor:
        """Constraints then penalties, never writing into the caller's tensor. The result may
        live in a workspace buffer (_CONSTRAINED or _PENALISED), valid until the next step."""
        con_pos = np.flatnonzero(self._uses_constraint[rows_np])
        pen_pos = np.flatnonzero(self._uses_penalty[rows_np])
        n = len(rows_np)
        copied = False
        if con_pos.size:
            logits = self._buffer(_CONSTRAINED, n).copy_(logits)
            copied = True
            self._apply_constraints(logits, rows_np, con_pos)
        if pen_pos.size:
            dev = self.device
            pen_np = rows_np[pen_pos]
            pen_rows = _rows_of(pen_np, dev)
            penalised = ops.apply_penalties(
                _take(logits, pen_pos, dev),
                self.output_token_counts[pen_rows],
                self.prompt_token_mask[pen_rows],
                self.repetition_penalty[pen_rows] if self._uses_repetition[pen_np].any() else None,
                self.frequency_penalty[pen_rows] if self._uses_frequency[pen_np].any() else None,
                self.presence_penalty[pen_rows] if self._uses_presence[pen_np].any() else None,
                out=self._buffer(_PENALISED, pen_pos.size),
                scratch=self._buffer(_SCRATCH, pen_pos.size),
            )
            if pen_pos.size == n:
                return penalised
            if not copied:
                logits = self._buffer(_CONSTRAINED, n).copy_(logits)
            logits[_index(pen_pos, dev)] = penalised
        return logits

    def _buffer(self, which: int, num_rows: int) -> Tensor:
        """`[num_rows, V]` float32 workspace, allocated once at full size on first use. Reusing it
        matters on a CPU: a fresh multi-MB tensor each step means fresh pages, and the page faults
        cost as much as the arithmetic (glibc returns blocks over 32 MiB to the OS on free)."""
        buf = self._workspace[which]
        if buf is None:
            buf = torch.empty(self.max_num_reqs, self.vocab_size, dtype=torch.float32, device=self.device)
            self._workspace[which] = buf
        return buf[:num_rows]

    def _apply_constraints(self, logits: Tensor, rows_np: np.ndarray, positions: np.ndarray) -> None:
        """allowed_token_ids, bad_words and min_tokens as -inf, then logit_bias, for the rows at
        `positions` (the only rows this loop visits)."""
        dev = self.device
        allowed_pos: list[int] = []
        allowed_ids: list[Tensor] = []
        banned_pos: list[int] = []
        banned_ids: list[Tensor] = []
        bias_pos: list[int] = []
        bias_ids: list[Tensor] = []
        bias_values: list[Tensor] = []
        for pos in positions.tolist():
            row = int(rows_np[pos])
            if (ids := self._allowed.get(row)) is not None:
                allowed_pos.append(pos)
                allowed_ids.append(ids)
            if (bad := self._bad_words.get(row)) is not None:
                ids = bad.always
                if bad.prefixed:
                    tail = tuple(bad.tail)
                    completing = [last for prefix, last in bad.prefixed if tail[len(tail) - len(prefix) :] == prefix]
                    if completing:
                        ids = torch.cat([ids, torch.tensor(completing, dtype=torch.int64, device=dev)])
                banned_pos.append(pos)
                banned_ids.append(ids)
            if (ids := self._min_tokens_stop_ids.get(row)) is not None:
                if self._num_output_tokens[row] < self._min_tokens[row]:
                    banned_pos.append(pos)
                    banned_ids.append(ids)
            if (bias := self._logit_bias.get(row)) is not None:
                bias_pos.append(pos)
                bias_ids.append(bias[0])
                bias_values.append(bias[1])

        if allowed_pos:
            idx = _index(np.asarray(allowed_pos), dev)
            keep = torch.zeros(len(allowed_pos), self.vocab_size, dtype=torch.bool, device=dev)
            keep[_repeat(range(len(allowed_pos)), allowed_ids, dev), torch.cat(allowed_ids)] = True
            logits[idx] = logits[idx].masked_fill_(~keep, float("-inf"))
        if banned_pos:
            logits[_repeat(banned_pos, banned_ids, dev), torch.cat(banned_ids)] = float("-inf")
        if bias_pos:
            logits.index_put_(
                (_repeat(bias_pos, bias_ids, dev), torch.cat(bias_ids)), torch.cat(bias_values), accumulate=True
            )

    def _sample_random(self, logits: Tensor, rows_np: np.ndarray, positions: np.ndarray,
                       offsets: np.ndarray | None = None) -> Tensor:
        """Temperature, min_p, then top-k/top-p and the draw, for the logits rows at
        `positions`. Rows with a top-k and rows without one are sampled as two groups. The
        temperature is folded into the weights (`ops.temperature_weights`) rather than applied
        to a copy of the logits."""
        dev = self.device
        rows = rows_np[positions]
        rows_t = torch.from_numpy(rows).to(dev, non_blocking=True)
        block = _take(logits, positions, dev)
        temperature = self.temperature[rows_t]
        min_p = self.min_p[rows_t] if self._uses_min_p[rows].any() else None

        top_k, top_p = self._top_k[rows], self._uses_top_p[rows]
        has_k = top_k > 0
        draws = 1 + TOP_P_DRAWS if (top_p & ~has_k).any() else 1
        u = torch.from_numpy(self._uniforms(rows, draws, None if offsets is None else offsets[positions]))
        u = u.to(dev, non_blocking=True)
        if not has_k.any():
            return ops.sample_full(
                block,
                temperature,
                min_p,
                self.top_p[rows_t] if top_p.any() else None,
                u,
                out=self._buffer(_SCRATCH, len(rows)),
            )

        tokens = torch.empty(len(rows), dtype=torch.int64, device=dev)
        k_pos = np.flatnonzero(has_k)
        k_idx = _index(k_pos, dev)
        k_rows = rows_t[k_idx]
        tokens[k_idx] = ops.sample_top_k_top_p(
            _take(block, k_pos, dev),
            temperature[k_idx],
            None if min_p is None else min_p[k_idx],
            self.top_k[k_rows],
            self.top_p[k_rows] if top_p[k_pos].any() else None,
            int(top_k.max()),
            u[k_idx, 0],
        )
        if k_pos.size < len(rows):
            f_pos = np.flatnonzero(~has_k)
            f_idx = _index(f_pos, dev)
            tokens[f_idx] = ops.sample_full(
                block[f_idx],
                temperature[f_idx],
                None if min_p is None else min_p[f_idx],
                self.top_p[rows_t[f_idx]] if top_p[f_pos].any() else None,
                u[f_idx],
                out=self._buffer(_SCRATCH, f_pos.size),
            )
        return tokens

    def _uniforms(self, rows: np.ndarray, count: int, offsets: np.ndarray | None = None) -> np.ndarray:
        u = np.empty((len(rows), count), dtype=np.float64)
        seeded = self._seeded[rows]
        if seeded.any():
            steps = self._num_output_tokens[rows[seeded]]
            if offsets is not None:
                steps = steps + offsets[seeded]
            u[seeded] = seeded_uniforms(self._seed[rows[seeded]], steps, count)
        if not seeded.all():
            u[~seeded] = self._rng.random((int((~seeded).sum()), count))
        return u

    def _logprobs(
        self, raw: Tensor, sampled: Tensor, rows_np: np.ndarray, lp_pos: np.ndarray, n: int
    ) -> list[LogprobsLists | None]:
        ks = self._num_logprobs[rows_np[lp_pos]]
        ids, values, ranks = ops.gather_logprobs(
            _take(raw, lp_pos, self.device), _take(sampled, lp_pos, self.device), int(ks.max())
        )
        id_rows, value_rows, rank_list = ids.tolist(), values.tolist(), ranks.tolist()
        result: list[LogprobsLists | None] = [None] * n
        for j, (pos, k) in enumerate(zip(lp_pos.tolist(), ks.tolist())):
            result[pos] = LogprobsLists(
                token_ids=[id_rows[j][: 1 + k]], logprobs=[value_rows[j][: 1 + k]], ranks=[rank_list[j]]
            )
        return result

    def _record(self, rows_np: np.ndarray, rows_t: Tensor, sampled: Tensor, sampled_cpu: Tensor) -> None:
        """Counts this step's tokens into the history of the rows that use a penalty (one
        scatter; nothing for a batch without penalties)."""
        pen = self._uses_penalty[rows_np]
        if pen.all():
            self.output_token_counts.index_put_(
                (rows_t, sampled), torch.ones_like(sampled, dtype=torch.int32), accumulate=True
            )
        elif pen.any():
            pos = _index(np.flatnonzero(pen), self.device)
            picked = sampled[pos]
            self.output_token_counts.index_put_(
                (rows_t[pos], picked), torch.ones_like(picked, dtype=torch.int32), accumulate=True
            )
        self._num_output_tokens[rows_np] += 1
        if self._bad_words:
            for row, token in zip(rows_np.tolist(), sampled_cpu.tolist()):
                bad = self._bad_words.get(row)
                if bad is not None and bad.tail.maxlen:
                    bad.tail.append(token)

    # ---- prompt logprobs --------------------------------------------------------------------

    def compute_prompt_logprobs(self, logits: Tensor, target_token_ids: Tensor, k: int) -> LogprobsLists:
        """Logprobs of `target_token_ids[i]` under `logits[i]` (the logits at prompt position i
        score prompt token i + 1; aligning them is the caller's job), each followed by the top
        `k`, and its rank. Raw logits, like the sampled logprobs."""
        ids, values, ranks = ops.gather_logprobs(logits.to(torch.float32), target_token_ids, k)
        return ops.to_logprobs_lists(ids, values, ranks)


def _as_numpy(rows: Sequence[int] | Tensor | np.ndarray) -> np.ndarray:
    if isinstance(rows, Tensor):
        return rows.detach().cpu().numpy().astype(np.int64, copy=False)
    return np.asarray(rows, dtype=np.int64).reshape(-1)


def _index(positions: np.ndarray, device: torch.device) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)).to(device, non_blocking=True)


def _rows_of(rows: np.ndarray, device: torch.device) -> slice | Tensor:
    """An index for `rows` of a per-row tensor: a slice (a view, no copy) when the rows are
    consecutive, as they are in a condensed persistent batch; else an index tensor."""
    n = rows.size
    if n and rows[-1] - rows[0] == n - 1 and (n == 1 or bool((np.diff(rows) == 1).all())):
        return slice(int(rows[0]), int(rows[0]) + n)
    return _index(rows, device)


def _take(t: Tensor, positions: np.ndarray, device: torch.device) -> Tensor:
    """t[positions], without the copy when positions are all of t's rows (in order)."""
    if positions.size == t.shape[0]:
        return t
    return t[_index(positions, device)]


def _repeat(positions: Sequence[int], chunks: list[Tensor], device: torch.device) -> Tensor:
    """Row index for every element of `torch.cat(chunks)`: positions[i] repeated len(chunks[i])."""
    counts = torch.tensor([c.numel() for c in chunks], dtype=torch.int64)
    return torch.repeat_interleave(torch.tensor(list(positions), dtype=torch.int64), counts).to(device)
