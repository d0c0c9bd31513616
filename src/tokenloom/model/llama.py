"""One decoder for the Llama family (SmolLM2, TinyLlama, Llama 2/3), Qwen2 and Qwen3.

The three differ in two switches of `ModelArchConfig`: `attention_bias` (Qwen2 has a bias on the
q/k/v projections) and `qk_norm` (Qwen3 applies a per-head RMSNorm to q and k before the rotary
embedding). Everything else -- pre-norm residual blocks, grouped-query attention, SwiGLU MLP,
rotate-half RoPE -- is shared.

The model runs on a flat batch: `input_ids[T]` and `positions[T]` of every scheduled token of
every request, one after another, with no batch dimension and no padding. Which request a token
belongs to, and where its context lives in the paged KV cache, only the attention backend needs to
know; it gets that from the attention plans, which the model runner prepares once per step, one
per KV cache group (`kv_cache_spec`): layer i uses `attn_plans[kv_cache_group_of_layer[i]]`.
These models have one group.

q/k/v and gate/up are each one matmul over a fused weight: checkpoints store them apart, and
`load_weights` copies each part into its rows of the fused parameter. As in vLLM, a layer hands
the residual stream on beside its output, so the next norm adds the two itself. The norms, RoPE
and SiLU-and-mul are `ops.elementwise`'s, which picks the C kernels or the PyTorch ops.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.attention.backend import AttentionBackend
from tokenloom.kv_cache_spec import group_of_layer, kv_cache_groups
from tokenloom.model.config import ModelArchConfig
from tokenloom.model.packed_linear import linear
from tokenloom.model.rope import check_rope_scaling, cos_sin_cache
from tokenloom.ops import elementwise as ops


class Linear(nn.Module):
    """`nn.Linear` without the random initialisation: every weight is overwritten by the
    checkpoint, and initialising 135M+ parameters would cost start-up time for nothing."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # A oneDNN-packed copy of `weight`, set by the CPU model runner (see packed_linear).
        self.packed_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


class Embedding(nn.Module):
    """`nn.Embedding` without the random initialisation (see `Linear`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with `residual`: (norm(x + residual), x + residual)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


class LayerNorm(nn.Module):
    """LayerNorm with a bias (StableLM) or without (Command-R), with RMSNorm's residual form."""

    def __init__(self, size: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with `residual`: (norm(x + residual), x + residual)."""
        if residual is None:
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        x = x + residual
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps), x


def make_norm(cfg: ModelArchConfig, size: int | None = None) -> nn.Module:
    """The family's norm over `size` (default hidden_size): RMSNorm, or LayerNorm with a bias."""
    return (LayerNorm if cfg.layer_norm else RMSNorm)(size or cfg.hidden_size, cfg.rms_norm_eps)


class Attention(nn.Module):
    # Gemma 2 caps the attention scores at this (tanh), set per layer by its decoder.
    softcap: float | None = None

    def __init__(self, cfg: ModelArchConfig, layer_id: int = 0) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5 if cfg.attention_multiplier is None else cfg.attention_multiplier
        # RoPE on the first rotary_dim dimensions of each head (all, but StableLM's), in every
        # layer but SmolLM3's NoPE layers.
        self.rotary_dim = cfg.rotary_dim or cfg.head_dim
        self.use_rope = layer_id not in cfg.nope_layers
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        # gpt-oss: a learned logit per query head in each softmax ([num_heads]).
        self.register_parameter("sinks", nn.Parameter(torch.empty(self.num_heads)) if cfg.attention_sinks else None)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv_cache: torch.Tensor, backend: AttentionBackend, plan: Any) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q and k heads side by side: one RoPE for both (half the per-op dispatch of two
            # calls, which shows at batch 1), then strided views of the result.
            qk = qkv[:, :self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads,
                                                          self.head_dim)
            q, k = self.rope(qk, positions, cos_sin).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = qkv[:, :self.q_size].view(T, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.num_kv_heads,
                                                                   self.head_dim)
            q = self.rope(self.q_norm(q), positions, cos_sin)
            k = self.rope(self.k_norm(k), positions, cos_sin)
        out = backend.forward(q, k, v.contiguous(), kv_cache, plan, self.scale, softcap=self.softcap,
                              sinks=self.sinks)
        return self.o_proj(out.reshape(T, self.q_size))

    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        if not self.use_rope:
            return x
        r = self.rotary_dim
        if r == self.head_dim:
            return ops.rope(x, positions, cos_sin)
        return torch.cat([ops.rope(x[..., :r], positions, cos_sin), x[..., r:]], dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A quantized gate|up (model/quant_linear.QuantLinear, which imports this module):
        # SiLU-and-mul in the matmul's epilogue where its kernel has one (the [T, 2I] product
        # never goes through memory), the same bits as the two ops; None where it has not.
        fused = getattr(self.gate_up_proj, "silu_and_mul", None)
        if fused is not None:
            act = fused(x)
            if act is not None:
                return self.down_proj(act)
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_id: int = 0) -> None:
        super().__init__()
        self.input_layernorm = make_norm(cfg)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.residual_multiplier = cfg.residual_multiplier  # Granite's; 1 elsewhere

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cos_sin: torch.Tensor, kv_cache: torch.Tensor, backend: AttentionBackend,
                plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(the block's output, the residual stream before it); the caller adds the two."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, cos_sin, kv_cache, backend, plan)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        return x, residual


# Checkpoint (HF) names of the parts that live inside a fused parameter:
# part suffix -> (fused suffix, index of the part among the fused parts).
_FUSED_PARTS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 / Qwen3 decoder over a flat batch (see the module docstring)."""

    # A decoder of another family (gemma3.py) brings its own layer, RoPE tables and forward, and
    # keeps the rest: the embedding, final norm, LM head, and loading weights into fused rows.
    decoder_layer_cls: type[nn.Module] = DecoderLayer
    # Whether `forward` is this class's (model/fused_decode replaces exactly that for decodes).
    fused_decode_ok = True

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        check_rope_scaling(config.rope_scaling, f"{config.architecture} model")
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config)
        # The fused C decode step computes Llama's layers (with q/k/v bias) and nothing else.
        self.fused_decode_ok = self.fused_decode_ok and config.is_plain_llama
        # A classifier has no LM head (it never computes logits over the vocabulary; its
        # compute_logits would read the embedding as a tied model's does) but a `score` head.
        classifier = config.classifier_labels is not None
        self.lm_head = None if config.tie_word_embeddings or classifier else Linear(config.hidden_size, config.vocab_size)
        self.score = Linear(config.hidden_size, len(config.classifier_labels)) if classifier else None
        self.kv_cache_group_of_layer = group_of_layer(kv_cache_groups(config), config.num_hidden_layers)
        # The RoPE table stays float32 whatever the model dtype (cast per step after indexing,
        # as the reference casts its float32 cos/sin), so it is a plain attribute that `.to()`
        # leaves alone; `forward` rebuilds it on the model's device when that changed.
        self.cos_sin = self._rope_table(torch.device("cpu"))
        # The LM head's oneDNN-packed weight (also when tied to the embedding), see packed_linear.
        self.packed_lm_head: torch.Tensor | None = None
        # A quantized LM head (model/quant_linear), installed by the loader in place of the above.
        self.quant_lm_head: nn.Module | None = None
        # Under tensor parallelism (model/tensor_parallel) the LM head computes this rank's slice
        # of the vocabulary; this joins the slices. None with one rank.
        self.vocab_gather: Callable[[torch.Tensor], torch.Tensor] | None = None
        # False once `drop_lm_head` ran: a pooling model, whose runner never asks for logits.
        self.computes_logits = True
        # Decode steps as one C call (model/fused_decode.FusedDecode), set by the CPU model
        # runner once quantization and tensor parallelism have shaped the layers.
        self.fused_decode: Callable[..., torch.Tensor | None] | None = None

    def _rope_table(self, device: torch.device) -> torch.Tensor:
        c = self.config
        with torch.device("cpu"):
            table = cos_sin_cache(c.rotary_dim or c.head_dim, c.max_position_embeddings, c.rope_theta,
                                  c.rope_scaling)
        return table.to(device)

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_backend: AttentionBackend, attn_plans: list[Any]) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden_size] (after the final norm).
        `attn_plans`: one per KV cache group (see the module docstring)."""
        h = self.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:
            h = h * self.config.embedding_multiplier
        if self.cos_sin.device != h.device:
            self.cos_sin = self._rope_table(h.device)
        cos_sin = self.cos_sin
        # The C RoPE reads table rows unchecked (index_select would raise on these; on a GPU
        # the check would cost a sync, and the PyTorch path raises there itself).
        if positions.device.type == "cpu" and positions.numel() and int(positions.max()) >= cos_sin.shape[0]:
            raise IndexError(f"position {int(positions.max())} is past the model's "
                             f"{cos_sin.shape[0]} RoPE positions")
        if self.fused_decode is not None and not torch.compiler.is_compiling():
            out = self.fused_decode(h, positions, kv_caches, attn_plans)
            if out is not None:
                return out
        residual = None
        for layer, kv_cache, g in zip(self.layers, kv_caches, self.kv_cache_group_of_layer, strict=True):
            h, residual = layer(h, residual, positions, cos_sin, kv_cache, attn_backend, attn_plans[g])
        return self.norm(h) if residual is None else self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> float32 [N, vocab_size]."""
        if not self.computes_logits:
            raise RuntimeError("this model runs as a pooling model (runner='pooling'): its LM head was dropped")
        if self.quant_lm_head is not None:
            logits = self.quant_lm_head(hidden).float()  # bfloat16 in a bf16 model
        else:
            # transformers' generate computes the logits of one row per sequence at a time, which
            # oneDNN sums in one go: so do we, however many rows a step has (ops/amx).
            logits = linear(hidden, self.lm_head_weight, None, self.packed_lm_head,
                            one_row_order=True).float()
        if self.vocab_gather is not None:
            logits = self.vocab_gather(logits)
        return logits if self.config.logits_scaling == 1.0 else logits / self.config.logits_scaling

    def drop_lm_head(self) -> None:
        """For a model that only pools (embeddings, classification): frees an untied LM head (a
        vocabulary-sized matrix, in float or quantized form) and keeps the packers from making a
        copy of one, so the model holds one vocabulary-sized table, its embedding."""
        self.lm_head = None
        self.quant_lm_head = None
        self.packed_lm_head = None
        self.computes_logits = False

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    # ---------------------------------------------------------------- weights
    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint must provide, under its HF name, with its shape."""
        c = self.config
        H, D, I = c.hidden_size, c.head_dim, c.intermediate_size
        q, kv = c.num_attention_heads * D, c.num_key_value_heads * D
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, H),
                                              "model.norm.weight": (H,)}
        if c.layer_norm:
            shapes["model.norm.bias"] = (H,)
        if c.classifier_labels is not None:
            shapes["score.weight"] = (len(c.classifier_labels), H)
        elif not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, H)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (q, H),
                p + "self_attn.k_proj.weight": (kv, H),
                p + "self_attn.v_proj.weight": (kv, H),
                p + "self_attn.o_proj.weight": (H, q),
                p + "mlp.gate_proj.weight": (I, H),
                p + "mlp.up_proj.weight": (I, H),
                p + "mlp.down_proj.weight": (H, I),
            }
            if c.attention_bias:
                shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)}
            if c.o_proj_bias:
                shapes[p + "self_attn.o_proj.bias"] = (H,)
            if c.mlp_bias:
                shapes |= {p + "mlp.gate_proj.bias": (I,), p + "mlp.up_proj.bias": (I,), p + "mlp.down_proj.bias": (H,)}
            if c.layer_norm:
                shapes |= {p + "input_layernorm.bias": (H,), p + "post_attention_layernorm.bias": (H,)}
            if c.qk_norm:
                shapes |= {p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)}
        return shapes

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names, shapes already checked by the loader against
        `checkpoint_shapes`) into our parameters; returns the names consumed. Names we have no
        use for (e.g. `lm_head.weight` of a tied model) are skipped."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            ours = name.removeprefix("model.")
            target_rows = None
            for part, (fused, index) in _FUSED_PARTS.items():
                if f".{part}." in f".{ours}":
                    ours = ours.replace(part, fused)
                    target_rows = self._fused_rows(fused, index)
                    break
            param = params.get(ours)
            if param is None:
                continue
            dst = param if target_rows is None else param[target_rows[0]:target_rows[1]]
            dst.copy_(tensor)
            loaded.add(name)
        return loaded

    def _fused_rows(self, fused: str, index: int) -> tuple[int, int]:
        c = self.config
        if fused == "self_attn.qkv_proj":
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            starts = (0, q, q + kv, q + 2 * kv)
        else:
            starts = (0, c.intermediate_size, 2 * c.intermediate_size)
        return starts[index], starts[index + 1]
