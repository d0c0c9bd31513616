"""The incremental detokenizer on SmolLM2's real tokenizer: streamed text equals a one-shot decode,
split characters are held back, stop strings cut where they should and never leak."""
from __future__ import annotations

import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tokenloom.engine import detokenizer as detokenizer_module
from tokenloom.engine.detokenizer import IncrementalDetokenizer
from tokenloom.sampling_params import SamplingParams

VOCAB_SIZE = 49152

TEXTS = [
    "Hello, world! How are you today?",
    "Emoji: 😀🎉👍🏽 and a family 👩‍👩‍👧 and a flag 🇫🇷.",
    "中文测试：你好，世界。日本語のテキスト、한국어 텍스트",
    "Accents: àéîõü ÇÑ ß øå — “quotes” … naïve café",
    "def f(x):\n\treturn {'a': [x ** 2, None]}  # ≥ ≤ ∑\n",
    "<|im_start|>assistant\nHi<|im_end|> trailing",
    "\u00a0spaces   and\n\nnewlines\r\n",
]


def stream(
    detok: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int] | None = None
) -> tuple[list[str], str | None]:
    """Feeds ids in chunks (one at a time by default) until they run out or a stop string matches;
    the last call finishes. Returns the text deltas and the matched stop string."""
    deltas = []
    i, k = 0, 0
    while i < len(ids):
        size = chunk_sizes[k % len(chunk_sizes)] if chunk_sizes else 1
        chunk, i, k = ids[i : i + size], i + size, k + 1
        stop = detok.update(chunk, finished=i >= len(ids))
        deltas.append(detok.get_next_output_text(i >= len(ids) or stop is not None, delta=True))
        if stop is not None:
            return deltas, stop
    return deltas, None


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_decode(tokenizer, text, skip_special_tokens):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(skip_special_tokens=skip_special_tokens))
    deltas, _ = stream(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert detok.output_text == "".join(deltas)
    assert detok.output_token_ids == ids
    # Valid text never shows a replacement char for a character still arriving.
    assert not any("\ufffd" in d for d in deltas)


def test_split_character_is_held_back_until_complete(tokenizer):
    ids = tokenizer.encode(" 😀", add_special_tokens=False)
    assert len(ids) == 2  # the emoji's four bytes arrive in two tokens
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    assert detok.update(ids[:1]) is None
    assert detok.get_next_output_text(False, delta=True) == ""
    detok.update(ids[1:])
    assert detok.get_next_output_text(False, delta=True) == " 😀"


def test_incomplete_bytes_are_flushed_at_finish(tokenizer):
    # The output ends in the middle of a character: at finish the bytes are shown as decode shows them.
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    detok.update(ids)
    assert "\ufffd" not in detok.get_next_output_text(False, delta=False)
    detok.update([], finished=True)
    assert detok.get_next_output_text(True, delta=False) == tokenizer.decode(ids)
    assert detok.output_text.endswith("\ufffd")


def test_prompt_context_is_not_repeated(tokenizer):
    prompt = tokenizer.encode("The answer is", add_special_tokens=False)
    ids = tokenizer.encode(" 42, 世界", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(), prompt)
    assert "".join(stream(detok, ids)[0]) == " 42, 世界"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.lists(
        st.sampled_from(list("ab xyz\n\t{}():=_.,!?-'\"éèçüßø中文字日本語한국😀🎉👍🏽\u200d🇫🇷∑≥"))
        | st.sampled_from(["<|im_end|>", "<|endoftext|>", " the", "def "])
        | st.text(max_size=3),
        min_size=1,
        max_size=30,
    ).map("".join).filter(bool),
    chunk_sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    skip=st.booleans(),
)
def test_random_text_in_random_chunks_equals_decode(tokenizer, text, chunk_sizes, skip):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(skip_special_tokens=skip))
    deltas, _ = stream(detok, ids, chunk_sizes)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ids=st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=30),
    prompt=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=8),
    chunk_sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    skip=st.booleans(),
)
def test_arbitrary_token_ids_equal_decode(tokenizer, ids, prompt, chunk_sizes, skip):
    """What a model may really produce: byte tokens that never form valid UTF-8."""
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(skip_special_tokens=skip), prompt)
    assert "".join(stream(detok, ids, chunk_sizes)[0]) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_cost_per_step_does_not_grow_with_the_output(tokenizer):
    # 20k tokens: re-decoding the whole output each step would take minutes.
    rng = random.Random(0)
    words = tokenizer.encode(" ".join(TEXTS), add_special_tokens=False)
    ids = [rng.choice(words) for _ in range(20_000)]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["never appears \x00"]))
    start = time.perf_counter()
    for token_id in ids:
        detok.update([token_id])
        detok.get_next_output_text(False, delta=True)
    assert time.perf_counter() - start < 10.0
    detok.update([], finished=True)
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True)


def test_recovers_when_the_decode_stream_rejects_its_prefix(tokenizer, monkeypatch):
    # Some decoders are not prefix-stable and make DecodeStream raise; the request must go on.
    real = detokenizer_module.DecodeStream
    calls = []

    class FlakyStream:
        def __init__(self, *args, **kwargs):
            self._stream = real(*args, **kwargs)

        def step(self, tok, token_id):
            calls.append(token_id)
            if len(calls) == 3:
                raise Exception("Invalid prefix encountered")
            return self._stream.step(tok, token_id)

    monkeypatch.setattr(detokenizer_module, "DecodeStream", FlakyStream)
    ids = tokenizer.encode(" one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    assert "".join(stream(detok, ids)[0]) == " one two three four"


def test_stop_token_text_is_left_out(tokenizer):
    ids = tokenizer.encode("Hi there<|im_end|>", add_special_tokens=False)
    params = SamplingParams(skip_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, params)
    detok.update(ids, finished=True, stop_terminated=True)
    assert detok.output_text == "Hi there"
    assert detok.output_token_ids == ids
    kept = IncrementalDetokenizer(tokenizer, params.clone(include_stop_str_in_output=True))
    kept.update(ids, finished=True, stop_terminated=True)
    assert kept.output_text == "Hi there<|im_end|>"


def test_detokenize_false_tracks_ids_only(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(detokenize=False))
    assert detok.update([1, 2, 3], finished=True) is None
    assert detok.output_token_ids == [1, 2, 3]
    assert detok.get_next_output_text(True, delta=False) == ""


def test_spaces_between_special_tokens():
    # A WordPiece decoder puts a space between every two tokens; without
    # spaces_between_special_tokens two adjacent special tokens are joined.
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["[A]", "[B]"])
    ids = [1, 3, 4, 2]
    texts = {}
    for spaces in (True, False):
        detok = IncrementalDetokenizer(
            tok, SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
        )
        texts[spaces] = "".join(stream(detok, ids)[0])
    assert texts == {True: "hello [A] [B] world", False: "hello [A][B] world"}


# ------------------------------------------------------------------------------ stop strings


def stop_stream(tokenizer, text: str, **params) -> tuple[list[str], str | None, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(**params))
    deltas, stopped = stream(detok, tokenizer.encode(text, add_special_tokens=False))
    return deltas, stopped, detok


def test_stop_string_truncates_text(tokenizer):
    deltas, stopped, detok = stop_stream(tokenizer, "The cat sat on the mat. The end", stop=["mat"])
    assert stopped == "mat"
    assert "".join(deltas) == detok.output_text == "The cat sat on the "


def test_stop_string_kept_with_include_stop_str_in_output(tokenizer):
    deltas, stopped, detok = stop_stream(
        tokenizer, "The cat sat on the mat. The end", stop=["mat"], include_stop_str_in_output=True
    )
    assert stopped == "mat"
    assert "".join(deltas) == detok.output_text == "The cat sat on the mat"


def test_earliest_stop_string_wins(tokenizer):
    # "sat" comes first in the text, though listed last; both complete within one step.
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["the mat", "on", "sat"]))
    assert detok.update(tokenizer.encode("The cat sat on the mat", add_special_tokens=False)) == "sat"
    assert detok.output_text == "The cat "


def test_stop_string_spanning_tokens_and_steps(tokenizer):
    # "t s" starts in the token " cat" and ends in the token " sat", fed in separate steps.
    ids = tokenizer.encode("The cat sat down", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["t s"]))
    shown = ""
    for token_id in ids:
        stopped = detok.update([token_id])
        shown += detok.get_next_output_text(stopped is not None, delta=True)
        if stopped is not None:
            break
    assert stopped == "t s"
    assert shown == detok.output_text == "The ca"


def test_partial_stop_string_is_held_back_while_streaming(tokenizer):
    text = "alpha beta gamma delta"
    stop = "gamma ray"  # never completes; its start "gamma" must not show until ruled out
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=[stop]))
    shown = ""
    for i, token_id in enumerate(ids):
        finished = i == len(ids) - 1
        assert detok.update([token_id], finished=finished) is None
        shown += detok.get_next_output_text(finished, delta=True)
        if not finished:
            # Exactly the last len(stop) - 1 chars are held back.
            assert shown == detok.output_text[: max(0, detok.num_output_chars - (len(stop) - 1))]
        if detok.output_text.endswith(" gamma"):
            assert "gamma" not in shown
    assert shown == text


def test_held_back_deltas_concatenate_to_the_final_text(tokenizer):
    rng = random.Random(1)
    text = "one two three four five six seven eight nine ten"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for stop, expected in [("seven", "one two three four five six "), ("xyz!", text), ("ten", text[:-3])]:
        for include in (False, True):
            detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=[stop], include_stop_str_in_output=include))
            sizes = [rng.randint(1, 3) for _ in range(8)]
            deltas, _ = stream(detok, ids, sizes)
            want = expected + stop if include and expected != text else expected
            assert "".join(deltas) == detok.output_text == want
            # Nothing of the stop string was ever shown before the match decided it.
            if not include and stop in text:
                assert all(stop[:2] not in d for d in deltas)


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode("stop here and stop there", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["stop"], min_tokens=3))
    for n, token_id in enumerate(ids, start=1):
        if detok.update([token_id]) is not None:
            break
    assert n > 3  # the first "stop" came within min_tokens and did not count
    assert detok.output_text == "stop here and "
