"""Attention backends behind one interface (`AttentionBackend`): `torch` (CPU, the reference) and
`triton` (GPU kernels). Use `get_attn_backend` to pick one."""
from tokenloom.attention.backend import AttentionBackend
from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.attention.selector import get_attn_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attn_backend"]
