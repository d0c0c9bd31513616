"""Scoring (vLLM's `score` and `rerank`), shared by `LLM.score` and the server's /score and /rerank;
numpy only. With an embedding model (a bi-encoder): the cosine similarity of two texts'
embeddings. With a one-label sequence classifier (a cross-encoder): its probability for the two
texts read together (`cross_encoder_inputs`: a score template's text, the tokenizer's own pair
template as vLLM and sentence-transformers' CrossEncoder encode them, or the texts joined).

Pairs as vLLM forms them: one text against one (1:1), one against many (1:N), or two lists of the
same length, element by element (N:N). Each distinct text is embedded once.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def score_pairs(data_1: Any, data_2: Any, name_1: str = "data_1", name_2: str = "data_2"
                ) -> tuple[list[Any], list[tuple[int, int]]]:
    """(the distinct inputs to embed, the pairs to score as indices into them). An input is a
    text or a list of token ids; a ValueError names the argument that does not fit."""
    firsts, seconds = _as_list(data_1, name_1), _as_list(data_2, name_2)
    if len(firsts) != 1 and len(firsts) != len(seconds):
        raise ValueError(f"{name_1} has {len(firsts)} inputs and {name_2} {len(seconds)}: give one {name_1} "
                         f"(scored against every {name_2}) or as many as {name_2} (scored pairwise).")
    inputs: list[Any] = []
    index: dict[Any, int] = {}

    def slot(x: Any) -> int:
        key = x if isinstance(x, str) else tuple(x)
        if key not in index:
            index[key] = len(inputs)
            inputs.append(x)
        return index[key]

    pairs = [(slot(firsts[0] if len(firsts) == 1 else firsts[i]), slot(s)) for i, s in enumerate(seconds)]
    return inputs, pairs


def text_pairs(data_1: Any, data_2: Any, name_1: str = "data_1", name_2: str = "data_2") -> list[tuple[str, str]]:
    """A cross-encoder's pairs (1:1, 1:N or N:N, as `score_pairs`), each read as one input: texts
    only (a pair's tokens come from the tokenizer's pair template)."""
    firsts, seconds = _as_list(data_1, name_1), _as_list(data_2, name_2)
    if len(firsts) != 1 and len(firsts) != len(seconds):
        raise ValueError(f"{name_1} has {len(firsts)} inputs and {name_2} {len(seconds)}: give one {name_1} "
                         f"(scored against every {name_2}) or as many as {name_2} (scored pairwise).")
    for name, items in ((name_1, firsts), (name_2, seconds)):
        if not all(isinstance(x, str) for x in items):
            raise ValueError(f"{name}: a cross-encoder scores texts read as pairs; token ids are not taken.")
    return [(firsts[0] if len(firsts) == 1 else firsts[i], s) for i, s in enumerate(seconds)]


def cross_encoder_inputs(tokenizer: Any, pairs: list[tuple[str, str]], use_sep_token: bool = True,
                         render: Callable[[list[dict[str, str]]], str] | None = None) -> list[dict[str, Any]]:
    """Each pair as the one prompt a cross-encoder reads (a dict of `prompt_token_ids`, and
    `token_type_ids` where the tokenizer gives the second text type 1, as BERT's does), as vLLM
    forms it: with a score template (`render`, the template given with --chat-template or
    `chat_template`) the text it renders from the messages [{"role": "query", ...},
    {"role": "document", ...}]; else, for a cross-encoder (`use_sep_token`), the tokenizer's
    encoding of a pair (its pair template: a separator, special tokens); else, for a language
    model run as a classifier (Qwen3-Reranker), the two texts joined and encoded as one."""
    if render is not None:
        texts = []
        for a, b in pairs:
            try:
                texts.append(render([{"role": "query", "content": a}, {"role": "document", "content": b}]))
            except Exception as e:  # noqa: BLE001 - a template error is the caller's template's or text's
                raise ValueError(f"chat_template is the score template, and it could not render a query and "
                                 f"document pair: {e}") from None
        return [{"prompt_token_ids": tokenizer(t)["input_ids"]} for t in texts]
    if not use_sep_token:
        return [{"prompt_token_ids": tokenizer(a + b)["input_ids"]} for a, b in pairs]
    prompts = []
    for a, b in pairs:
        enc = tokenizer(a, text_pair=b)
        prompt = {"prompt_token_ids": enc["input_ids"]}
        types = enc.get("token_type_ids")
        if types is not None and any(types):
            prompt["token_type_ids"] = list(types)
        prompts.append(prompt)
    return prompts


def check_cross_encoder(labels: tuple[str, ...] | None) -> bool:
    """Whether a model with these classifier labels scores as a cross-encoder (one label); False
    for an embedding model (None); a ValueError for a classifier of several labels."""
    if labels is None:
        return False
    if len(labels) != 1:
        raise ValueError(f"scores need an embedding model or a one-label classifier (a cross-encoder); this model "
                         f"classifies into {len(labels)} labels: classify with it instead.")
    return True


def cosine_scores(vectors: list[np.ndarray], pairs: list[tuple[int, int]]) -> list[float]:
    """The cosine similarity of each pair (whether or not the vectors were normalized)."""
    out = []
    for i, j in pairs:
        a, b = vectors[i].astype(np.float64), vectors[j].astype(np.float64)
        denom = float(np.linalg.norm(a) * np.linalg.norm(b))
        out.append(float(a @ b) / denom if denom else 0.0)
    return out


def _as_list(data: Any, name: str) -> list[Any]:
    if isinstance(data, str):
        data = [data]
    elif isinstance(data, dict):  # a prompt dict, as LLM.embed takes it
        data = [data.get("prompt_token_ids", data.get("prompt"))]
    elif isinstance(data, (list, tuple)) and data and all(isinstance(t, int) for t in data):
        data = [list(data)]  # one prompt's token ids
    if not isinstance(data, (list, tuple)) or not data:
        raise ValueError(f"{name} must be a text, a list of texts or token ids, and not empty; got {data!r:.80}.")
    for x in data:
        if not isinstance(x, (str, list, tuple)) or (isinstance(x, str) and not x) or (not isinstance(x, str) and not x):
            raise ValueError(f"{name} must hold non-empty texts or lists of token ids, got {x!r:.80}.")
    return list(data)
