"""Pooling (embeddings): vLLM's `PoolingParams` (what one request asks for) and `PoolerConfig`
(how the engine pools), torch-free: both cross to the engine core inside msgspec structs.

An engine started with `runner="pooling"` runs each request's prompt through the model once and
returns a vector made from the final hidden states (after the last norm) instead of generating:

- `pooling_type` "LAST" (the last token's state: vLLM's default for decoder models, what
  Qwen3-Embedding and e5-mistral use), "MEAN" (the mean over the prompt's tokens), "CLS" (the
  first token's); the task "token_embed" returns every token's state ("ALL").
- `normalize`: divide by the L2 norm (default on, as vLLM's embed task and sentence-transformers'
  Normalize module).
- `dimensions`: keep the first d components before normalizing (Matryoshka models only, as vLLM).

A sequence classifier (`*ForSequenceClassification`) pools the same way (LAST by default, as
transformers reads the last token) and then applies its `score` head: the task "classify" returns
one probability per label (softmax; a sigmoid for a one-label model, a cross-encoder's score),
or the raw logits with `use_activation=False`; "token_classify" does so for every prompt token.

A model's own sentence-transformers files (`modules.json`, `1_Pooling/config.json`) give its
defaults, and `PoolerConfig` fields set by the user win over them (model/pooling_config.py).
"""
from __future__ import annotations

import operator
from typing import Any

import msgspec

POOLING_TYPES = ("LAST", "MEAN", "CLS")
POOLING_TASKS = ("embed", "token_embed", "classify", "token_classify")
# The tasks a classifier runs (vLLM's supported tasks per architecture; an embedding model runs
# the others), and the tasks that return one row per prompt token (pooled over every token).
CLASSIFY_TASKS = ("classify", "token_classify")
TOKEN_TASKS = ("token_embed", "token_classify")


def _bad(field: str, requirement: str, value: Any) -> ValueError:
    return ValueError(f"{field} must be {requirement}, got {value!r}.")


def _positive_int_or_none(field: str, value: Any) -> int | None:
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise _bad(field, "a positive integer or None", value) from None
    if value < 1:
        raise _bad(field, "a positive integer or None", value)
    return value


def _bool_or_none(field: str, value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise _bad(field, "true, false or None", value)
    return value


class PoolerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):  # type: ignore[call-arg]
    """vLLM's `pooler_config`: how an engine with runner="pooling" pools. None fields are the
    model's (its sentence-transformers files) and then vLLM's defaults (LAST, normalized)."""

    pooling_type: str | None = None  # "LAST" | "MEAN" | "CLS"
    normalize: bool | None = None
    dimensions: int | None = None  # the output size of a request that names none (Matryoshka)
    # From the model's config.json (`matryoshka_dimensions`, `is_matryoshka`): which output
    # sizes a request may ask for. Set by model/pooling_config.py, not by users.
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
                raise _bad("pooler_config.pooling_type", f"one of {', '.join(POOLING_TYPES)}", self.pooling_type)
            self.pooling_type = self.pooling_type.upper()
        self.normalize = _bool_or_none("pooler_config.normalize", self.normalize)
        self.dimensions = _positive_int_or_none("pooler_config.dimensions", self.dimensions)

    @classmethod
    def from_any(cls, value: Any) -> "PoolerConfig | None":
        """A PoolerConfig, a dict of its fields (vLLM's `--pooler-config '{...}'`), or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise _bad("pooler_config", "a dict such as {'pooling_type': 'MEAN'} or a PoolerConfig", value)
        try:
            return msgspec.convert(value, cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"pooler_config: {e}") from None


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):  # type: ignore[call-arg]
    """vLLM's `PoolingParams`: what one pooling request asks for. `task` "embed" (one vector),
    "token_embed" (one per prompt token), "classify" (a classifier's label probabilities) or
    "token_classify" (those of every prompt token);
    `normalize` / `use_activation` (vLLM's newer name; for classify: softmax or sigmoid) None take
    the engine's; `dimensions` only for Matryoshka models; `truncate_prompt_tokens` keeps the
    prompt's last k tokens (-1: as many as the model takes)."""

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None
    # Set by the caller's engine from a prompt's `token_type_ids` (a cross-encoder's pair, as
    # the tokenizer encodes it): the index of the first token of type 1 (vLLM's
    # compressed_token_type_ids); every token before it has type 0, every one from it type 1.
    token_type_start: int | None = None

    def __post_init__(self) -> None:
        self.dimensions = _positive_int_or_none("dimensions", self.dimensions)
        self.normalize = _bool_or_none("normalize", self.normalize)
        self.use_activation = _bool_or_none("use_activation", self.use_activation)
        if self.truncate_prompt_tokens is not None:
            keep = self.truncate_prompt_tokens
            if isinstance(keep, bool) or not isinstance(keep, int) or keep == 0 or keep < -1:
                raise _bad("truncate_prompt_tokens", "a positive integer, -1 (the model's limit) or None", keep)
        if self.task is not None and self.task not in POOLING_TASKS:
            raise _bad("task", f"one of {', '.join(POOLING_TASKS)}", self.task)

    def clone(self, **changes: Any) -> "PoolingParams":
        return msgspec.structs.replace(self, **changes)

    def resolve(self, task: str, pooler: PoolerConfig, hidden_size: int,
                classifier_labels: tuple[str, ...] | None = None) -> "PoolingParams":
        """The request as the engine core runs it: the task, whether to normalize (classify:
        whether to apply the activation) and the output size, all decided (the caller checks
        everything here, naming the field). `classifier_labels`: the model's, None for a model
        that embeds."""
        if self.task is not None and self.task != task:
            raise ValueError(f"task is {self.task!r} but this call runs the {task!r} task.")
        if classifier_labels is not None and task not in CLASSIFY_TASKS:
            raise ValueError(f"task is {task!r}, but this model is a sequence classifier ({len(classifier_labels)} "
                             "labels): it runs the classify and token_classify tasks (LLM.classify, LLM.score, the "
                             "/classify route).")
        if classifier_labels is None and task in CLASSIFY_TASKS:
            raise ValueError(f"task is {task!r}, which needs a sequence classification model (config.json naming a "
                             "*ForSequenceClassification architecture); this one embeds (LLM.embed, /v1/embeddings).")
        normalize = self.normalize if self.normalize is not None else self.use_activation
        if self.normalize is not None and self.use_activation is not None and self.normalize != self.use_activation:
            raise ValueError("normalize and use_activation (its newer name) disagree: give one of them.")
        if task in CLASSIFY_TASKS:
            if self.dimensions is not None:
                raise ValueError(f"dimensions applies to the embed task only, not {task!r}.")
            return PoolingParams(use_activation=True if normalize is None else normalize, task=task,
                                 truncate_prompt_tokens=self.truncate_prompt_tokens)
        if normalize is None:
            normalize = pooler.normalize if pooler.normalize is not None else True
        dimensions = self.dimensions
        if dimensions is not None:
            if task != "embed":
                raise ValueError(f"dimensions applies to the embed task only, not {task!r}.")
            check_dimensions(dimensions, pooler, hidden_size)
        elif task == "embed" and pooler.dimensions is not None:
            dimensions = pooler.dimensions
        if dimensions == hidden_size:
            dimensions = None  # the whole vector
        return PoolingParams(dimensions=dimensions, normalize=normalize, task=task,
                             truncate_prompt_tokens=self.truncate_prompt_tokens)


def check_dimensions(dimensions: int, pooler: PoolerConfig, hidden_size: int) -> None:
    """vLLM's rule: another output size only for a Matryoshka model, and one it lists."""
    if not pooler.is_matryoshka:
        raise ValueError(f"dimensions is {dimensions}, but the model does not support Matryoshka representations "
                         "(its config.json has neither is_matryoshka nor matryoshka_dimensions): changing the "
                         "output dimensions would give poor embeddings.")
    allowed = pooler.matryoshka_dimensions
    if allowed is not None and dimensions not in allowed:
        raise ValueError(f"dimensions is {dimensions}, but the model supports only the Matryoshka dimensions "
                         f"{sorted(allowed)}.")
    if dimensions > hidden_size:
        raise ValueError(f"dimensions is {dimensions}, but the model's embeddings have {hidden_size} dimensions.")
