"""Batched logits operations of the sampler, as plain functions over tensors.

Every function works on an `[n, V]` block whose rows are independent requests and takes its
per-row parameters as `[n]` tensors. None loops over the vocabulary, and a row's result does not
depend on the other rows of the block.

Sampling is by inverse CDF: a row's token is where one uniform number `u` lands in the cumulative
sum of its (unnormalised) weights. One uniform per row, instead of a noise value per vocabulary
entry (Gumbel-max / exponential race), is what lets a seeded request draw from its own stream
without a generator per row: its `u` is a hash of (seed, step) computed on the host, vectorised.
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
) -> Tensor:
    """vLLM's three penalties, as a new block; a penalty passed as None is skipped for the block.

    repetition (prompt and output tokens, as in CTRL / transformers): a seen token's logit is
    divided by the penalty when positive and multiplied by it when negative, so a penalty > 1
    always pushes it down. frequency and presence (output tokens only, as in OpenAI's API):
    subtract `count * frequency` and `(count > 0) * presence`. The neutral values (1, 0, 0) leave
    a logit exactly unchanged, so rows that do not use a penalty can share the block.
    """
    in_output = output_counts > 0
    if repetition is not None:
        rep = repetition.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(in_output | prompt_mask, penalised, logits)
    if frequency is not None:
        logits = logits - output_counts.to(logits.dtype) * frequency.unsqueeze(1)
    if presence is not None:
        logits = logits - in_output.to(logits.dtype) * presence.unsqueeze(1)
    return logits


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Masks (in place) tokens whose probability is below `min_p` times the top token's:
    p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p), so no softmax is needed."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill_(logits < threshold, _NEG_INF)


def weights_of(logits: Tensor) -> Tensor:
    """Unnormalised probabilities exp(logit - max); -inf logits get weight 0. (A row with every
    logit -inf, which contradictory constraints can make, gets all zeros rather than NaNs.)"""
    top = logits.amax(dim=-1, keepdim=True).clamp_min_(torch.finfo(logits.dtype).min)
    return (logits - top).exp_()


def cumulative(weights: Tensor) -> Tensor:
    """The CDF of each row in float64 (float32 loses the tail over a 150k vocabulary)."""
    return weights.double().cumsum_(dim=-1)  # (cumsum(dtype=float64) is 3x slower on CPU)


def inverse_cdf(cdf: Tensor, u: Tensor) -> Tensor:
    """Position where `u` (uniform in [0, 1), float64) lands in each row's `cdf`. A weight of 0
    leaves the CDF flat, so a zero-weight position is never returned."""
    total = cdf[:, -1:]
    # u * total can round up to total; the largest double below it still lands on a positive weight.
    x = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    # clamp: an all-zero row (see weights_of) would land past the end.
    return torch.searchsorted(cdf, x, right=True).squeeze(1).clamp_max_(cdf.shape[-1] - 1)


def sample_top_k_top_p(logits: Tensor, k: Tensor, p: Tensor | None, window: int, u: Tensor) -> Tensor:
    """Samples rows that all have a top-k (`k` in [1, window]), then top-p over the top k
    renormalised, as vLLM does. Only the `window = max(k)` largest logits are selected (a partial
    sort), which keeps a typical top_k=50 cheap.

    Top-p keeps a token when the mass before it in descending order is < p: the most likely token
    always stays, and ties at the boundary are broken by position.
    """
    values, indices = logits.topk(window, dim=-1, sorted=True)
    positions = torch.arange(window, device=logits.device)
    values.masked_fill_(positions.unsqueeze(0) >= k.unsqueeze(1), _NEG_INF)
    weights = weights_of(values)
    cdf = cumulative(weights)
    if p is not None:
        mass_before = (cdf - weights) / cdf[:, -1:]
        weights.masked_fill_(mass_before >= p.unsqueeze(1), 0.0)
        cdf = cumulative(weights)
    return indices.gather(1, inverse_cdf(cdf, u).unsqueeze(1)).squeeze(1)


def sample_full(logits: Tensor, p: Tensor | None, u: Tensor) -> Tensor:
    """Samples rows without a top-k, with a top-p for rows where `p` < 1 (p None: none do).

    Top-p without a top-k would need each row sorted over the whole vocabulary, by far the most
    expensive step on a CPU. Instead: draw from the full distribution, and accept the token if it
    lies in the nucleus (the mass of strictly more likely tokens is < p), else draw again with the
    next uniform. An accepted token is distributed exactly as the nucleus renormalised; a row
    needs 1/p draws on average, each one masked sum over the row. Rows still rejected after
    `u.shape[1] - 1` draws (small p) sort once and draw from the nucleus with the last uniform.
    """
    weights = weights_of(logits)
    cdf = cumulative(weights)
    tokens = inverse_cdf(cdf, u[:, 0])
    if p is None:
        return tokens
    total = cdf[:, -1]
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
            tokens[pending] = inverse_cdf(cdf[pending], u[pending, attempt])
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


def gather_logprobs(logprobs: Tensor, token_ids: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """For `[n, V]` log-probabilities and `[n]` chosen tokens: `ids [n, 1 + k]` and
    `values [n, 1 + k]` (the chosen token first, then the top k in descending order) and
    `ranks [n]` (1 = most likely; tokens tied with the chosen one count as ahead, as in vLLM)."""
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.int64).unsqueeze(1)
    chosen = logprobs.gather(1, token_ids)
    ranks = (logprobs >= chosen).sum(dim=-1)
    if k > 0:
        top_values, top_ids = logprobs.topk(k, dim=-1)
        return torch.cat([token_ids, top_ids], dim=1), torch.cat([chosen, top_values], dim=1), ranks
    return token_ids, chosen, ranks


def to_logprobs_lists(ids: Tensor, values: Tensor, ranks: Tensor) -> LogprobsLists:
    """Moves a `gather_logprobs` result to Python lists."""
    return LogprobsLists(token_ids=ids.tolist(), logprobs=values.tolist(), ranks=ranks.tolist())
