"""The architecture facts a model definition, the KV cache and the sampler need, in one place,
whatever file format they were read from (GGUF metadata or an HF config.json)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ModelArchConfig:
    architecture: str  # our name for it: a ModelEntry.architecture of model/registry.py
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None  # HF layout, e.g. {"rope_type": "llama3", ...}
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Sliding-window attention (Gemma 3): a query at position p sees keys p - W < j <= p in the
    # layers whose `layer_types` entry is "sliding_attention" (HF's names; the others are
    # "full_attention"). None: every layer attends to the whole context.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    # Gemma 3: the sliding layers' RoPE base (their RoPE is unscaled; `rope_theta` and
    # `rope_scaling` are the full-attention layers'), the attention scale's denominator
    # (scale = query_pre_attn_scalar ** -0.5; None: head_dim), and tanh capping of the logits.
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # A sequence classifier (`*ForSequenceClassification`: a `score` head of one row per label
    # over the last token's final state, no LM head): its labels in class order (config.json's
    # id2label). None for a language model.
    classifier_labels: tuple[str, ...] | None = None
    # A score head made from LM-head rows instead of read from the checkpoint (vLLM's
    # classifier_from_token with `method`, see hf_config.CLASSIFIER_METHODS): the tokens' ids.
    classifier_token_ids: tuple[int, ...] | None = None
    classifier_method: str | None = None
    # How a one-label classifier reads a scored pair (vLLM's name): True, the tokenizer's pair
    # encoding (a cross-encoder's separator); False, the two texts joined (an LM as reranker).
    use_sep_token: bool = True
