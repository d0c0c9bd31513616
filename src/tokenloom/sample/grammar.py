"""Structured outputs in the sampler: a grammar's token bitmask applied to the logits.

The bitmask comes from the engine core's grammar matchers (structured_output/), one row per
constrained request, in xgrammar's layout (int32 words, bit t of a row allows token t). It is
applied first, before penalties, temperature, min-p, top-k and top-p, so every later stage sees
only the tokens the grammar allows (a disallowed token's logit is -inf).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(slots=True)
class GrammarMask:
    """`bitmask[j]` constrains logits row `positions[j]` of the step (the other rows are free)."""

    bitmask: Tensor  # int32 [k, ceil(V/32)]
    positions: np.ndarray  # int64 [k], distinct, in [0, num logits rows)

    def select(self, logits_row: int) -> "GrammarMask | None":
        """The mask of one logits row, renumbered as row 0 (for sampling one row alone)."""
        hit = np.flatnonzero(self.positions == logits_row)
        if hit.size == 0:
            return None
        j = int(hit[0])
        return GrammarMask(self.bitmask[j : j + 1], np.zeros(1, dtype=np.int64))


def apply_grammar_mask(logits: Tensor, mask: GrammarMask, aligned: Tensor) -> None:
    """In place: the constrained rows of `logits` keep only their allowed tokens. `aligned` is a
    workspace of at least [len(logits), W] int32 rows, so the kernel reads bitmask row i for logits
    row i (xgrammar's `indices` name the same row of both)."""
    # Imported here, not at the top: an engine core that never sees a grammar never loads
    # xgrammar (its grammar manager has loaded it before any mask exists).
    import xgrammar as xgr

    n, vocab_size = logits.shape
    positions = mask.positions
    if positions.size == n and bool((positions == np.arange(n)).all()):
        bitmask = mask.bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size)
        return
    buf = aligned[:n]
    buf[torch.from_numpy(positions).to(buf.device)] = mask.bitmask.to(buf.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, buf, vocab_size=vocab_size, indices=positions.tolist())
