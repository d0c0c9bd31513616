"""tokenizer_mode="mistral" (vLLM's MistralTokenizer): mistral_common's own tokenizer of a Mistral
repo, its `tekken.json` (tiktoken-style byte BPE) or SentencePiece `tokenizer.model[.vN]`, and its
chat format, encoded by mistral_common from the request (`encode_chat_completion`), not rendered
from a Jinja template, as Mistral's models were trained on it.

`MistralTokenizer` gives the engine what it calls on a tokenizer: `encode` / `decode`, the token
strings and vocabulary, the special ids, `encode_chat` (a conversation straight to token ids) and
`decode_stream` (the incremental decoder the detokenizer steps, by text difference, since there is
no Rust `tokenizers` backend to step). mistral_common is an optional extra; versions from 1.10 pin
numpy below 2.4 on Python up to 3.12, so the extra takes 1.8.5 to 1.9.x there.
"""
from __future__ import annotations

import glob
import os
from typing import Any

from tokenloom.model.errors import ModelLoadError

# What a Mistral repo's tokenizer is stored as, in the order mistral_common's from_hf_hub looks.
TOKENIZER_FILE_PATTERNS = ("tekken.json", "tokenizer.model.v*", "tokenizer.model")
_REPLACEMENT_CHAR = "\ufffd"


def _byte_level_alphabet() -> list[str]:
    """GPT-2's printable character for each byte (transformers' bytes_to_unicode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


_BYTE_LEVEL = _byte_level_alphabet()


def find_tokenizer_file(path: str) -> str:
    """The tokenizer file of a Mistral repo folder (or the file itself)."""
    if os.path.isfile(path):
        return path
    for pattern in TOKENIZER_FILE_PATTERNS:
        found = sorted(glob.glob(os.path.join(path, pattern)))
        if found:
            return found[-1]  # the newest tokenizer.model.vN
    raise ModelLoadError(f"{path}: tokenizer_mode='mistral' reads a Mistral repo's tekken.json or tokenizer.model[.vN]; "
                         "this folder has neither")


class MistralTokenizer:
    """mistral_common's tokenizer with the methods the engine calls (transformers' names)."""

    def __init__(self, path: str) -> None:
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer as Mistral

        self.path = find_tokenizer_file(path)
        try:
            self.mistral = Mistral.from_file(self.path)
        except Exception as e:  # noqa: BLE001 - name the file, keep the cause
            raise ModelLoadError(f"{self.path}: cannot load mistral_common's tokenizer (tokenizer_mode='mistral'): "
                                 f"{e}") from e
        self.inner = self.mistral.instruct_tokenizer.tokenizer
        self._keep, self._ignore = SpecialTokenPolicy.KEEP, SpecialTokenPolicy.IGNORE
        self.bos_token_id: int = self.inner.bos_id
        self.eos_token_id: int = self.inner.eos_id
        self.pad_token_id: int | None = self.inner.pad_id if self.inner.pad_id >= 0 else None
        self._special = frozenset(self._special_ids())
        self.all_special_ids: list[int] = sorted(self._special)
        self.special_tokens_map = {"bos_token": self.inner.id_to_piece(self.bos_token_id),
                                   "eos_token": self.inner.id_to_piece(self.eos_token_id)}
        self.chat_template = None  # the chat format is mistral_common's request encoding (encode_chat)
        self.name_or_path = os.path.dirname(self.path)
        self._vocab: dict[str, int] | None = None

    def _special_ids(self) -> set[int]:
        special = getattr(self.inner, "special_ids", None)
        if special is not None:
            return set(special)
        return {i for i in range(self.inner.n_words) if self.inner.is_special(i)}

    def __len__(self) -> int:
        return self.inner.n_words

    @property
    def vocab_size(self) -> int:
        return self.inner.n_words

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text` (with BOS when `add_special_tokens`, as the model's prompts start)."""
        return self.inner.encode(text, bos=add_special_tokens, eos=False)

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if skip_special_tokens:
            return self.inner.decode(ids, special_token_policy=self._ignore)
        # Special tokens as their names between the decoded runs of text (mistral_common's KEEP
        # joins a SentencePiece model's raw pieces, "▁" and byte pieces included).
        parts: list[str] = []
        run: list[int] = []
        for i in ids + [-1]:
            if i != -1 and i not in self._special:
                run.append(i)
                continue
            if run:
                parts.append(self.inner.decode(run, special_token_policy=self._ignore))
                run = []
            if i != -1:
                parts.append(self.inner.id_to_piece(i))
        return "".join(parts)

    def _piece(self, token_id: int) -> str:
        """A token's string: a SentencePiece model's piece; a tekken token's bytes in GPT-2's
        byte-level alphabet, as transformers' conversion of tekken.json spells them (its raw
        pieces are not unique: a token of part of a character reads as U+FFFD)."""
        if token_id in self._special or not hasattr(self.inner, "id_to_byte_piece"):
            return self.inner.id_to_piece(token_id)
        return "".join(_BYTE_LEVEL[b] for b in self.inner.id_to_byte_piece(token_id, self._keep))

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self._piece(ids)
        return [self._piece(i) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        if self._vocab is None:
            self._vocab = {self._piece(i): i for i in range(self.inner.n_words)}
        return self._vocab

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        vocab = self.get_vocab()
        return vocab.get(tokens) if isinstance(tokens, str) else [vocab.get(t) for t in tokens]

    def grammar_vocab(self) -> tuple[list[bytes] | list[str], bool]:
        """(every id's token, whether it is a SentencePiece vocabulary with byte fallback) for
        xgrammar: tekken's tokens as raw bytes, a SentencePiece model's as its pieces ("▁", <0xNN>);
        control tokens as empty bytes / their names, which no grammar allows as text."""
        if hasattr(self.inner, "id_to_byte_piece"):  # tekken
            return [b"" if i in self._special else self.inner.id_to_byte_piece(i, self._keep)
                    for i in range(self.inner.n_words)], False
        return [self.inner.id_to_piece(i) for i in range(self.inner.n_words)], True

    def get_added_tokens_decoder(self) -> dict[int, Any]:
        return {}  # mistral's special tokens are its control tokens, decoded (or skipped) by decode

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    continue_final_message: bool = False) -> tuple[list[int], str]:
        """(the prompt's token ids, its text) of an OpenAI-style conversation, as mistral_common
        encodes the request: its control tokens ([INST], [AVAILABLE_TOOLS], ...) are ids, never
        text that a tokenizer would have to find again."""
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        try:
            request = ChatCompletionRequest.from_openai(messages=list(messages), tools=tools or None,
                                                        continue_final_message=continue_final_message)
            tokenized = self.mistral.encode_chat_completion(request)
        except Exception as e:  # noqa: BLE001 - mistral_common's validation errors are of many classes
            raise ValueError(f"the conversation cannot be encoded by mistral_common (tokenizer_mode='mistral'): "
                             f"{e}") from None
        return list(tokenized.tokens), self.decode(tokenized.tokens, skip_special_tokens=False)

    def decode_stream(self, ids: list[int] | None = None, skip_special_tokens: bool = True) -> "TextDiffStream":
        return TextDiffStream(ids, skip_special_tokens)


class TextDiffStream:
    """tokenizers' DecodeStream, by text difference: each step decodes a window of recent ids with
    and without the new one and returns what the new one added (None while it ends in an
    unfinished byte sequence), so a piece's leading space reads as in a decode of the whole."""

    def __init__(self, ids: list[int] | None = None, skip_special_tokens: bool = True) -> None:
        self.ids = list(ids or [])
        self.skip_special_tokens = skip_special_tokens
        self.prefix_index, self.read_index = 0, len(self.ids)

    def step(self, tokenizer: MistralTokenizer, token_id: int) -> str | None:
        self.ids.append(token_id)
        prefix = tokenizer.decode(self.ids[self.prefix_index:self.read_index], self.skip_special_tokens)
        text = tokenizer.decode(self.ids[self.prefix_index:], self.skip_special_tokens)
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT_CHAR) or not text.startswith(prefix):
            return None
        self.prefix_index, self.read_index = self.read_index, len(self.ids)
        return text[len(prefix):]
