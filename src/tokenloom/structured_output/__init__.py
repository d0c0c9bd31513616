"""Structured outputs: grammars compiled with xgrammar, one matcher per request, and the step's
token bitmask. Engine-core side (the scheduler owns the matchers, as vLLM's does); the caller's
input processor uses `validate` only, and the sampler applies the bitmask (sample/grammar.py)."""
from typing import TYPE_CHECKING, Any

from tokenloom.structured_output.backend import spec_key, validate

if TYPE_CHECKING:
    from tokenloom.structured_output.manager import StructuredOutputManager, StructuredOutputRequest

__all__ = ["StructuredOutputManager", "StructuredOutputRequest", "spec_key", "validate"]


def __getattr__(name: str) -> Any:
    # The manager (and xgrammar with it) loads when the engine core asks for it, not when the
    # caller's input processor imports `validate`.
    if name in ("StructuredOutputManager", "StructuredOutputRequest"):
        from tokenloom.structured_output import manager

        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
