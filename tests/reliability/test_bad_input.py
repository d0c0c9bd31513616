"""Bad input never breaks anything: every malformed request gets a 4xx in OpenAI's error shape that
names the offending field, and the server keeps serving.

Policy on unknown fields (as vLLM): they are ignored, with a warning in the server's log, so newer
clients keep working; fields the server knows but cannot honour (suffix, best_of != n)
are rejected by name, and so are structured-output specs that do not compile.
"""
from __future__ import annotations

import decimal
import fractions
import json
import math

import httpx
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from reliability_helpers import AUTH, MODEL, bound_lengths, openai_error, wait_until_clean

from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenloom.sampling_params import SamplingParams

VOCAB_SIZE = 49152  # SmolLM2
MAX_MODEL_LEN = 256  # SMALL_SERVER_ARGS


def _post(srv, path: str, body=None, *, content: bytes | None = None, timeout: float = 300) -> httpx.Response:
    if content is None:
        # allow_nan: NaN and Infinity go out as the literals Python's json (and so the server) reads.
        content = json.dumps(body, allow_nan=True).encode()
    return httpx.post(srv.url(path), content=content, headers={**AUTH, "Content-Type": "application/json"}, timeout=timeout)


def _assert_names(response: httpx.Response, fields: set[str]) -> None:
    """A 4xx in OpenAI's shape whose param or message names one of `fields`."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    err = openai_error(response)
    named = {err["param"]} | {f for f in fields if f in err["message"]}
    assert named & fields, (fields, err)


def _assert_still_serving(srv) -> None:
    r = _post(srv, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


# ---- SamplingParams: exotic Python values ---------------------------------------------------------

_PUBLIC_FIELDS = [f for f in SamplingParams.__struct_fields__ if not f.startswith("_")]
_EXOTIC = st.one_of(
    st.sampled_from(
        [
            decimal.Decimal("1.5"), decimal.Decimal("NaN"), fractions.Fraction(1, 3), 1 + 2j, b"bytes", bytearray(b"x"),
            object(), type, np.int64(3), np.int64(-(2**63)), np.uint64(2**64 - 1), np.float32("nan"), np.float64(0.5),
            np.array([1, 2]), np.array(5), np.bool_(True), frozenset({1}), {1, 2}, (1, 2), range(3), math.inf, -math.inf,
            10**400, -(10**400), 2**63, -(2**63) - 1, 1e308, 5e-324, "", "\x00", "1", "nan", [None], [[]], {"a": "b"},
            {1: float("nan")}, {True: 1.0}, {2**70: 1.0}, [2**40], [-1], [1.5], ["a", ""],
        ]
    ),
    st.integers(),
    st.floats(),
    st.text(max_size=5),
    st.lists(st.one_of(st.integers(), st.text(max_size=3), st.none()), max_size=3),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(_PUBLIC_FIELDS), _EXOTIC, max_size=4))
def test_sampling_params_construct_or_value_error_naming_a_field(kwargs):
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:  # msgspec.ValidationError is a ValueError too
        assert any(f in str(e) for f in kwargs), (kwargs, str(e))
        return
    # Whatever constructed crosses the process boundary unchanged.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params


# ---- HTTP: hand-picked bad requests ---------------------------------------------------------------

_COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}

_BAD_COMPLETIONS = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": "hello " * 40_000}, "prompt"),  # huge: 40k tokens, max_model_len 256
    ({"prompt": "hello " * 300}, "prompt"),  # just over max_model_len
    ({"prompt": [VOCAB_SIZE]}, "prompt"),  # out of the vocabulary
    ({"prompt": [-1, 5]}, "prompt"),
    ({"prompt": [[1, 2], [10**30]]}, "prompt"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2**64}, "max_tokens"),
    ({"max_tokens": "lots"}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"n": 129, "temperature": 1.0}, "n"),
    ({"n": 2}, "n"),  # n > 1 with greedy sampling
    ({"n": -3}, "n"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"seed": 2**70}, "seed"),
    ({"logprobs": 21}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop": [1, 2]}, "stop"),
    ({"stop_token_ids": [VOCAB_SIZE + 7]}, "stop_token_ids"),
    ({"logit_bias": {"banana": 1}}, "logit_bias"),
    ({"logit_bias": {str(VOCAB_SIZE): 1}}, "logit_bias"),
    ({"allowed_token_ids": [10**12]}, "allowed_token_ids"),
    ({"min_tokens": 5}, "min_tokens"),  # > max_tokens
    ({"priority": 2**70}, "priority"),
    ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ({"best_of": 3}, "best_of"),
    ({"stream_options": {"include_usage": "maybe"}}, "stream_options"),
    ({"request_id": ["not", "a", "string"]}, "request_id"),
    ({"model": "gpt-17"}, "model"),
    ({"stop": ["\udc80"]}, "stop"),  # a lone surrogate, escaped in the JSON
    # Structured outputs: the compiler's message, under the request's own field name.
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    # An integer past 64 bits cannot cross to the engine core (hypothesis found it: was a 500).
    ({"guided_json": {"": -(2**63) - 1}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"maximum": 2**64}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a+"}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"guided_regex": "a+", "guided_choice": ["b"]}, "guided_choice"),  # two kinds at once
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
]


@pytest.mark.parametrize("changes, field", _BAD_COMPLETIONS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(_BAD_COMPLETIONS)])
def test_bad_completion_request_names_the_field(shared_server, changes, field):
    _assert_names(_post(shared_server, "/v1/completions", {**_COMPLETION, **changes}), {field})


_BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": "Hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "word " * 400}]}, "messages"),  # over max_model_len
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], "tool_choice": "required"},
     "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"maximum": 2**64}}}], "tool_choice": "required"},
     "tools"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": "f"}]}]}, "messages"),
    ({"n": 1000, "temperature": 1.0}, "n"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"add_generation_prompt": "yes please"}, "add_generation_prompt"),
]


@pytest.mark.parametrize("changes, field", _BAD_CHATS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(_BAD_CHATS)])
def test_bad_chat_request_names_the_field(shared_server, changes, field):
    _assert_names(_post(shared_server, "/v1/chat/completions", {**_CHAT, **changes}), {field})


@pytest.mark.parametrize(
    "content",
    [
        b'{"prompt": "\xff\xfe", "max_tokens": 1}',  # invalid UTF-8
        b'{"prompt": "x",',  # truncated
        b"[" * 100_000,  # nested beyond the parser's recursion limit
        b'["an", "array"]',
        b"",
        b"null",
    ],
    ids=["invalid-utf8", "truncated", "deep-nesting", "array", "empty", "null"],
)
def test_malformed_body_is_a_400(shared_server, content):
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = _post(shared_server, path, content=content)
        assert r.status_code == 400, (path, r.status_code, r.text)
        err = openai_error(r)
        assert err["type"] == "invalid_request_error" and "body" in err["message"], err


def test_unknown_fields_are_ignored(shared_server):
    extra = {"frobnicate": True, "max_new_tokens": 500, "": None, "logprobs_extra": [1, 2]}
    for path, body in (("/v1/completions", _COMPLETION), ("/v1/chat/completions", _CHAT)):
        r = _post(shared_server, path, {**body, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1  # max_new_tokens was not taken for max_tokens
    assert "present in the request but ignored" in shared_server.log_text()


def test_request_id_clash_with_a_child_id_leaves_nothing_behind(shared_server):
    """A request with n=2 named "x" has children "0_x" and "1_x"; while a request named "1_x" is
    in flight it is refused as a whole, and once that one ends the name works again."""
    long = {**_COMPLETION, "request_id": "1_clash", "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", shared_server.url("/v1/completions"), json=long, headers=AUTH, timeout=300) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is running
        r = _post(shared_server, "/v1/completions", {**_COMPLETION, "request_id": "clash", "n": 2, "temperature": 1.0})
        _assert_names(r, {"request_id"})
    r = _post(shared_server, "/v1/completions", {**_COMPLETION, "request_id": "clash", "n": 2, "temperature": 1.0})
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1]
    assert wait_until_clean(shared_server), shared_server.metrics()


# ---- HTTP: hypothesis over request bodies ---------------------------------------------------------

_JSON_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.text(alphabet=st.characters(codec="utf-16"), max_size=4),  # lone surrogates too
    st.just("hello " * 500),  # over max_model_len
)
_JSON = st.recursive(
    _JSON_SCALAR,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=6), children, max_size=4)),
    max_leaves=12,
)
_TOKEN_LISTS = st.lists(st.integers(-5, VOCAB_SIZE + 5), max_size=6)
_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "wizard", ""]), "content": st.one_of(st.text(max_size=20), _JSON)}
    ),
    max_size=3,
)
_UNKNOWN = st.sampled_from(["frobnicate", "max_new_tokens", "Temperature", "functions", "response_format"])


def _mutations(fields: list[str], special: dict) -> st.SearchStrategy[dict]:
    name = st.one_of(st.sampled_from(fields), _UNKNOWN)
    return st.dictionaries(name, _JSON, min_size=1, max_size=3).flatmap(
        lambda d: st.fixed_dictionaries({k: special[k] if k in special else st.just(v) for k, v in d.items()})
        if d
        else st.just(d)
    )


def _fuzz_one(srv, path: str, base: dict, changes: dict, known: set[str]) -> None:
    body = bound_lengths({**base, **changes})
    r = _post(srv, path, body)
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code != 200:
        # The base body is valid: the error names a field this example changed. A request's own
        # chat template renders the messages into the prompt: a prompt it makes too long is
        # named as the messages' (e.g. the template "hello " * 500, which renders 500 words).
        fields = {k for k in changes if k in known}
        if "chat_template" in fields:
            fields.add("messages")
        _assert_names(r, fields)


_COMPLETION_FIELDS = sorted(CompletionRequest.model_fields)
_CHAT_FIELDS = sorted(ChatCompletionRequest.model_fields)
_FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.slow
@_FUZZ
@given(changes=_mutations(_COMPLETION_FIELDS, {"prompt": st.one_of(_JSON, _TOKEN_LISTS, st.lists(_TOKEN_LISTS, max_size=3))}))
def test_fuzzed_completion_bodies_get_a_4xx_naming_a_field(shared_server, changes):
    _fuzz_one(shared_server, "/v1/completions", _COMPLETION, changes, set(_COMPLETION_FIELDS))


@pytest.mark.slow
@_FUZZ
@given(changes=_mutations(_CHAT_FIELDS, {"messages": st.one_of(_MESSAGES, _JSON)}))
@example(changes={"chat_template": "hello " * 500})  # found by CI's run: a template that renders too long
def test_fuzzed_chat_bodies_get_a_4xx_naming_a_field(shared_server, changes):
    _fuzz_one(shared_server, "/v1/chat/completions", _CHAT, changes, set(_CHAT_FIELDS))


def test_still_serving_and_clean_after_the_bad_input(shared_server):
    _assert_still_serving(shared_server)
    assert wait_until_clean(shared_server), shared_server.metrics()
