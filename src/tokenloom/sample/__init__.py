"""Batched sampling over the model runner's persistent batch (see `sampler.py`)."""
from tokenloom.sample.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput"]
