"""The prefix-cache hash chain.

A full block of `block_size` tokens is identified by `hash(parent_hash, its token ids)`, where the
parent is the hash of the block before it (or a fixed root for the first block). Two requests that
share their first k full blocks of tokens therefore share the first k hashes, and a lookup walks
the chain from the start until the first miss.

Why SHA-256 and not Python's `hash()` of a tuple: a collision would silently hand one request the
K/V of a different text, and `hash()` is only 64 bits. SHA-256 of a 16-token block is cheap next
to a step, and a block is hashed once, when it becomes full. The digest is also stable across
processes and runs (no PYTHONHASHSEED), so the chain means the same thing everywhere.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Any, NewType, Sequence

BlockHash = NewType("BlockHash", bytes)

# Parent of the first block of every request. A fixed value: the chain is content-addressed and
# must agree between runs and processes.
ROOT_BLOCK_HASH = BlockHash(hashlib.sha256(b"tokenloom/prefix-cache/root").digest())


def root_block_hash(lora_request: Any = None) -> BlockHash:
    """The hash chain's root: the base model's, or one per LoRA adapter (its id), whose K/V differ."""
    if lora_request is None:
        return ROOT_BLOCK_HASH
    return BlockHash(hashlib.sha256(ROOT_BLOCK_HASH + b"lora" + lora_request.lora_int_id.to_bytes(8, "little")).digest())


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The parent digest has a fixed length (32 bytes) and every block has the same number of
    tokens, so plain concatenation is unambiguous."""
    return BlockHash(hashlib.sha256(parent + array("q", token_ids).tobytes()).digest())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
