"""Structured outputs: grammars compiled with xgrammar, one matcher per request, and the step's
token bitmask. Engine-core side (the scheduler owns the matchers, as vLLM's does); the caller's
input processor uses `validate` only, and the sampler applies the bitmask (sample/grammar.py)."""
from tokenloom.structured_output.backend import spec_key, validate
from tokenloom.structured_output.manager import StructuredOutputManager, StructuredOutputRequest

__all__ = ["StructuredOutputManager", "StructuredOutputRequest", "spec_key", "validate"]
