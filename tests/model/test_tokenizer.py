"""Our GGUF tokenizer against transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=...)`."""
from __future__ import annotations

import json

import pytest
from model_helpers import FFN, HEADS, HIDDEN, KV, LAYERS, SENTENCEPIECE_VOCAB, llama_tensors, write_gguf
from transformers import PreTrainedTokenizerFast

from tokenloom.model.loader import load_tokenizer

MIXED = ("def héllo(wörld):\n\treturn f\"{wörld!r} — naïve café\"  # ✓ 10,000.5\n"
         "日本語のテキスト、中文文本 and 한국어. Emoji: 😀👍🏽🇫🇷  \n\n"
         "<|im_start|>user\nHi<|im_end|>\n<|endoftext|><repo_name>x   trailing spaces   \r\n")

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Résumé in 日本語? 😀"},
    {"role": "assistant", "content": "はい."},
    {"role": "user", "content": "def f(): pass"},
]


@pytest.fixture(scope="module")
def ours(smollm2_path):
    return load_tokenizer(smollm2_path)


def test_same_pipeline_as_transformers(ours, hf_smollm2_tokenizer):
    assert isinstance(ours, PreTrainedTokenizerFast)
    a = json.loads(ours.backend_tokenizer.to_str())
    b = json.loads(hf_smollm2_tokenizer.backend_tokenizer.to_str())
    assert a == b
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "all_special_ids", "chat_template"):
        assert getattr(ours, attr) == getattr(hf_smollm2_tokenizer, attr), attr


def test_encode_decode_round_trip(ours, hf_smollm2_tokenizer):
    ids = ours(MIXED).input_ids
    assert ids == hf_smollm2_tokenizer(MIXED).input_ids
    assert ours.decode(ids) == hf_smollm2_tokenizer.decode(ids) == MIXED
    stripped = ours.decode(ids, skip_special_tokens=True)
    assert stripped == hf_smollm2_tokenizer.decode(ids, skip_special_tokens=True)
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>"):
        assert ours.convert_tokens_to_ids(special) in ids
        assert special not in stripped
    # Token by token (what incremental detokenization sees) also agrees.
    assert ours.convert_ids_to_tokens(ids) == hf_smollm2_tokenizer.convert_ids_to_tokens(ids)


def test_chat_template(ours, hf_smollm2_tokenizer):
    for messages, gen in ((CHAT, True), (CHAT[1:2], True), (CHAT[:3], False)):
        text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert text == hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours(text).input_ids == hf_smollm2_tokenizer(text).input_ids
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")


def test_tokenizer_is_cheap(smollm2_path):
    """The caller process builds only the tokenizer; it must not pay for the weights."""
    import time

    start = time.perf_counter()
    load_tokenizer(smollm2_path)
    assert time.perf_counter() - start < 10  # ~0.3 s idle; generous for a loaded 2-core box


def test_sentencepiece_gguf_goes_through_transformers(tmp_path):
    """A non-BPE GGUF vocabulary (sentencepiece, as in TinyLlama) is built by transformers' own
    conversion: BOS added, pieces merged, byte fallback for the rest."""
    path = write_gguf(str(tmp_path / "sp.gguf"), "llama", llama_tensors(vocab=len(SENTENCEPIECE_VOCAB)),
                      block_count=LAYERS, hidden=HIDDEN, ffn=FFN, heads=HEADS, kv_heads=KV, tokenizer="llama")
    tok = load_tokenizer(path)
    hello = SENTENCEPIECE_VOCAB.index("\u2581hello")
    ids = tok("hello hello").input_ids
    assert ids == [1, hello, hello]
    assert tok.decode(ids, skip_special_tokens=True) == "hello hello"
    assert tok("é").input_ids == [1, SENTENCEPIECE_VOCAB.index("\u2581"), 3 + 0xC3, 3 + 0xA9]
