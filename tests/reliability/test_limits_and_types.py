"""Limits at the door and strict types (issue 21).

Every number a request carries is checked against what the engine can store and use, not only
against being finite: `repetition_penalty: 1e39` overflowed the sampler's float32 tensor and took
the engine core (and every request in flight) down; `1e-300` rounded to 0 in float32. And the
README's promise that wrong types get a 4xx holds: nothing is coerced ("16" is not 16).

Fields kept lenient on purpose: a float field takes an integer ("temperature": 1), since JSON has
one number type.
"""
from __future__ import annotations

import json

import httpx
import pytest
from reliability_helpers import AUTH, MODEL, openai_error, wait_until_clean

from tokenloom.sampling_params import SamplingParams

_COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0}
_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "temperature": 0}


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url(path), content=json.dumps(body).encode(), headers={**AUTH, "Content-Type": "application/json"}, timeout=120)


def _assert_400_naming(response: httpx.Response, field: str, *words: str) -> dict:
    assert response.status_code == 400, (response.status_code, response.text)
    err = openai_error(response)
    assert err["param"] == field or field in err["message"], err
    for word in words:
        assert word in err["message"], err
    return err


# ---- numbers the engine cannot store or use ------------------------------------------------------

_OUT_OF_RANGE = [
    ("repetition_penalty", 1e39, "10000"),  # the crash: beyond float32
    ("repetition_penalty", 3e38, "10000"),  # fits float32, overflows a logit times it
    ("repetition_penalty", 1e-300, "0.0001"),  # rounds to 0 in float32
    ("top_p", 1e-300, "1.18e-38"),  # rounds to 0 in float32
    ("top_p", 1e-45, "1.18e-38"),
    ("presence_penalty", 1e39, "2"),
    ("frequency_penalty", -1e39, "-2"),
    ("temperature", 1e39, "2"),
    ("min_p", 1e39, "1"),
    ("seed", 2**64, "18446744073709551615"),
    ("seed", -(2**63) - 1, "-9223372036854775808"),
    ("top_k", 2**63, "9223372036854775807"),
    ("top_k", -2, "-1"),
    ("max_tokens", 2**63, "9223372036854775807"),
    ("min_tokens", 2**63, "9223372036854775807"),
    ("logprobs", 21, "20"),
    ("n", 129, "128"),
    ("best_of", 129, "128"),
    ("priority", 2**63, "9223372036854775807"),
]


@pytest.mark.parametrize("field, value, limit", _OUT_OF_RANGE, ids=[f"{f}={v!r}" for f, v, _ in _OUT_OF_RANGE])
def test_out_of_range_number_is_a_400_naming_field_and_limit(shared_server, field, value, limit):
    body = {**_COMPLETION, "temperature": 1.0, field: value}
    _assert_400_naming(_post(shared_server, "/v1/completions", body), field, limit)


@pytest.mark.parametrize("field, values", [
    ("stop_token_ids", [2**31]), ("allowed_token_ids", [2**31]), ("allowed_token_ids", [-1]), ("stop_token_ids", [49152]),
])  # fmt: skip
def test_token_ids_outside_the_vocabulary_are_a_400(shared_server, field, values):
    _assert_400_naming(_post(shared_server, "/v1/chat/completions", {**_CHAT, field: values}), field)


@pytest.mark.parametrize("kwargs, field, limit", [
    (dict(repetition_penalty=1e39), "repetition_penalty", "[0.0001, 10000]"),
    (dict(repetition_penalty=1e-300), "repetition_penalty", "[0.0001, 10000]"),
    (dict(repetition_penalty=3e38), "repetition_penalty", "[0.0001, 10000]"),
    (dict(top_p=1e-300), "top_p", "1.18e-38"),
])  # fmt: skip
def test_sampling_params_refuse_what_float32_cannot_hold(kwargs, field, limit):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)
    assert limit in str(info.value)


def test_the_largest_accepted_values_still_generate(shared_server):
    body = {**_COMPLETION, "temperature": 2.0, "top_p": 1.1754943508222875e-38, "repetition_penalty": 1e4,
            "presence_penalty": 2, "frequency_penalty": -2, "top_k": 2**63 - 1, "seed": 2**64 - 1,
            "logit_bias": {"0": 100, "1": -100}, "max_tokens": 3}  # fmt: skip
    r = _post(shared_server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    r = _post(shared_server, "/v1/completions", {**body, "repetition_penalty": 1e-4, "top_p": 1.0, "seed": -(2**63)})
    assert r.status_code == 200, r.text


# ---- strict types: one test per coercion the issue found -------------------------------------------


def test_max_tokens_as_a_string_is_a_400(shared_server):
    _assert_400_naming(_post(shared_server, "/v1/completions", {**_COMPLETION, "max_tokens": "16"}), "max_tokens")


def test_max_tokens_as_a_bool_is_a_400(shared_server):
    _assert_400_naming(_post(shared_server, "/v1/completions", {**_COMPLETION, "max_tokens": True}), "max_tokens")


def test_stream_as_a_string_is_a_400(shared_server):
    _assert_400_naming(_post(shared_server, "/v1/completions", {**_COMPLETION, "stream": "yes"}), "stream")


def test_n_as_a_string_is_a_400(shared_server):
    _assert_400_naming(_post(shared_server, "/v1/completions", {**_COMPLETION, "n": "2", "temperature": 1.0}), "n")


@pytest.mark.parametrize("key", [" 1 ", "1_0", "٣"], ids=["spaces", "underscore", "arabic-indic-digit"])
def test_logit_bias_key_that_is_not_plain_digits_is_a_400(shared_server, key):
    for path, base in (("/v1/completions", _COMPLETION), ("/v1/chat/completions", _CHAT)):
        _assert_400_naming(_post(shared_server, path, {**base, "logit_bias": {key: 5}}), "logit_bias")
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={key: 5.0})  # the offline API refuses them too


@pytest.mark.parametrize("body", [
    {"temperature": 1}, {"top_p": 1}, {"presence_penalty": 0}, {"repetition_penalty": 2},
])  # fmt: skip
def test_integers_are_accepted_for_float_fields(shared_server, body):
    r = _post(shared_server, "/v1/completions", {**_COMPLETION, **body})
    assert r.status_code == 200, r.text


def test_still_serving_and_clean(shared_server):
    r = _post(shared_server, "/v1/completions", _COMPLETION)
    assert r.status_code == 200, r.text
    assert wait_until_clean(shared_server), shared_server.metrics()
