"""Incremental detokenization and stop strings, one `IncrementalDetokenizer` per request.

Each step the engine core sends a request's new token ids; this turns them into the new text,
checks the stop strings on it, and decides how much of the text may be shown yet.

Decoding uses `tokenizers.decoders.DecodeStream`: it keeps a small window of recent ids and
returns a chunk only once the window decodes to text that does not end in U+FFFD, so a character
whose UTF-8 bytes are split across tokens (emoji, CJK, byte-fallback) is held back until its last
byte arrives. The window is reset after every chunk, so a step costs O(new tokens), never a
re-decode of the whole output. Concatenated, the chunks equal `tokenizer.decode(output_ids)`;
the one thing the stream cannot do alone is give up on bytes that never complete, which `update`
does when the request finishes (`_flush`).

The text is kept as a list of parts, not one growing string: appending to a str attribute copies
it each time (O(n^2) over a long output). Only the tail that a stop string can reach is ever
looked at before the request finishes.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tokenizers
from tokenizers.decoders import DecodeStream

from tokenloom.sampling_params import SamplingParams

# Tokens of prompt context the stream is primed with, so the first output token decodes as it does
# after the prompt (a SentencePiece decoder strips the leading space of a sequence's first token).
_MIN_PROMPT_CONTEXT = 4
_MAX_PROMPT_CONTEXT = 24
_REPLACEMENT_CHAR = "\ufffd"


def backend_tokenizer(tokenizer: Any) -> tokenizers.Tokenizer:
    """The Rust `tokenizers.Tokenizer` behind a transformers fast tokenizer (or itself); a
    tokenizer with its own `decode_stream` (tokenizer_mode="mistral") is stepped as it is."""
    if isinstance(tokenizer, tokenizers.Tokenizer) or hasattr(tokenizer, "decode_stream"):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        raise TypeError(
            f"tokenloom detokenizes with a fast (Rust `tokenizers`) tokenizer; got {type(tokenizer).__name__}, "
            "which has no backend_tokenizer."
        )
    return backend


class IncrementalDetokenizer:
    """Per request: token ids in, text out, stop strings checked on the way.

    Protocol, once per engine step: `update(new_token_ids, ...)` (returns the matched stop string,
    if any, after which the request is finished), then `get_next_output_text(finished, delta)`.
    With `detokenize=False` only the token ids are tracked and the text stays "".
    """

    def __init__(
        self,
        tokenizer: Any,
        params: SamplingParams,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self.output_token_ids: list[int] = []
        self._parts: list[str] = []
        self._num_chars = 0
        self._num_sent = 0  # chars already handed out by get_next_output_text
        self.stop: list[str] = list(params.stop or ()) if params.detokenize else []
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        # While streaming, the last max_stop_len - 1 chars could be the start of a stop string that
        # the next token completes; they are shown only once that is ruled out (or at finish).
        # When the stop string is kept in the output nothing before its end is ever cut, so
        # nothing needs holding back.
        self.stop_buffer_length = 0 if self.include_stop_str_in_output else max(self.max_stop_len - 1, 0)

        self._stream: DecodeStream | None = None
        if not params.detokenize:
            return
        self._tokenizer = backend_tokenizer(tokenizer)
        self.skip_special_tokens = params.skip_special_tokens
        # Without skipping, and with spaces_between_special_tokens off, two adjacent added tokens
        # are joined without the space some decoders (WordPiece, Metaspace) put between them.
        self._added_tokens: dict[int, str] | None = None
        if not params.skip_special_tokens and not params.spaces_between_special_tokens:
            added = {i: t.content for i, t in self._tokenizer.get_added_tokens_decoder().items()}
            self._added_tokens = added or None
        self._last_was_added = False
        context = self._prompt_context(prompt_token_ids)
        self._stream = self._new_stream(context)
        # Ids fed since the stream last returned a chunk, and the ids of that chunk: what `_flush`
        # needs to decode the bytes that are still pending.
        self._pending_ids: list[int] = []
        self._last_chunk_ids: list[int] = list(context)

    # ---------------------------------------------------------------------------------- text

    @property
    def output_text(self) -> str:
        """All text so far (including what is still held back)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def num_output_chars(self) -> int:
        return self._num_chars

    def update(self, new_token_ids: Sequence[int], finished: bool = False, stop_terminated: bool = False) -> str | None:
        """Appends the step's tokens and their text; returns the stop string that matched, if any.

        `finished`: the engine core finished the request with this step, so bytes that are still
        waiting for a continuation are decoded as they are (U+FFFD, as `tokenizer.decode` would).
        `stop_terminated`: the last new token is the EOS or a stop token id that ended the request;
        like a stop string, its text is left out unless `include_stop_str_in_output`.
        """
        if self._stream is None:
            self.output_token_ids.extend(new_token_ids)
            return None
        ids = new_token_ids
        if stop_terminated and not self.include_stop_str_in_output and ids:
            ids = ids[:-1]
        if self.stop and len(ids) > 1:
            # Several tokens in one step (accepted draft tokens): a stop string one of them
            # completes ends the output at that token, as one token per step would have.
            for token_id in ids:
                self.output_token_ids.append(token_id)
                stop_str = self._append(self._decode_next(token_id))
                if stop_str is not None:
                    return stop_str
            self.output_token_ids.extend(new_token_ids[len(ids):])
            return self._append(self._flush()) if finished else None
        self.output_token_ids.extend(new_token_ids)
        new_text = "".join([self._decode_next(token_id) for token_id in ids])
        if finished:
            new_text += self._flush()
        return self._append(new_text)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show now: everything but the held-back tail (all of it once finished);
        with `delta`, only what was not shown before."""
        end = self._num_chars if finished else max(self._num_chars - self.stop_buffer_length, self._num_sent)
        if delta:
            text = self._text_from(self._num_sent)[: end - self._num_sent]
            self._num_sent = end
            return text
        self._num_sent = end
        return self.output_text[:end]

    # ------------------------------------------------------------------------------ decoding

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The shortest prompt suffix (at least a few tokens) that decodes cleanly: one that starts
        inside a multi-byte character would make the stream's first chunk wrong."""
        if len(prompt_token_ids) <= _MIN_PROMPT_CONTEXT:
            context = list(prompt_token_ids)
            return context if _REPLACEMENT_CHAR not in self._decode(context) else []
        for k in range(_MIN_PROMPT_CONTEXT, min(len(prompt_token_ids), _MAX_PROMPT_CONTEXT) + 1):
            context = list(prompt_token_ids[-k:])
            if _REPLACEMENT_CHAR not in self._decode(context):
                return context
        return []

    def _new_stream(self, context: list[int]) -> Any:
        make = getattr(self._tokenizer, "decode_stream", None)
        if make is not None:
            return make(context, self.skip_special_tokens)
        return DecodeStream(ids=context or None, skip_special_tokens=self.skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_next(self, token_id: int) -> str:
        assert self._stream is not None
        self._pending_ids.append(token_id)
        try:
            chunk = self._stream.step(self._tokenizer, token_id)
        except Exception as e:  # noqa: BLE001 - the tokenizers error has no class of its own
            if "prefix" not in str(e).lower():
                raise
            # A decoder whose output for a longer window does not extend its output for a shorter
            # one (seen with some normalisers) breaks the stream's invariant; start a fresh stream
            # from this token rather than fail the request.
            self._stream = self._new_stream([])
            self._pending_ids = [token_id]
            chunk = self._stream.step(self._tokenizer, token_id)
        if self._added_tokens is not None:
            content = self._added_tokens.get(token_id)
            if chunk is not None and content is not None and self._last_was_added and len(self._pending_ids) == 1:
                chunk = content
            self._last_was_added = content is not None
        if chunk is None:
            return ""
        self._last_chunk_ids, self._pending_ids = self._pending_ids, []
        return chunk

    def _flush(self) -> str:
        """The text of the pending ids, decoded as they are. Decoded after the previous chunk's ids
        so that the pending text reads as it would in `tokenizer.decode` of the whole output."""
        pending = self._pending_ids
        if not pending:
            return ""
        context = self._decode(self._last_chunk_ids)
        text = self._decode(self._last_chunk_ids + pending)
        self._last_chunk_ids, self._pending_ids = pending, []
        return text[len(context) :] if text.startswith(context) else self._decode(pending)

    # -------------------------------------------------------------------------- stop strings

    def _append(self, new_text: str) -> str | None:
        if not new_text:
            return None
        old_num_chars = self._num_chars
        self._parts.append(new_text)
        self._num_chars += len(new_text)
        # As vLLM: a stop string completed within the first min_tokens tokens does not count.
        if not self.stop or len(self.output_token_ids) <= self.min_tokens:
            return None
        # Only a match that ends in the new text is new; it can start up to max_stop_len - 1 chars
        # before it, in text that was held back for exactly this reason.
        window_start = max(0, old_num_chars - (self.max_stop_len - 1))
        window = self._text_from(window_start)
        boundary = old_num_chars - window_start
        match: tuple[int, int, str] | None = None
        for stop_str in self.stop:
            start = window.find(stop_str, max(0, boundary - len(stop_str) + 1))
            if start == -1:
                continue
            # The earliest match wins; of two starting at the same place, the shorter one, which
            # a token-by-token stream would have completed first.
            key = (start, len(stop_str), stop_str)
            if match is None or key < match:
                match = key
        if match is None:
            return None
        start, length, stop_str = match
        self._truncate(window_start + start + (length if self.include_stop_str_in_output else 0))
        return stop_str

    def _text_from(self, start: int) -> str:
        """text[start:], touching only the parts that hold it."""
        if start >= self._num_chars:
            return ""
        pieces: list[str] = []
        covered = 0
        for part in reversed(self._parts):
            pieces.append(part)
            covered += len(part)
            if covered >= self._num_chars - start:
                break
        tail = "".join(reversed(pieces))
        return tail[len(tail) - (self._num_chars - start) :]

    def _truncate(self, length: int) -> None:
        while self._num_chars > length:
            part = self._parts.pop()
            self._num_chars -= len(part)
            if self._num_chars < length:
                self._parts.append(part[: length - self._num_chars])
                self._num_chars = length
