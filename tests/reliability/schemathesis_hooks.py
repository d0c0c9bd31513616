"""Schemathesis hooks for test_schemathesis.py (loaded through SCHEMATHESIS_HOOKS).

Schemathesis may generate valid requests that ask for hundreds of tokens (or n=128 of them): they
would only make the run slow, so their length fields are brought down before each call. Every
invalid value (negative, of the wrong type, beyond int64) goes out unchanged.
"""
from __future__ import annotations

import os
import sys

import schemathesis

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reliability_helpers import bound_lengths  # noqa: E402


@schemathesis.hook
def before_call(context, case, kwargs):
    if isinstance(case.body, dict):
        bound_lengths(case.body)
