"""Encoder-only attention (vLLM's `AttentionType.ENCODER_ONLY`): every token of a prompt attends
to every token of the same prompt, in both directions, and no K/V is kept after the step.

An encoder model runs each prompt whole in one step (the engine turns chunked prefill and the
prefix cache off for it, model/resolve.py), so a step's flat batch is a list of whole prompts,
each starting at position 0: the prompts' bounds are where the positions restart. `plan`
derives them once per step; `attend` then runs one SDPA call per layer over the batch, as a
[prompts, heads, length, head_dim] view when every prompt has the same length, else padded to
the longest with the padding keys masked (the padded rows are computed and dropped). A window
(ModernBERT's local layers) masks keys farther than it from the query, in both directions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class EncoderPlan:
    num_seqs: int
    max_len: int
    lens: torch.Tensor  # int64 [num_seqs]
    # Padded layout (prompts of different lengths): token t sits at row index[t] of the
    # [num_seqs * max_len] padded batch, and key_mask [num_seqs, 1, 1, max_len] keeps real keys.
    index: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None
    _masks: dict[int, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """The boolean SDPA mask of a layer (True: attend); None where every key is seen."""
        key = -1 if window is None or window >= self.max_len - 1 else window
        if key not in self._masks:
            mask = self.key_mask
            if key >= 0:
                pos = torch.arange(self.max_len, device=self.lens.device)
                near = (pos[:, None] - pos[None, :]).abs() <= key  # [L, L]
                mask = near if mask is None else mask & near
            self._masks[key] = mask
        return self._masks[key]


def plan(positions: torch.Tensor) -> EncoderPlan:
    """The step's prompts from its positions [T] (each prompt's run 0, 1, ..., n - 1)."""
    T = positions.shape[0]
    starts = torch.nonzero(positions == 0).flatten()
    if T and (starts.numel() == 0 or int(starts[0]) != 0):
        raise RuntimeError("an encoder step must hold whole prompts (positions starting at 0): "
                           "chunked prefill and the prefix cache are off for encoder models")
    bounds = torch.cat([starts, starts.new_tensor([T])])
    lens = bounds.diff()
    n, max_len = int(lens.numel()), int(lens.max()) if T else 0
    if n == 0 or max_len * n == T:  # one length: a view, no padding
        return EncoderPlan(n, max_len, lens)
    seq_of_token = torch.repeat_interleave(torch.arange(n, device=positions.device), lens)
    index = seq_of_token * max_len + positions
    key_mask = (torch.arange(max_len, device=positions.device)[None, :] < lens[:, None]).view(n, 1, 1, max_len)
    return EncoderPlan(n, max_len, lens, index, key_mask)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: EncoderPlan, scale: float,
           window: int | None = None) -> torch.Tensor:
    """q, k, v [T, heads, head_dim] -> [T, heads, head_dim], each prompt attending to itself
    (within `window` of the query where given)."""
    T, H, D = q.shape
    if T == 0:
        return q.new_empty(q.shape)
    B, L = p.num_seqs, p.max_len

    def batched(x: torch.Tensor) -> torch.Tensor:
        if p.index is None:
            return x.view(B, L, H, D).transpose(1, 2)
        out = x.new_zeros(B * L, H, D)
        out.index_copy_(0, p.index, x)
        return out.view(B, L, H, D).transpose(1, 2)

    out = F.scaled_dot_product_attention(batched(q), batched(k), batched(v), attn_mask=p.mask(window), scale=scale)
    out = out.transpose(1, 2).reshape(B * L, H, D)
    return out if p.index is None else out.index_select(0, p.index)
