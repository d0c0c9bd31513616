"""Speculative decoding: proposers of draft tokens (n-gram prompt lookup). The model runner
verifies the drafts with its own sampler; the scheduler schedules them (DESIGN.md's path)."""
