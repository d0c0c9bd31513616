"""Batched logits operations of the sampler, as plain functions over tensors.

Every function works on an `[n, V]` block whose rows are independent requests and takes its
per-row parameters as `[n]` tensors. None loops over the vocabulary, and a row's result does not
depend on the other rows of the block.

Sampling is by inverse CDF: a row's token is where one uniform number `u` lands in the
cumulative sum of its (unnormalised) weights (`draw`). One uniform per row, instead of a noise
value per vocabulary entry (Gumbel-max / exponential race), is what lets a seeded request draw
from its own stream without a generator per row: its `u` is a hash of (seed, step), computed on
the host for all rows at once.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tokenloom.messages import LogprobsLists

_NEG_INF = float("-inf")


def apply_penalties(
    logits: Tensor,
    output_counts: Tensor,
    prompt_mask: Tensor,
    repetition: Tensor | None,
    frequency: Tensor | None,
    presence: Tensor | None,
    out: Tensor | None = None,
    scratch: Tensor | None = None,
) -> Tensor:
    """vLLM's three penalties, written into `out` (a new block by default; it must not be
    `logits`); a penalty passed as None is skipped for the block. `scratch` is a float buffer of
    the same shape, so that a step allocates nothing.

    repetition (prompt and output tokens, as in CTRL / transformers): a seen token's logit is
    divided by the penalty when positive and multiplied by it when negative, so a penalty > 1
    always pushes it down. frequency and presence (output tokens only, as in OpenAI's API):
    subtract `count * frequency` and `(count > 0) * presence`. The neutral values (1, 0, 0) leave
    a logit unchanged, so rows that do not use a penalty can share the block.

    No `torch.where` over the block: on a CPU a select on an unpredictable mask costs ten times an
    arithmetic pass. The repetition factor is exp(copysign(seen, x) * -log(rep)) instead: 1/rep,
    rep or 1 as the rule says, and a -inf logit (a masked token) stays -inf.
    """
    out = torch.empty_like(logits) if out is None else out
    counts = torch.empty_like(logits) if scratch is None else scratch
    counts.copy_(output_counts)
    if repetition is not None:
        torch.add(counts, prompt_mask, out=out).clamp_max_(1.0)  # seen; counts are integers >= 0
        torch.copysign(out, logits, out=out).mul_(-repetition.log().unsqueeze(1)).exp_().mul_(logits)
    else:
        out.copy_(logits)
    if frequency is not None:
        out.addcmul_(counts, -frequency.unsqueeze(1))
    if presence is not None:
        out.addcmul_(counts.sign_(), -presence.unsqueeze(1))  # 1 where generated, else 0
    return out


def apply_min_p(weights: Tensor, min_p: Tensor) -> Tensor:
    """Zeroes (in place) the weights of tokens whose probability is below `min_p` times the top
    token's. `weights` are relative to the row's top token (`temperature_weights`: the top one is
    exactly 1), so the rule reads w < min_p; min_p = 0 zeroes nothing."""
    return weights.mul_(weights >= min_p.unsqueeze(1))


def temperature_weights(logits: Tensor, temperature: Tensor, out: Tensor | None = None) -> Tensor:
    """Unnormalised probabilities exp((x - max) / T), the division and shift in one fused pass
    (into `out` when given). -inf logits get weight 0; a row with every logit -inf
    (contradictory constraints can make one) gets all zeros rather than NaNs."""
    top = logits.amax(dim=-1, keepdim=True)
    top.masked_fill_(top == _NEG_INF, 0.0)  # an all -inf row: exp(-inf) = 0, not exp(nan)
    inv_t = temperature.reciprocal().unsqueeze(1)
    return torch.addcmul(-top * inv_t, logits, inv_t, out=out).exp_()


def cumulative(weights: Tensor) -> Tensor:
    """The CDF of each row, in float64."""
    return weights.double().cumsum_(dim=-1)  # (cumsum(dtype=float64) is slower on CPU: benchmarks/sampler.py)


def inverse_cdf(cdf: Tensor, u: Tensor) -> Tensor:
    """Position where `u` (uniform in [0, 1), float64) lands in each row's `cdf`. A weight of 0
    leaves the CDF flat, so a zero-weight position is never returned."""
    return _search(cdf, u * cdf[:, -1])


def _search(cdf: Tensor, x: Tensor) -> Tensor:
    """First position whose cdf exceeds x ([n]); x is kept below the row's total, which it can
    round up to, so the answer is a position of positive weight."""
    total = cdf[:, -1:]
    x = torch.minimum(x.unsqueeze(1), torch.nextafter(total, torch.zeros_like(total)))
    # clamp: an all-zero row (see temperature_weights) would land past the end.
    return torch.searchsorted(cdf, x, right=True).squeeze(1).clamp_max_(cdf.shape[-1] - 1)


# Two-level draw over a whole vocabulary: block sums, then a cumulative sum of one block per row.
_BLOCK = 256


def block_cdf(weights: Tensor) -> Tensor:
    """`[n, ceil(V / _BLOCK)]` float64 cumulative sums of the row's weight blocks; the last column
    is the row's total weight."""
    n, vocab = weights.shape
    size = _block_size(vocab)
    full, rest = divmod(vocab, size)
    sums = weights[:, : full * size].reshape(n, full, size).sum(dim=-1)
    if rest:
        sums = torch.cat([sums, weights[:, full * size :].sum(dim=-1, keepdim=True)], dim=1)
    return cumulative(sums)


def _block_size(vocab: int) -> int:
    return min(_BLOCK, vocab)


def draw(weights: Tensor, blocks: Tensor, u: Tensor) -> Tensor:
    """Samples a token per row with probability weight / total, from `blocks = block_cdf(weights)`
    and one uniform per row. The same as an inverse CDF over the whole row, without a cumulative
    sum (or a float64 copy) of the whole row: find the block where u lands, then the position
    inside it. Each level sums in float64, so the rarest tokens keep their probability."""
    n, vocab = weights.shape
    size = _block_size(vocab)
    x = u * blocks[:, -1]
    block = _search(blocks, x)
    below = torch.where(block > 0, blocks.gather(1, (block - 1).clamp_min(0).unsqueeze(1)).squeeze(1), 0.0)
    positions = block.unsqueeze(1) * size + torch.arange(size, device=weights.device)
    inside = weights.gather(1, positions.clamp_max(vocab - 1))
    inside.masked_fill_(positions >= vocab, 0.0)  # past the end of a short last block
    # clamp: only an all-zero row can land on the padding.
    return (block * size + _search(cumulative(inside), x - below)).clamp_max_(vocab - 1)


def sample_top_k_top_p(
    logits: Tensor, temperature: Tensor, min_p: Tensor | None, k: Tensor, p: Tensor | None, window: int, u: Tensor
) -> Tensor:
    """Samples rows that all have a top-k (`k` in [1, window]), then top-p over the top k
    renormalised, as vLLM does. Only the `window = max(k)` largest logits are selected (a partial
    sort, on the raw logits: temperature does not change the order), which keeps a typical
    top_k=50 cheap.

    Top-p keeps a token when the mass before it in descending order is < p: the most likely token
    always stays, and ties at the boundary are broken by position.
    """
    values, indices = logits.topk(window, dim=-1, sorted=True)
    positions = torch.arange(window, device=logits.device)
    values.masked_fill_(positions.unsqueeze(0) >= k.unsqueeze(1), _NEG_INF)
    weights = temperature_weights(values, temperature)
    if min_p is not None:  # it commutes with top-k: both keep a most-likely prefix
        apply_min_p(weights, min_p)
    cdf = cumulative(weights)
    if p is not None:
        mass_before = (cdf - weights) / cdf[:, -1:]
        weights.masked_fill_(mass_before >= p.unsqueeze(1), 0.0)
        cdf = cumulative(weights)
    return indices.gather(1, inverse_cdf(cdf, u).unsqueeze(1)).squeeze(1)


def sample_full(
    logits: Tensor, temperature: Tensor, min_p: Tensor | None, p: Tensor | None, u: Tensor, out: Tensor | None = None
) -> Tensor:
    """Samples rows without a top-k, with a top-p for rows where `p` < 1 (p None: none do).

    Top-p without a top-k would need each row sorted over the whole vocabulary, by far the most
    expensive step on a CPU. Instead: draw from the full distribution, and accept the token if it
    lies in the nucleus (the mass of strictly more likely tokens is < p), else draw again with the
    next uniform. An accepted token is distributed exactly as the nucleus renormalised; a row
    needs 1/p draws on average, each one pass over the row. Rows still rejected after
    `u.shape[1] - 1` draws (small p) sort once and draw from the nucleus with the last uniform.
    `out`, when given, is a buffer of the logits' shape for the weights.
    """
    weights = temperature_weights(logits, temperature, out)
    if min_p is not None:
        apply_min_p(weights, min_p)
    blocks = block_cdf(weights)
    tokens = draw(weights, blocks, u[:, 0])
    if p is None:
        return tokens
    total = blocks[:, -1]
    pending = torch.nonzero(p < 1.0).squeeze(1)
    attempts = u.shape[1] - 1
    for attempt in range(1, attempts + 1):
        w = weights if attempt == 1 and pending.numel() == weights.shape[0] else weights[pending]
        chosen = w.gather(1, tokens[pending].unsqueeze(1))
        rejected = mass_above(w, chosen) >= p[pending].double() * total[pending]
        pending = pending[rejected]
        if pending.numel() == 0:
            return tokens
        if attempt < attempts:
            tokens[pending] = draw(weights[pending], blocks[pending], u[pending, attempt])
    # The rare rows left: the nucleus by sorting, as the definition reads.
    w, order = weights[pending].sort(dim=-1, descending=True)
    sorted_cdf = cumulative(w)
    mass_before = (sorted_cdf - w) / sorted_cdf[:, -1:]
    w.masked_fill_(mass_before >= p[pending].double().unsqueeze(1), 0.0)
    picked = inverse_cdf(cumulative(w), u[pending, attempts])
    tokens[pending] = order.gather(1, picked.unsqueeze(1)).squeeze(1)
    return tokens


def mass_above(weights: Tensor, threshold: Tensor) -> Tensor:
    """Per row, the sum of the weights strictly above `threshold` ([n, 1]), in float64.

    Written with float arithmetic alone, sum(relu(w - t)) + t * sum(sign(relu(w - t))), because
    comparisons and boolean masks over a vocabulary-wide block cost several times more on a CPU.
    """
    excess = (weights - threshold).relu_()
    total_excess = excess.sum(dim=-1).double()
    count = excess.sign_().sum(dim=-1).double()
    return total_excess + threshold.squeeze(1).double() * count


def gather_logprobs(logits: Tensor, token_ids: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Log-probabilities of `[n, V]` logits for `[n]` chosen tokens: `ids [n, 1 + k]` and
    `values [n, 1 + k]` (the chosen token first, then the top k in descending order) and
    `ranks [n]` (1 = most likely; tokens tied with the chosen one count as ahead, as in vLLM).

    log_softmax(x)_i = x_i - logsumexp(x), and the order of the logits is the order of the
    logprobs, so only the 1 + k values asked for are computed, not a `[n, V]` block."""
    token_ids = token_ids.to(device=logits.device, dtype=torch.int64).unsqueeze(1)
    k = min(k, logits.shape[-1])
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    chosen = logits.gather(1, token_ids)
    ranks = (logits >= chosen).sum(dim=-1)
    if k > 0:
        top_values, top_ids = logits.topk(k, dim=-1)
        return torch.cat([token_ids, top_ids], dim=1), torch.cat([chosen, top_values], dim=1) - lse, ranks
    return token_ids, chosen - lse, ranks


def to_logprobs_lists(ids: Tensor, values: Tensor, ranks: Tensor) -> LogprobsLists:
    """Moves a `gather_logprobs` result to Python lists."""
    return LogprobsLists(token_ids=ids.tolist(), logprobs=values.tolist(), ranks=ranks.tolist())
