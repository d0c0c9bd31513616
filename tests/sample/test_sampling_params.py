"""SamplingParams validation: every field, wrong types, normalisation, msgpack round trip."""
from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenloom.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

FIELDS = [f.name for f in msgspec.structs.fields(SamplingParams)]

# (kwargs, the field the message must name)
INVALID = [
    (dict(n=0), "n"),
    (dict(n=MAX_N + 1), "n"),
    (dict(n=1.5), "n"),
    (dict(n="2"), "n"),
    (dict(n=True), "n"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=2.5), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=None), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_p=-1), "top_p"),
    (dict(top_p="0.9"), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(min_p=-0.01), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=[0.1]), "min_p"),
    (dict(presence_penalty=2.01), "presence_penalty"),
    (dict(presence_penalty=-2.01), "presence_penalty"),
    (dict(presence_penalty="x"), "presence_penalty"),
    (dict(frequency_penalty=3), "frequency_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(seed=1.5), "seed"),
    (dict(seed="42"), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(seed=-(2**63) - 1), "seed"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(max_tokens=1.5), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(min_tokens="3"), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(logprobs=2.0), "logprobs"),
    (dict(prompt_logprobs=-2), "prompt_logprobs"),
    (dict(prompt_logprobs=MAX_LOGPROBS + 1), "prompt_logprobs"),
    (dict(prompt_logprobs="all"), "prompt_logprobs"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=1.5), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=True), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens="8"), "truncate_prompt_tokens"),
    (dict(stop=""), "stop"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop=[1]), "stop"),
    (dict(stop=5), "stop"),
    (dict(stop=["x"], detokenize=False), "detokenize"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids=["5"]), "stop_token_ids"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"abc": 1.0}), "logit_bias"),
    (dict(logit_bias={1.5: 1.0}), "logit_bias"),
    (dict(logit_bias={1: "x"}), "logit_bias"),
    (dict(logit_bias={1: math.nan}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-3]), "allowed_token_ids"),
    (dict(allowed_token_ids=["a"]), "allowed_token_ids"),
    (dict(allowed_token_ids=7), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(bad_words=[3]), "bad_words"),
    (dict(bad_words="word"), "bad_words"),
    (dict(output_kind=3), "output_kind"),
    (dict(output_kind="delta"), "output_kind"),
    (dict(output_kind=1.0), "output_kind"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(detokenize=1), "detokenize"),
    (dict(skip_special_tokens=None), "skip_special_tokens"),
    (dict(spaces_between_special_tokens=0), "spaces_between_special_tokens"),
    (dict(include_stop_str_in_output="no"), "include_stop_str_in_output"),
    (dict(temperature=0.0, n=2), "n"),
    (dict(structured_outputs={"json": {}}), "structured_outputs"),
    (dict(_bad_words_token_ids=[[]]), "_bad_words_token_ids"),
    (dict(_bad_words_token_ids=[1, 2]), "_bad_words_token_ids"),
    (dict(_all_stop_token_ids=[-1]), "_all_stop_token_ids"),
]


@pytest.mark.parametrize(("kwargs", "field"), INVALID, ids=[f"{f}={k}" for k, f in INVALID])
def test_invalid_value_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_every_user_field_has_an_invalid_case():
    covered = {field for _, field in INVALID} | {f for kwargs, _ in INVALID for f in kwargs}
    assert set(FIELDS) - covered == set()


def test_out_of_range_message_states_the_range():
    with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\], at least 1.18e-38 .*, got 0\.0"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match=r"presence_penalty must be a number in \[-2, 2\]"):
        SamplingParams(presence_penalty=5)


def test_valid_extremes_construct():
    SamplingParams(n=MAX_N, temperature=2.0, top_p=1e-9, min_p=1.0, top_k=1, presence_penalty=-2, frequency_penalty=2)
    SamplingParams(max_tokens=None, min_tokens=1000, logprobs=0, prompt_logprobs=MAX_LOGPROBS, seed=-(2**63))
    SamplingParams(seed=2**64 - 1, repetition_penalty=1e-3, stop=[], stop_token_ids=[], bad_words=[])


def test_normalisation_follows_vllm():
    p = SamplingParams(stop="end", top_k=-1, seed=-1, logprobs=True, stop_token_ids=[5, 5, 3])
    assert p.stop == ["end"] and p.top_k == 0 and p.seed is None and p.logprobs == 1
    assert p.stop_token_ids == [5, 3]
    assert SamplingParams(logprobs=False).logprobs == 0
    assert SamplingParams(bad_words=["a", "b", "a"]).bad_words == ["a", "b"]
    # numpy scalars are accepted and stored as Python numbers
    q = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), max_tokens=np.int32(7))
    assert type(q.n) is int and type(q.temperature) is float and q.max_tokens == 7
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA


def test_temperature_edges():
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.2)
    assert greedy.sampling_type_greedy
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)  # meaningless when greedy
    assert SamplingParams(temperature=1e-7).temperature == 0.0  # vanishing: greedy
    assert SamplingParams(temperature=1e-3).temperature == 0.01  # tiny: raised to 0.01
    assert not SamplingParams(temperature=1e-3).sampling_type_greedy
    assert SamplingParams(temperature=1).temperature == 1.0


def test_logit_bias_keys_and_clamping():
    p = SamplingParams(logit_bias={"5": 250, 7: -1e9, 9: 0.5, "11": -math.inf})
    assert p.logit_bias == {5: 100.0, 7: -100.0, 9: 0.5, 11: -100.0}


def test_all_stop_token_ids():
    p = SamplingParams(stop_token_ids=[3], _all_stop_token_ids=[2, 3])
    assert p.all_stop_token_ids == {2, 3}
    assert SamplingParams(_all_stop_token_ids={4, 1})._all_stop_token_ids == [1, 4]  # a set, as vLLM keeps it


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(stop_token_ids=[10]), "stop_token_ids"),
        (dict(allowed_token_ids=[0, 99, 100]), "allowed_token_ids"),
        (dict(logit_bias={150: 1.0}), "logit_bias"),
        (dict(_all_stop_token_ids=[100]), "_all_stop_token_ids"),
        (dict(_bad_words_token_ids=[[1, 500]]), "_bad_words_token_ids"),
        (dict(structured_outputs=StructuredOutputsParams(regex="a", _reasoning=(5, 100, False))),
         "structured_outputs._reasoning"),
    ],
)
def test_verify_against_vocab(kwargs, field):
    vocab = 10 if field == "stop_token_ids" else 100
    SamplingParams(**kwargs).verify_against_vocab(1000)
    with pytest.raises(ValueError, match=rf"{field}.*vocab_size={vocab}"):
        SamplingParams(**kwargs).verify_against_vocab(vocab)


def _every_field_set() -> SamplingParams:
    return SamplingParams(
        n=3, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.3, temperature=0.7, top_p=0.9,
        top_k=40, min_p=0.05, seed=2**63 + 5, stop=["\n\n", "END"], stop_token_ids=[2, 7], ignore_eos=True,
        max_tokens=100, min_tokens=4, logprobs=5, prompt_logprobs=3, truncate_prompt_tokens=64, detokenize=True,
        skip_special_tokens=False, spaces_between_special_tokens=False, include_stop_str_in_output=True,
        output_kind=RequestOutputKind.DELTA,
        logit_bias={3: 1.5, 4: -2.0}, allowed_token_ids=[1, 2, 3, 4], bad_words=["foo", "bar baz"],
        _bad_words_token_ids=[[11], [12, 13]], _all_stop_token_ids=[0, 2, 7],
        structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": {"a": {"enum": [1, "x"]}}}),
    )


def test_msgpack_round_trip_preserves_every_field():
    params = _every_field_set()
    # Nothing left at its default (but detokenize, which stop strings need True).
    assert [f for f in FIELDS if getattr(params, f) == getattr(SamplingParams(), f)] == ["detokenize"]
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params
    assert {f: getattr(decoded, f) for f in FIELDS} == {f: getattr(params, f) for f in FIELDS}
    assert isinstance(decoded.output_kind, RequestOutputKind)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams()), type=SamplingParams) == SamplingParams()


# ---- structured outputs: shape checks (whether a schema compiles is the input processor's)


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(json={"type": "object"}, regex="a+"), "json, regex"),
    (dict(choice=["a"], grammar="root ::= \"a\"", json_object=True), "choice, grammar, json_object"),
    (dict(), "one of json, regex"),
    (dict(json=5), "structured_outputs.json"),
    (dict(json=" "), "structured_outputs.json"),
    (dict(json={"maximum": 2**64}), "structured_outputs.json"),  # cannot cross to the core
    (dict(json={"default": object()}), "structured_outputs.json"),
    (dict(regex=""), "structured_outputs.regex"),
    (dict(grammar=["x"]), "structured_outputs.grammar"),
    (dict(choice="yes"), "structured_outputs.choice"),
    (dict(choice=["yes", ""]), "structured_outputs.choice"),
    (dict(json_object="yes"), "structured_outputs.json_object"),
    (dict(json_object=True, disable_any_whitespace=1), "structured_outputs.disable_any_whitespace"),
])
def test_structured_outputs_shape_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StructuredOutputsParams(**kwargs)


def test_structured_outputs_one_kind_and_round_trip():
    so = StructuredOutputsParams(choice=["yes", "no", "yes"], json_object=False)
    assert so.kind == "choice" and so.choice == ["yes", "no"]  # json_object=False is "not set"
    params = SamplingParams(structured_outputs=so)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params
    # Two kinds at once are refused also when decoded in the engine core (a foreign encoder).
    raw = msgspec.msgpack.encode({"structured_outputs": {"regex": "a", "grammar": "root ::= \"a\""}})
    with pytest.raises(ValueError, match="exactly one kind"):
        msgspec.msgpack.decode(raw, type=SamplingParams)


def test_decoding_validates_too():
    """A value that only a foreign encoder could produce is still caught in the engine core."""
    raw = msgspec.msgpack.encode({"top_p": 0.0})
    with pytest.raises(ValueError, match="top_p"):
        msgspec.msgpack.decode(raw, type=SamplingParams)
    raw = msgspec.msgpack.encode({"temperature": 0, "n": 2})
    with pytest.raises(ValueError, match="n must be 1"):
        msgspec.msgpack.decode(raw, type=SamplingParams)


def test_clone_validates_changes():
    assert SamplingParams().clone(temperature=0.5).temperature == 0.5
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams().clone(temperature="hot")


# ---- property: anything either constructs (and round-trips) or raises a ValueError naming a field

_ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-3, max_value=3),
    st.text(max_size=4),
    st.lists(st.one_of(st.integers(-2, 2**33), st.text(max_size=3), st.floats(-2, 2)), max_size=4),
    st.lists(st.lists(st.integers(-1, 50), max_size=3), max_size=3),
    st.dictionaries(
        st.one_of(st.integers(-2, 2**40), st.text(max_size=3), st.floats(-2, 2), st.booleans()),
        st.one_of(st.floats(allow_nan=True), st.integers(-(2**1100), 2**1100), st.text(max_size=2)),
        max_size=3,
    ),
)


def _construct_or_name_a_field(kwargs: dict) -> None:
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        assert any(f in str(e) for f in kwargs), (kwargs, str(e))
        return
    # A constructed value is in range and survives the trip to the engine core unchanged.
    assert 1 <= params.n <= MAX_N and 0.0 <= params.temperature <= 2.0 and 0.0 < params.top_p <= 1.0
    assert params.top_k >= 0 and 0.0 <= params.min_p <= 1.0 and params.repetition_penalty > 0
    assert isinstance(params.output_kind, RequestOutputKind)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(FIELDS), _ANY, max_size=6))
def test_random_kwargs_construct_or_raise_value_error_naming_a_field(kwargs):
    _construct_or_name_a_field(kwargs)


_PLAUSIBLE = {
    "n": st.integers(0, MAX_N + 1),
    "presence_penalty": st.floats(-2.5, 2.5),
    "frequency_penalty": st.floats(-2.5, 2.5),
    "repetition_penalty": st.floats(-0.5, 3),
    "temperature": st.floats(-0.1, 2.1),
    "top_p": st.floats(-0.1, 1.1),
    "top_k": st.integers(-3, 100),
    "min_p": st.floats(-0.1, 1.1),
    "seed": st.one_of(st.none(), st.integers(-(2**64), 2**65)),
    "stop": st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(-1, 100), max_size=3)),
    "max_tokens": st.one_of(st.none(), st.integers(-1, 50)),
    "min_tokens": st.integers(-1, 60),
    "logprobs": st.one_of(st.none(), st.integers(-2, MAX_LOGPROBS + 2)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(-2, MAX_LOGPROBS + 2)),
    "output_kind": st.integers(-1, 3),
    "logit_bias": st.one_of(st.none(), st.dictionaries(st.integers(-1, 100), st.floats(-200, 200), max_size=3)),
    "allowed_token_ids": st.one_of(st.none(), st.lists(st.integers(-1, 100), max_size=3)),
    "bad_words": st.one_of(st.none(), st.lists(st.text(max_size=3), max_size=3)),
}


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({}, optional={k: st.one_of(v, _ANY) for k, v in _PLAUSIBLE.items()}))
def test_plausible_kwargs_construct_or_raise_value_error_naming_a_field(kwargs):
    """Values near the valid ranges, so that many construct and round-trip."""
    _construct_or_name_a_field(kwargs)


def test_from_optional_takes_none_for_the_default():
    # vLLM's constructor for callers holding optional values (e.g. a request's unset fields).
    assert SamplingParams.from_optional(temperature=None, top_p=None, max_tokens=3) == SamplingParams(max_tokens=3)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_optional(top_p=2.0)


def test_reasoning_token_ids_are_checked_where_they_are_made():
    # The server's own field (--reasoning-parser): a malformed value is refused at construction.
    for bad in [(1, 2), (1, -2, True), (1, 2, 1), ("a", 2, True)]:
        with pytest.raises(ValueError, match="structured_outputs._reasoning must be"):
            StructuredOutputsParams(regex="a", _reasoning=bad)
