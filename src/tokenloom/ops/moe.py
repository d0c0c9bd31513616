"""Mixture-of-experts compute, as vLLM's `FusedMoE` shapes it: route, group, multiply, sum back.

1. `select_experts`: the router's logits [T, E] -> each token's top-k experts and their weights
   (softmax or sigmoid scores, renormalised over the k or not, as the family's config says).
2. `group_by_expert`: the T * k (token, expert) pairs sorted by expert (a stable sort), so each
   expert's tokens sit side by side: `[[3, 0], [0, 2]]` (token 0 chose experts 3 and 0, token 1
   chose 0 and 2) becomes experts `[0, 2, 3]` with tokens `[0, 1 | 1 | 0]`.
3. `fused_experts`: for each expert that some token chose, one call of `expert_fn(e, x[tokens])`
   (one matmul per weight over only its tokens: an expert's weights are read once per step however
   many tokens chose it, and at batch 1 only the k chosen experts are touched), its rows scaled by
   their routing weights and added back into the tokens' rows (`index_add_`).

The expert function is the caller's (model/moe.FusedMoE: float weights stacked [E, ...], or one
quantized matmul per expert), so a family with other experts (biases, another activation, other
weight formats) reuses the routing and the grouping as they are.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

SCORING_FUNCS = ("softmax", "sigmoid", "topk_softmax")


def select_experts(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax",
                   renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights float32 [T, k], expert ids int64 [T, k]).

    `scoring`: "softmax" (softmax over all E, then the top k: Qwen-MoE, Mixtral), "sigmoid"
    (each expert's sigmoid, then the top k), or "topk_softmax" (the top k logits, then a softmax
    over those k: gpt-oss; the same experts as "softmax" with renormalize, computed as its
    reference does). `renormalize`: the k weights divided by their sum (HF's norm_topk_prob;
    Mixtral always; no effect after "topk_softmax")."""
    if scoring not in SCORING_FUNCS:
        raise ValueError(f"scoring must be one of {', '.join(SCORING_FUNCS)}, got {scoring!r}")
    E = router_logits.shape[-1]
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be between 1 and the {E} experts, got {top_k}")
    logits = router_logits.float()
    if scoring == "topk_softmax":
        values, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(values, dim=-1), ids
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass(slots=True)
class ExpertGroups:
    """The (token, expert) pairs of a step sorted by expert.

    experts[j]'s pairs are positions offsets[j]:offsets[j + 1] of `token_rows` (the token each pair
    came from) and `pair_ids` (its index into the flattened [T * k] routing weights)."""

    experts: list[int]
    offsets: list[int]
    token_rows: torch.Tensor  # int64 [T * k]
    pair_ids: torch.Tensor  # int64 [T * k]


def group_by_expert(topk_ids: torch.Tensor) -> ExpertGroups:
    """topk_ids [T, k] -> the pairs grouped by expert, experts in increasing order (the order
    transformers' loop adds them in), each expert's tokens in token order (a stable sort)."""
    k = topk_ids.shape[-1]
    flat = topk_ids.reshape(-1)
    pair_ids = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[pair_ids], return_counts=True)
    offsets = [0]
    for c in counts.tolist():
        offsets.append(offsets[-1] + c)
    return ExpertGroups(experts.tolist(), offsets, pair_ids // k, pair_ids)


ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


def fused_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  expert_fn: ExpertFn) -> torch.Tensor:
    """x [T, H], the routing of `select_experts` -> sum over each token's k experts of
    weight * expert_fn(expert, token rows), [T, H] in x's dtype.

    `expert_fn(e, rows)`: expert e over its tokens' rows [n, H] -> [n, H]. Each expert's
    weighted rows are added in x's dtype in increasing expert order, as transformers does."""
    T = x.shape[0]
    out = torch.zeros_like(x)
    if T == 0:
        return out
    if T == 1:  # batch 1: the k chosen experts, no grouping to do
        ids = topk_ids.reshape(-1).tolist()
        for j in sorted(range(len(ids)), key=ids.__getitem__):
            out += expert_fn(ids[j], x) * topk_weights[0, j].to(x.dtype)
        return out
    groups = group_by_expert(topk_ids)
    weights = topk_weights.reshape(-1)
    for j, e in enumerate(groups.experts):
        lo, hi = groups.offsets[j], groups.offsets[j + 1]
        rows = groups.token_rows[lo:hi]
        y = expert_fn(e, x.index_select(0, rows))
        out.index_add_(0, rows, y * weights[groups.pair_ids[lo:hi]].to(y.dtype).unsqueeze(1))
    return out
