"""Tokenizers: built from a GGUF's `tokenizer.ggml.*` metadata, or loaded from an HF directory.

A GGUF carries no `tokenizer.json`, only the vocabulary, merges, token types, special ids and
chat template under llama.cpp's keys. For byte-level BPE vocabularies (`tokenizer.ggml.model ==
"gpt2"`: SmolLM2, Llama 3, Qwen) we rebuild the `tokenizers` pipeline the vocabulary was trained
with and wrap it in `PreTrainedTokenizerFast`. The result encodes, decodes and renders chat
templates exactly like transformers' own `AutoTokenizer.from_pretrained(dir, gguf_file=...)`
(tests/model/test_tokenizer.py compares the two), without its cost of parsing the whole file.
Gemma's sentencepiece vocabularies (`"llama"` in a gemma/gemma2/gemma3 file) are rebuilt here too:
transformers' conversion of a 262k-token vocabulary parses the whole file with gguf-py and takes
minutes, ours a few seconds. Other kinds (sentencepiece "llama", e.g. TinyLlama) are handed to
that transformers conversion.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import json
import os
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tokenloom.disk_cache import cache_dir, write_atomically
from tokenloom.model.errors import ModelLoadError, ModelNotFoundError
from tokenloom.model.gguf_file import GGUFFile

# llama.cpp token types (llama_token_type): which vocabulary entries are not ordinary text.
_TOKEN_CONTROL = 3  # <|im_start|>, <|eot_id|>, ...: special, never produced by splitting text
_TOKEN_USER_DEFINED = 4  # e.g. <think>: matched whole in text, but decoded like text

# How text is cut into words before BPE, by `tokenizer.ggml.pre`, for vocabularies whose
# pre-tokenizer is not GPT-2's. Unlisted names (e.g. "smollm", "gpt2") get GPT-2's split, which is
# what transformers uses for them too.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZER_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: printable Latin-1 bytes stand for
    themselves, the other 68 are shifted to code points 256+ in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@contextlib.contextmanager
def _gc_paused():
    """Python's cycle collector off while a vocabulary's worth of tuples is built: they hold no
    cycles, but every 700 allocations the collector walks the young ones, and with half a million
    merges its older generations again and again (for Gemma 3's vocabulary that cost more than the
    build itself: benchmarks/CHANGELOG.md, "Gemma 3's tokenizer from the disk cache")."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def gguf_tokenizer(g: GGUFFile) -> PreTrainedTokenizerFast:
    with _gc_paused():
        return _gguf_tokenizer(g)


def _gguf_tokenizer(g: GGUFFile) -> PreTrainedTokenizerFast:
    md = g.metadata
    kind = md.get("tokenizer.ggml.model")
    if kind is None:
        raise ModelLoadError(f"{g.path}: the GGUF has no tokenizer (no tokenizer.ggml.model key)")
    gemma = kind == "llama" and g.architecture in _GEMMA_ARCHITECTURES
    if kind != "gpt2" and not gemma:
        return _transformers_gguf_tokenizer(g.path, kind)
    tokens: list[str] | None = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{g.path}: the GGUF tokenizer has no vocabulary (tokenizer.ggml.tokens)")
    token_types: list[int] = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if gemma:
        return _gemma_tokenizer(g, tokens, token_types)
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]

    # Every ordinary token is spelled in the byte alphabet. A few files carry control tokens with
    # other characters (written as plain UTF-8); spell those through the alphabet so the BPE model
    # accepts them, and leave them out of the special tokens (as transformers does).
    byte_map = _byte_alphabet()
    alphabet = set(byte_map.values())

    def spelled(tok: str) -> bool:
        return set(tok) <= alphabet

    vocab = {(t if spelled(t) else "".join(byte_map[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False))
    add_prefix_space = bool(md.get("tokenizer.ggml.add_space_prefix", False))
    split = _PRE_TOKENIZER_SPLITS.get(md.get("tokenizer.ggml.pre", ""))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()

    _add_file_tokens(backend, tokens, token_types, vocab, spelled)
    return _wrap(g, backend, tokens, add_bos_default=False)


def _add_file_tokens(backend: Tokenizer, tokens: list[str], token_types: list[int], vocab: dict,
                     keep_control) -> None:
    """The GGUF's control tokens (those `keep_control` accepts) as special added tokens and its
    user-defined tokens that are in the vocabulary as plain added tokens."""
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind_ in zip(tokens, token_types) if kind_ == _TOKEN_CONTROL and keep_control(t)]
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind_ in zip(tokens, token_types) if kind_ == _TOKEN_USER_DEFINED and t in vocab]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _wrap(g: GGUFFile, backend: Tokenizer, tokens: list[str], add_bos_default: bool) -> PreTrainedTokenizerFast:
    """The `tokenizers` pipeline as a transformers tokenizer, with the file's special tokens, BOS /
    EOS flags and chat template."""
    md = g.metadata

    def token_of(key: str) -> str | None:
        tid = md.get(f"tokenizer.ggml.{key}")
        return tokens[tid] if tid is not None and 0 <= tid < len(tokens) else None

    kwargs: dict[str, Any] = {
        "bos_token": token_of("bos_token_id"),
        "eos_token": token_of("eos_token_id"),
        "unk_token": token_of("unknown_token_id"),
        "pad_token": token_of("padding_token_id"),
        "add_bos_token": bool(md.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        "add_eos_token": bool(md.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    if "tokenizer.chat_template" in md:
        kwargs["chat_template"] = md["tokenizer.chat_template"]
    tok = _BuiltTokenizerFast(backend, **kwargs)
    tok.name_or_path = g.path
    return tok


class _BuiltTokenizerFast(PreTrainedTokenizerFast):
    """A transformers tokenizer over a `tokenizers.Tokenizer` built here, taken as it is: given as
    `tokenizer_object`, transformers deep-copies it, which for a 262k-token vocabulary costs
    seconds (a pickle round trip). transformers uses a backend already set on the instance."""

    def __init__(self, backend: Tokenizer, **kwargs: Any) -> None:
        self._tokenizer = backend
        super().__init__(**kwargs)


_GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})


def _gemma_tokenizer(g: GGUFFile, tokens: list[str], token_types: list[int]) -> PreTrainedTokenizerFast:
    """Gemma's sentencepiece BPE, as transformers' GemmaTokenizer builds it from a GGUF: spaces
    become U+2581, no prefix space, byte fallback for what the vocabulary cannot spell.

    The file has no merges; they are recovered from the vocabulary. Every token that splits into
    two tokens gives one merge per split point, and a merge ranks by the position of the token it
    builds (Gemma's scores do not follow the merge order, the file's order does), ties broken by
    the longer left, then the longer right piece. Tokens of two or more spaces are stored as real
    spaces while the model sees U+2581s: they are renamed first so their merges match."""
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    merges = [(spelled[a], spelled[b]) for a, b in _gemma_merge_ids(spelled, vocab).tolist()]
    unk = tokens[int(g.metadata.get("tokenizer.ggml.unknown_token_id", 3))]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                                   byte_fallback=True, dropout=None))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    # Added tokens under the file's own spelling (a user-defined token of spaces would not be in
    # the renamed vocabulary, and is left out, as transformers does).
    _add_file_tokens(backend, tokens, token_types, vocab, lambda t: True)
    # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
    return _wrap(g, backend, tokens, add_bos_default=True)


# Bump when the recovery below changes, so that merge lists cached by the old one are not read.
_MERGES_VERSION = "1"


def _gemma_merge_ids(spelled: list[str], vocab: dict[str, int]) -> np.ndarray:
    """The merges recovered from the vocabulary, in rank order, as (left id, right id) rows.

    They depend on the vocabulary alone, and for Gemma 3's 262k tokens the search below is
    seconds of Python in every process that builds the tokenizer (the server's front end, each
    `LLM()`), so the result is kept in the disk cache (tokenloom/disk_cache.py) under a hash of
    the vocabulary: 8 bytes per merge, read back with one `np.load`. An entry that cannot be read
    or does not fit the vocabulary is rebuilt; a cache that cannot be written is done without."""
    key = hashlib.sha256("\0".join(["gemma-merges", _MERGES_VERSION, *spelled]).encode()).hexdigest()[:32]
    path = cache_dir("tokenizers") / f"gemma-merges-{key}.npy"
    try:
        ids = np.load(path, allow_pickle=False)
        if (ids.dtype == np.int32 and ids.ndim == 2 and ids.shape[1] == 2
                and (ids.size == 0 or (ids.min() >= 0 and ids.max() < len(spelled)))):
            return ids
    except (OSError, ValueError, EOFError):
        pass
    # Rank: the built token's position, then the longer left piece (so the shorter right one);
    # one integer per merge, as (token, cut) pairs are unique. Flat lists of ints, not tuples:
    # half a million of them.
    span = max(map(len, vocab), default=0) + 1
    keys: list[int] = []
    lefts: list[int] = []
    rights: list[int] = []
    get = vocab.get
    for token, index in vocab.items():
        for cut in range(1, len(token)):
            if (left := get(token[:cut])) is not None and (right := get(token[cut:])) is not None:
                keys.append(index * span + span - cut)
                lefts.append(left)
                rights.append(right)
    order = np.argsort(np.array(keys, dtype=np.int64), kind="stable")
    ids = np.stack([np.array(lefts, dtype=np.int32)[order], np.array(rights, dtype=np.int32)[order]], axis=1)
    buf = io.BytesIO()
    np.save(buf, ids, allow_pickle=False)
    write_atomically(path, buf.getvalue())
    return ids


def _transformers_gguf_tokenizer(path: str, kind: str) -> PreTrainedTokenizerFast:
    """Vocabularies other than byte-level BPE (sentencepiece "llama" for TinyLlama / Llama 2,
    unigram, ...): let transformers' own GGUF conversion build them. Slower (it re-reads the file)
    but these files are rare for the architectures we run."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                            local_files_only=True)
    except Exception as e:  # noqa: BLE001 - name the file and the tokenizer kind, keep the cause
        raise ModelLoadError(f"{path}: cannot build a tokenizer of GGUF kind {kind!r}: {e}") from e
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise ModelLoadError(f"{path}: GGUF tokenizer kind {kind!r} gave {type(tok).__name__}, not a fast tokenizer")
    return tok


def hf_tokenizer(directory: str) -> PreTrainedTokenizerFast:
    """The tokenizer saved in an HF model directory (`tokenizer.json` + `tokenizer_config.json`,
    chat template from `chat_template.jinja` when the config has none)."""
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        raise ModelNotFoundError(f"{directory}: no tokenizer.json (a fast tokenizer file is required)")
    # AutoTokenizer, not PreTrainedTokenizerFast: a tokenizer_config.json may name a class with its
    # own behaviour (BOS handling, cleanup). The path is local, so nothing is fetched.
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - name the directory, keep the cause
        raise ModelLoadError(f"{directory}: cannot load the tokenizer: {e}") from e
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise ModelLoadError(f"{directory}: tokenizer class {type(tok).__name__} is not a fast tokenizer")
    if not tok.chat_template:
        jinja = os.path.join(directory, "chat_template.jinja")
        template_json = os.path.join(directory, "chat_template.json")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                tok.chat_template = f.read()
        elif os.path.isfile(template_json):
            with open(template_json, encoding="utf-8") as f:
                tok.chat_template = json.load(f).get("chat_template")
    return tok
