"""The architectures we run, as one table (vLLM's `_TEXT_GENERATION_MODELS`): a config.json's
`architectures[0]` -> our architecture name, the class that runs it, and what it supports.

Torch-free: the caller's process reads configs through this table (hf_config.py, gguf_config.py)
without importing the model classes; `build_model` imports the one class it needs.

To add a family: one `ModelEntry` below (keep the order: the docs table follows it), its config
translation in hf_config.FAMILY_FIELDS (and gguf_config for a GGUF), and, where its decoder is
not Llama's, the difference in a module of its own registered in `_MODEL_MODULES`. Then run
`python -m tokenloom.model.registry` to regenerate docs/models.md and README's table
(tests/model/test_registry.py fails while they are stale).
"""
from __future__ import annotations

import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from tokenloom.model.config import ModelArchConfig


@dataclass(frozen=True, slots=True)
class ModelEntry:
    architecture: str  # our name: ModelArchConfig.architecture, the key of the config translation
    module: str  # a key of _MODEL_MODULES: the module that defines `class_name`
    class_name: str
    family: str  # what users call it, for the docs table
    gguf: str | None = None  # llama.cpp's `general.architecture` for it; None: HF directories only
    lora: bool = True  # LoRA adapters on q/k/v/o and gate/up/down (worker/lora_manager.py)
    tensor_parallel: bool = True  # model/tensor_parallel.py can cut it
    # The HF names of its pooling forms (a bare `*Model` decoder, a `*ForSequenceClassification`
    # with a `score` head): they run with runner="pooling" on the same class.
    pooling: tuple[str, ...] = ()
    notes: str = ""  # one line for the docs table: what differs from Llama
    # How the model pools where neither the user nor its sentence-transformers files say (vLLM's
    # default_pooling_type): LAST for decoders, CLS for encoders.
    pooling_type: str = "LAST"


# HF `architectures[0]` of a generative checkpoint -> its entry. Several names may share our
# architecture; the first entry of an architecture is the one GGUF files and build_model use.
TEXT_GENERATION_MODELS: dict[str, ModelEntry] = {
    "LlamaForCausalLM": ModelEntry(
        "llama", "llama", "LlamaForCausalLM", "Llama (SmolLM2, TinyLlama, Llama 2/3)", gguf="llama",
        pooling=("LlamaModel", "LlamaForSequenceClassification"),
        notes="the base decoder: RMSNorm, grouped-query attention, SwiGLU, RoPE (default, linear, llama3, yarn, dynamic), "
              "attention_bias and mlp_bias"),
    "Qwen2ForCausalLM": ModelEntry(
        "qwen2", "llama", "LlamaForCausalLM", "Qwen2, Qwen2.5", gguf="qwen2",
        pooling=("Qwen2Model", "Qwen2ForSequenceClassification"),
        notes="q/k/v bias"),
    "Qwen3ForCausalLM": ModelEntry(
        "qwen3", "llama", "LlamaForCausalLM", "Qwen3", gguf="qwen3",
        pooling=("Qwen3Model", "Qwen3ForSequenceClassification"),
        notes="per-head q/k RMSNorm"),
    "Gemma3ForCausalLM": ModelEntry(
        "gemma3", "gemma3", "Gemma3ForCausalLM", "Gemma 3 (text)", gguf="gemma3",
        # transformers' text-only classifier, and the name convert="classify" gives a
        # Gemma3ForCausalLM (a gemma3_text config either way).
        pooling=("Gemma3TextForSequenceClassification", "Gemma3ForSequenceClassification"),
        notes="sandwich norms, GeGLU, sliding-window layers, logit soft-capping"),
    "MistralForCausalLM": ModelEntry(
        "mistral", "llama", "LlamaForCausalLM", "Mistral 7B, Mistral Nemo, Mistral Small (text)", gguf="llama",
        notes="a sliding window over every layer where the config sets one"),
    "GraniteForCausalLM": ModelEntry(
        "granite", "llama", "LlamaForCausalLM", "Granite 3", gguf="granite",
        notes="embedding, residual, attention and logit multipliers"),
    "Olmo2ForCausalLM": ModelEntry(
        "olmo2", "olmo2", "Olmo2ForCausalLM", "OLMo 2", gguf="olmo2", tensor_parallel=False,
        notes="post-norms only; q/k RMSNorm over the whole projection"),
    "SmolLM3ForCausalLM": ModelEntry(
        "smollm3", "llama", "LlamaForCausalLM", "SmolLM3", gguf="smollm3",
        notes="layers without RoPE (no_rope_layers)"),
    "StableLmForCausalLM": ModelEntry(
        "stablelm", "llama", "LlamaForCausalLM", "StableLM 2, StableLM 3B", gguf="stablelm",
        notes="LayerNorm with bias, partial rotary embedding, optional q/k/v bias"),
    "GemmaForCausalLM": ModelEntry(
        "gemma", "gemma", "GemmaForCausalLM", "Gemma", gguf="gemma",
        notes="GeGLU, (1 + weight) RMSNorm, embedding scaled by sqrt(hidden), tied LM head"),
    "Gemma2ForCausalLM": ModelEntry(
        "gemma2", "gemma", "Gemma2ForCausalLM", "Gemma 2", gguf="gemma2",
        notes="Gemma's, with sandwich norms, every other layer sliding, attention and logit soft-capping "
              "(attention on the torch backend)"),
    "Phi3ForCausalLM": ModelEntry(
        "phi3", "phi3", "Phi3ForCausalLM", "Phi-3, Phi-3.5, Phi-4, Phi-4-mini", gguf="phi3",
        # PEFT adapters of Phi-3 name the fused qkv_proj / gate_up_proj, which model/lora.py does not read.
        lora=False,
        notes="fused qkv_proj and gate_up_proj in the checkpoint, LongRoPE, partial rotary, sliding window"),
    "Glm4ForCausalLM": ModelEntry(
        "glm4", "glm4", "Glm4ForCausalLM", "GLM-4 (0414)", gguf="glm4",
        lora=False,  # its q/k rows are reordered at load (and gate_up_proj is fused), an adapter's are not
        notes="post-attention and post-MLP norms, q/k/v bias, fused gate_up_proj, RoPE on half of each head "
              "in adjacent pairs"),
    "CohereForCausalLM": ModelEntry(
        "cohere", "cohere", "CohereForCausalLM", "Command-R (Cohere)", gguf="command-r",
        lora=False,  # its q/k rows are reordered at load, an adapter's are not
        notes="parallel attention and MLP after one LayerNorm (no bias), logit_scale, tied LM head, "
              "RoPE in adjacent pairs"),
    "Qwen3MoeForCausalLM": ModelEntry(
        "qwen3_moe", "moe", "MoeForCausalLM", "Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B)", gguf="qwen3moe",
        lora=False, tensor_parallel=False,
        notes="Qwen3's attention; sparse MoE MLP (softmax top-k routing, norm_topk_prob), mlp_only_layers"),
    "Qwen2MoeForCausalLM": ModelEntry(
        "qwen2_moe", "moe", "MoeForCausalLM", "Qwen2-MoE, Qwen1.5-MoE", gguf="qwen2moe",
        lora=False, tensor_parallel=False,
        notes="Qwen2's attention; sparse MoE MLP with a shared expert gated by a sigmoid"),
    "MixtralForCausalLM": ModelEntry(
        "mixtral", "moe", "MixtralForCausalLM", "Mixtral", gguf="llama",
        lora=False, tensor_parallel=False,
        notes="Mistral's attention; sparse MoE MLP (top-2 of 8, renormalised); GGUF: `llama` with expert tensors"),
    "GptOssForCausalLM": ModelEntry(
        "gpt_oss", "gpt_oss", "GptOssForCausalLM", "gpt-oss", gguf="gpt-oss", tensor_parallel=False,
        lora=False,  # its experts are stacked tensors, which model/lora.py does not wrap
        notes="mixture of experts (biased router, clamped SwiGLU with biases, MXFP4 experts as shipped), "
              "attention sinks (attention on the torch backend), q/k/v/o bias, alternating sliding-window layers"),
}

# Encoder-only models (vLLM's _EMBEDDING_MODELS and _CROSS_ENCODER_MODELS): they run with
# runner="pooling" only (bidirectional attention, each prompt whole in one step, no KV cache
# read), as embedders (the bare `*Model`) and cross-encoders (the `pooling` forms).
ENCODER_MODELS: dict[str, ModelEntry] = {
    "BertModel": ModelEntry(
        "bert", "bert", "BertModel", "BERT (bge, e5, MiniLM, ms-marco cross-encoders)", lora=False,
        tensor_parallel=False, pooling=("BertForSequenceClassification",), pooling_type="CLS",
        notes="post-norm encoder, absolute positions, token types (a pair's second text)"),
    "XLMRobertaModel": ModelEntry(
        "xlm_roberta", "bert", "XLMRobertaModel", "XLM-RoBERTa (bge-m3, multilingual-e5, bge-reranker)",
        lora=False, tensor_parallel=False, pooling=("XLMRobertaForSequenceClassification",), pooling_type="CLS",
        notes="BERT's, positions from padding_idx + 1, RoBERTa's classifier head"),
    "ModernBertModel": ModelEntry(
        "modernbert", "modernbert", "ModernBertModel", "ModernBERT (gte-modernbert, modernbert-embed)",
        lora=False, tensor_parallel=False, pooling=("ModernBertForSequenceClassification",), pooling_type="CLS",
        notes="pre-norm, RoPE, local (windowed) and global layers, GeGLU; classifier pooling from config.json"),
}

# _MODEL_MODULES[entry.module]: the module to import (a literal, so tests/house/test_imports.py
# sees the dependency).
_MODEL_MODULES = {
    "llama": "tokenloom.model.llama",
    "gemma3": "tokenloom.model.gemma3",
    "olmo2": "tokenloom.model.olmo2",
    "gemma": "tokenloom.model.gemma",
    "phi3": "tokenloom.model.phi3",
    "glm4": "tokenloom.model.glm4",
    "cohere": "tokenloom.model.cohere",
    "bert": "tokenloom.model.bert",
    "modernbert": "tokenloom.model.modernbert",
    "moe": "tokenloom.model.moe",
    "gpt_oss": "tokenloom.model.gpt_oss",
}

# Every entry: the generative models', then the encoders'.
_ALL_MODELS: dict[str, ModelEntry] = TEXT_GENERATION_MODELS | ENCODER_MODELS

# config.json `architectures[0]` -> our architecture name, pooling forms included.
HF_ARCHITECTURES: dict[str, str] = {
    name: entry.architecture
    for hf, entry in _ALL_MODELS.items()
    for name in (hf, *entry.pooling)
}

# Our architecture name -> its entry (the first of that name).
ARCHITECTURE_ENTRIES: dict[str, ModelEntry] = {}
for _entry in _ALL_MODELS.values():
    ARCHITECTURE_ENTRIES.setdefault(_entry.architecture, _entry)

# GGUF `general.architecture` -> our architecture name (the first entry that reads it: Mistral's
# GGUFs say "llama" and are Llama's).
GGUF_ARCHITECTURES: dict[str, str] = {}
for _entry in TEXT_GENERATION_MODELS.values():
    if _entry.gguf is not None:
        GGUF_ARCHITECTURES.setdefault(_entry.gguf, _entry.architecture)
del _entry


def model_class(architecture: str) -> type[nn.Module]:
    entry = ARCHITECTURE_ENTRIES[architecture]
    return getattr(importlib.import_module(_MODEL_MODULES[entry.module]), entry.class_name)


def build_model(config: ModelArchConfig) -> nn.Module:
    return model_class(config.architecture)(config)


# ------------------------------------------------------------------------------- the docs table
MODELS_PAGE = Path(__file__).resolve().parents[3] / "docs" / "models.md"
README = Path(__file__).resolve().parents[3] / "README.md"
_README_BEGIN = "<!-- models:begin (generated by `python -m tokenloom.model.registry` from model/registry.py) -->"
_README_END = "<!-- models:end -->"


def models_table() -> str:
    """The markdown table of TEXT_GENERATION_MODELS, one row per entry."""
    yes = {True: "yes", False: "no"}
    rows = ["| architecture | family | GGUF (llama.cpp) | LoRA | tensor parallel | pooling forms | differs from Llama by |",
            "|---|---|---|---|---|---|---|"]
    for hf, e in TEXT_GENERATION_MODELS.items():
        pooling = ", ".join(f"`{p}`" for p in e.pooling) or "-"
        rows.append(f"| `{hf}` | {e.family} | {f'`{e.gguf}`' if e.gguf else '-'} | {yes[e.lora]} | "
                    f"{yes[e.tensor_parallel]} | {pooling} | {e.notes or '-'} |")
    return "\n".join(rows) + "\n"


def encoder_table() -> str:
    """The markdown table of ENCODER_MODELS, one row per entry."""
    rows = ["| architecture | family | classifier form | default pooling | what it is |", "|---|---|---|---|---|"]
    for hf, e in ENCODER_MODELS.items():
        pooling = ", ".join(f"`{p}`" for p in e.pooling) or "-"
        rows.append(f"| `{hf}` | {e.family} | {pooling} | {e.pooling_type} | {e.notes or '-'} |")
    return "\n".join(rows) + "\n"


def models_page_markdown() -> str:
    """docs/models.md: the model table with how to read it."""
    return (
        "# Models\n\n"
        "Generated from `tokenloom.model.registry.TEXT_GENERATION_MODELS` by `python -m tokenloom.model.registry`; "
        "do not edit by hand.\n\n"
        "A Hugging Face directory loads when its `config.json` names one of these architectures (or one of its "
        "pooling forms, run with `runner=\"pooling\"`); a GGUF file loads when its `general.architecture` is in "
        "the GGUF column (llama.cpp's converter writes Mistral as `llama`). Families that are Llama with a few "
        "changes run on Llama's decoder with those changes switched on by the config.\n\n"
        + models_table()
        + "\n## Encoder models\n\n"
        "Run with `runner=\"pooling\"` only (the default for them): embeddings from the bare `*Model`, "
        "cross-encoder scores (`LLM.score`, `/score`, `/rerank`) from the `*ForSequenceClassification` form. "
        "See [embeddings and pooling](embeddings.md).\n\n"
        + encoder_table()
        + "\nRoPE scaling (`rope_scaling` or `rope_parameters` in config.json): `linear`, `llama3`, `yarn` and "
        "`dynamic`, as transformers computes them. YaRN and dynamic NTK stretch the context to `factor` times "
        "the original, as vLLM does. Dynamic NTK rotates each position past the original context with the "
        "base transformers uses when it decodes that position; a prompt longer than the original context is "
        "therefore rotated position by position, where transformers' prefill rotates all of it with the "
        "prompt's length. Sliding windows (Mistral, Qwen2 with `use_sliding_window`, Gemma 3) go through the "
        "KV cache groups ([the KV cache](kv-cache.md)).\n\n"
        "Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral) run their base family's attention with a "
        "sparse MoE layer in place of the MLP: top-k routing, tokens grouped by expert, one matmul per chosen "
        "expert over only its tokens, quantized GGUF experts computed from the file's blocks. They run on one "
        "rank (no tensor or expert parallelism) and without LoRA; see [Mixture-of-experts models](moe.md).\n"
        "\ngpt-oss (`GptOssForCausalLM`) loads from its Hugging Face directory as shipped (the experts' MXFP4 "
        "weights, `quantization_config.quant_method: mxfp4`, `*_blocks` and `*_scales`) and from llama.cpp's "
        "`gpt-oss` GGUF (MXFP4 expert tensors): the MXFP4 experts stay packed in memory and each expert is "
        "computed from its packed bytes for the step whose tokens chose it, so no float copy of the experts is "
        "kept; a checkpoint with float experts loads too. Its attention sinks run on the torch attention backend "
        "(the selector picks it; decodes take the PyTorch path, not the C decode kernel). Its harmony chat "
        "format is read back by `--reasoning-parser openai_gptoss` (alias `gpt_oss`) and `--tool-call-parser "
        "openai` ([Structured outputs and tools](structured-outputs.md#reasoning-models)).\n")


def readme_with_table(readme: str) -> str:
    """README.md with the text between its models markers replaced by the current table."""
    pattern = re.compile(re.escape(_README_BEGIN) + r".*?" + re.escape(_README_END), re.S)
    if not pattern.search(readme):
        raise ValueError(f"README.md has no {_README_BEGIN!r} ... {_README_END!r} block")
    return pattern.sub(lambda _: f"{_README_BEGIN}\n{models_table()}{_README_END}", readme)


if __name__ == "__main__":
    MODELS_PAGE.write_text(models_page_markdown())
    README.write_text(readme_with_table(README.read_text()))
    print(f"wrote {MODELS_PAGE} and the model table of {README}")
    sys.exit(0)
