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
    # The differences of the families that run on Llama's decoder (defaults: Llama's). Biases
    # (config.json's attention_bias puts one on o_proj too, mlp_bias on gate/up/down).
    o_proj_bias: bool = False
    mlp_bias: bool = False
    # StableLM: LayerNorm with a bias instead of RMSNorm (eps: rms_norm_eps), and RoPE on the
    # first `rotary_dim` dimensions of each head only (None: all of head_dim).
    layer_norm: bool = False
    rotary_dim: int | None = None
    # SmolLM3: the layers that attend without RoPE (its config's no_rope_layers entries of 0).
    nope_layers: tuple[int, ...] = ()
    # Granite: the embedding times embedding_multiplier, each block's output times
    # residual_multiplier before its residual add, the logits divided by logits_scaling, and the
    # attention scale attention_multiplier (None: head_dim ** -0.5).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_multiplier: float | None = None
    # Mixture of experts (model/moe.py; 0 experts: a dense model): each token's MLP is the
    # weighted sum of `num_experts_per_tok` of `num_experts` experts of width
    # `moe_intermediate_size`, weights renormalised over those (`norm_topk_prob`) or not; the
    # layers in `mlp_only_layers` keep a dense MLP of `intermediate_size`. Qwen2-MoE adds a
    # shared expert (`shared_expert_intermediate_size`) gated by a sigmoid.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Sliding-window attention (Gemma 3; Mistral and Qwen2 where their config sets one): a query at position p sees keys p - W < j <= p in the
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
    # Gemma 2: tanh capping of the attention scores (score = cap * tanh(score / cap)).
    attn_logit_softcapping: float | None = None
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
    # Encoders (model/bert.py, model/modernbert.py): bidirectional attention over whole prompts,
    # no KV cache read (the engine runs each prompt in one step: model/resolve.py). LayerNorm
    # eps is rms_norm_eps; `hidden_act` the MLP's activation (a key of bert.ACTIVATIONS).
    encoder: bool = False
    hidden_act: str = "silu"
    type_vocab_size: int = 0  # BERT's token types (a cross-encoder's second text is type 1)
    position_offset: int = 0  # XLM-R: position p reads row p + padding_idx + 1 of its table
    norm_bias: bool = True  # ModernBERT: LayerNorms without bias where norm_bias is false
    # ModernBERT: the local layers, which see keys within local_attention // 2 of the query.
    local_attention: int | None = None
    local_layers: tuple[int, ...] = ()
    classifier_activation: str = "gelu"  # ModernBERT's classifier head
    classifier_bias: bool = False
    # gpt-oss: a learned logit per query head in every attention softmax (its `self_attn.sinks`),
    # a key that holds no value: only the torch attention backend has them.
    attention_sinks: bool = False
    # gpt-oss's experts (model/gpt_oss.py): the clamped SwiGLU's sigmoid gain and clamp, and
    # whether their weights are MXFP4 as shipped (quantization_config.quant_method "mxfp4").
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    experts_mxfp4: bool = False

    @property
    def is_plain_llama(self) -> bool:
        """No difference from Llama's decoder beyond q/k/v bias (what the fused C decode step
        computes, model/fused_decode.py)."""
        return (not (self.o_proj_bias or self.mlp_bias or self.layer_norm or self.nope_layers)
                and self.rotary_dim in (None, self.head_dim) and self.embedding_multiplier == 1.0
                and self.residual_multiplier == 1.0 and self.logits_scaling == 1.0
                and self.attention_multiplier is None and self.attn_logit_softcapping is None
                and not self.attention_sinks and self.num_experts == 0)
