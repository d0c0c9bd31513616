"""Helpers for the model tests: run our model on a flat batch through the real paged KV cache and
attention backend, compute transformers' reference logits, and write small checkpoints (HF
directories and GGUF files) from transformers models built from configs."""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import kquants
import numpy as np
import torch

from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.attention.torch_backend import TorchAttentionBackend
from tokenloom.kv_cache_spec import kv_cache_groups


@torch.inference_mode()
def run_flat_batch(loaded, prompts: Sequence[Sequence[int]], chunk_sizes: int | Sequence[int] | None = None,
                   block_size: int = 16, scatter: bool = False, backend=None, seed: int = 0) -> torch.Tensor:
    """Prefill every prompt and return the logits of each one's last position, float32 [B, vocab].

    All prompts advance together, one flat batch per step, as the model runner schedules them:
    with `chunk_sizes` (one for all, or one per prompt) a prompt is prefilled `chunk` tokens per
    step, so later chunks read their context back from the paged cache (a chunk of 1 is a
    decode). `scatter` hands out blocks in a random order from a pool with spare blocks, so no
    request's blocks are contiguous or in order; the cache starts filled with large finite noise,
    so reading a slot that was never written shows up in the logits.
    """
    model, cfg = loaded.model, loaded.config
    backend = backend or TorchAttentionBackend()
    B = len(prompts)
    lens = [len(p) for p in prompts]
    assert all(n >= 1 for n in lens)
    if chunk_sizes is None:
        chunks = lens
    elif isinstance(chunk_sizes, int):
        chunks = [chunk_sizes] * B
    else:
        chunks = list(chunk_sizes)
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(blocks_needed) + (7 if scatter else 0)
    order = torch.randperm(num_blocks, generator=g) if scatter else torch.arange(num_blocks)
    max_blocks = max(blocks_needed)
    block_table = torch.zeros(B, max_blocks, dtype=torch.int32)
    cursor = 0
    for i, n in enumerate(blocks_needed):
        block_table[i, :n] = order[cursor:cursor + n].to(torch.int32)
        cursor += n

    dev, dtype = model.norm.weight.device, loaded.dtype  # the embedding may be quantized
    shape = (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    kv_caches = [(torch.randn(shape, generator=g) * 50).to(dev, dtype) for _ in range(cfg.num_hidden_layers)]

    computed = [0] * B
    last_hidden: list[torch.Tensor | None] = [None] * B
    while any(c < n for c, n in zip(computed, lens)):
        reqs = [i for i in range(B) if computed[i] < lens[i]]
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for i in reqs:
            n = min(chunks[i], lens[i] - computed[i])
            positions = range(computed[i], computed[i] + n)
            ids.extend(prompts[i][computed[i]:computed[i] + n])
            pos.extend(positions)
            slots.extend(int(block_table[i, p // block_size]) * block_size + p % block_size for p in positions)
            computed[i] += n
            qsl.append(qsl[-1] + n)
            seq_lens.append(computed[i])
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        seq_t = torch.tensor(seq_lens, dtype=torch.int32)
        meta = AttentionMetadata(
            num_actual_tokens=len(ids), num_reqs=len(reqs),
            max_query_len=int((qsl_t[1:] - qsl_t[:-1]).max()), max_seq_len=int(seq_t.max()),
            query_start_loc=qsl_t.to(dev), seq_lens=seq_t.to(dev),
            block_table=block_table[reqs].to(dev), slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev),
            block_size=block_size, query_start_loc_cpu=qsl_t, seq_lens_cpu=seq_t)
        plans = [backend.prepare(dataclasses.replace(meta, sliding_window=g.sliding_window))
                 for g in kv_cache_groups(cfg)]
        hidden = model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), kv_caches, backend, plans)
        for row, i in enumerate(reqs):
            if computed[i] == lens[i]:
                last_hidden[i] = hidden[qsl[row + 1] - 1]
    return model.compute_logits(torch.stack(last_hidden))


@torch.inference_mode()
def hf_last_logits(hf_model, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """transformers' logits at each prompt's last position, one unpadded forward per prompt.
    Under inference_mode: without it autograd records every activation of a 1,000-token forward
    (the same logits, ~3x slower here)."""
    with torch.inference_mode():
        rows = [hf_model(torch.tensor([list(p)]), use_cache=False, logits_to_keep=1).logits[0, -1].float()
                for p in prompts]
    return torch.stack(rows)


# ------------------------------------------------------------------------- small checkpoints
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that every layer moves the logits (the default init is nearly
    silent at 2 layers): matrices ~N(0, 0.08), norms ~1 +- 0.2, biases ~N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def tiny_hf_model(kind: str, vocab_size: int, seed: int = 0, **overrides):
    """A 2-layer transformers model of `kind` ("llama" | "qwen2" | "qwen3"), random weights,
    float32, eval mode."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    # Only the one kind's classes: each transformers model module costs seconds to import.
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[kind]
    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix}ForCausalLM")
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common)).to(torch.float32).eval()
    randomize_(model, seed)
    return model


GEMMA3_WINDOW, GEMMA3_LAYERS = 8, 6


def tiny_gemma3(vocab_size: int, seed: int = 0, labels: Sequence[str] | None = None, **overrides):
    """A 6-layer transformers Gemma3ForCausalLM, five layers in six with a sliding window of 8,
    random weights, float32, eval mode (the tests of model/gemma3.py and of Gemma 3 on CUDA);
    with `labels`, a Gemma3TextForSequenceClassification of those labels instead."""
    import transformers

    cfg = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=GEMMA3_LAYERS,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
               sliding_window=GEMMA3_WINDOW, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
               rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    if labels is not None:
        cfg |= dict(num_labels=len(labels), id2label=dict(enumerate(labels)), label2id={x: i for i, x in enumerate(labels)})
    cfg.update(overrides)
    torch.manual_seed(seed)
    cls = transformers.Gemma3ForCausalLM if labels is None else transformers.Gemma3TextForSequenceClassification
    model = cls(transformers.Gemma3TextConfig(**cfg)).to(torch.float32).eval()
    randomize_(model, seed)
    with torch.no_grad():  # Gemma's norms scale by 1 + w: weights around 0, not 1
        for name, p in model.named_parameters():
            if "norm" in name:
                p.sub_(1.0)
    return model


def tiny_hf_classifier(kind: str, vocab_size: int, labels: Sequence[str], seed: int = 0):
    """A 2-layer transformers `*ForSequenceClassification` of `kind` with these labels (id2label
    in order), random weights, float32, eval mode: a cross-encoder when it has one label."""
    import transformers

    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[kind]
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        num_labels=len(labels), id2label=dict(enumerate(labels)), label2id={x: i for i, x in enumerate(labels)})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForSequenceClassification")(config).to(torch.float32).eval()
    randomize_(model, seed)
    return model


def save_hf_dir(model, tokenizer, directory: str, max_shard_size: str | None = None,
                generation_eos: int | list[int] | None = None) -> str:
    os.makedirs(directory, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    tokenizer.save_pretrained(directory)
    if generation_eos is not None:
        import json

        with open(os.path.join(directory, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": generation_eos}, f)
    return directory


def byte_tokenizer():
    """A byte-level tokenizer of 259 tokens (3 specials, then the 256 bytes): the engine needs
    one in the directory; the prompts are token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {c: i + 3 for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


# ------------------------------------------------------------------------------ GGUF files
def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama q/k rows: within each head, interleave the two
    rotary halves (row i of the first half, then row i of the second, ...)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensors_from_hf(model, arch: str) -> dict[str, np.ndarray]:
    """The model's state dict under llama.cpp's names (float32), permuted as llama.cpp would."""
    cfg = model.config
    out: dict[str, np.ndarray] = {}
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = a
        elif name == "model.norm.weight":
            out["output_norm.weight"] = a
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out["output.weight"] = a
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{_HF_TO_GGUF[rest]}"
            if arch == "llama" and rest == "self_attn.q_proj.weight":
                a = llama_cpp_permute(a, cfg.num_attention_heads)
            elif arch == "llama" and rest == "self_attn.k_proj.weight":
                a = llama_cpp_permute(a, cfg.num_key_value_heads)
            out[gname] = a
    return out


# The tiny Llama of the GGUF error / tokenizer tests.
HIDDEN, HEADS, KV, FFN, LAYERS = 64, 4, 2, 96, 2


def llama_tensors(vocab: int = 258, layers: int = LAYERS) -> dict[str, np.ndarray]:
    """Random float32 tensors of a tiny Llama under llama.cpp's names."""
    H = HIDDEN
    rng = np.random.default_rng(0)
    D = H // HEADS
    t = {"token_embd.weight": rng.standard_normal((vocab, H), dtype=np.float32),
         "output_norm.weight": np.ones(H, np.float32)}
    for i in range(layers):
        p = f"blk.{i}."
        t |= {p + "attn_norm.weight": np.ones(H, np.float32), p + "ffn_norm.weight": np.ones(H, np.float32),
              p + "attn_q.weight": rng.standard_normal((HEADS * D, H), dtype=np.float32),
              p + "attn_k.weight": rng.standard_normal((KV * D, H), dtype=np.float32),
              p + "attn_v.weight": rng.standard_normal((KV * D, H), dtype=np.float32),
              p + "attn_output.weight": rng.standard_normal((H, HEADS * D), dtype=np.float32),
              p + "ffn_gate.weight": rng.standard_normal((FFN, H), dtype=np.float32),
              p + "ffn_up.weight": rng.standard_normal((FFN, H), dtype=np.float32),
              p + "ffn_down.weight": rng.standard_normal((H, FFN), dtype=np.float32)}
    return t


SENTENCEPIECE_VOCAB = (["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
                       + ["\u2581", "h", "e", "l", "o", "\u2581h", "\u2581he", "ll", "\u2581hell", "\u2581hello"])


def byte_vocab() -> list[str]:
    """A tiny byte-level vocabulary: the 256 byte symbols, then two control tokens."""
    from tokenloom.model.tokenizer import _byte_alphabet

    return [_byte_alphabet()[b] for b in range(256)] + ["<|s|>", "<|e|>"]


def tiny_gguf(tmp_path, kind: str, qtype: int, seed: int = 7, qtypes: dict | None = None,
              **overrides) -> str:
    """A 2-layer `kind` model (transformers config, random weights) written as llama.cpp would,
    every matrix (embedding included) in `qtype`, or per tensor name as `qtypes` says."""
    vocab = byte_vocab()
    ref = tiny_hf_model(kind, vocab_size=len(vocab), seed=seed, **overrides)
    tensors = gguf_tensors_from_hf(ref, kind)
    c = ref.config
    import gguf

    return write_gguf(str(tmp_path / f"{kind}-{gguf.GGMLQuantizationType(qtype).name}.gguf"), kind, tensors, block_count=c.num_hidden_layers,
                      hidden=c.hidden_size, ffn=c.intermediate_size, heads=c.num_attention_heads,
                      kv_heads=c.num_key_value_heads, context=c.max_position_embeddings,
                      head_dim=getattr(c, "head_dim", None), rope_theta=c.rope_parameters["rope_theta"],
                      eps=c.rms_norm_eps,
                      qtypes={n: (qtypes or {}).get(n, qtype) for n, t in tensors.items() if t.ndim == 2})


def write_gguf(path: str, arch: str, tensors: dict[str, np.ndarray], *, block_count: int, hidden: int,
               ffn: int, heads: int, kv_heads: int, context: int = 1024, head_dim: int | None = None,
               qtypes: dict[str, int] | None = None, raw: dict[str, tuple[np.ndarray, int]] | None = None,
               rope_theta: float = 10000.0, eps: float = 1e-5, tokenizer: str | None = "gpt2",
               sliding_window: int | None = None, extra: dict[str, int | float] | None = None) -> str:
    """Write a GGUF. `qtypes` quantizes named tensors (default F32); `raw` adds tensors as
    (uint8 bytes shaped [*rows, bytes_per_row], ggml type), e.g. of a type we do not support;
    `extra` adds `{arch}.{key}` metadata, uint32 for an int and float32 for a float (e.g. Gemma 2's
    soft-caps)."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(block_count)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(eps)
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    for key, value in (extra or {}).items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(f"{arch}.{key}", value)
    if tokenizer == "gpt2":
        w.add_tokenizer_model("gpt2")
        w.add_token_list(byte_vocab())
        w.add_token_types([1] * 256 + [3, 3])
        w.add_token_merges([])
        w.add_bos_token_id(256)
        w.add_eos_token_id(257)
    elif tokenizer == "llama":  # sentencepiece: byte fallback tokens, a few pieces with scores
        tokens = SENTENCEPIECE_VOCAB
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259))
        w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    for name, a in tensors.items():
        qtype = gguf.GGMLQuantizationType((qtypes or {}).get(name, gguf.GGMLQuantizationType.F32))
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a.astype(np.float32))
        else:
            q = kquants.quantize(a.astype(np.float32), qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    for name, (data, ggml_type) in (raw or {}).items():
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(ggml_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------------------------- embedding models
def embedding_reference(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' final hidden states (after the last norm) of one prompt: [tokens, hidden]."""
    base = getattr(model, "model", model)  # a *ForCausalLM's decoder, or a bare *Model
    with torch.no_grad():
        return base(torch.tensor([token_ids])).last_hidden_state[0].float()


def save_sentence_transformer_dir(model, tokenizer, directory: str, pooling: str = "mean",
                                  normalize: bool = True, matryoshka_dimensions: list[int] | None = None) -> str:
    """A bare decoder (`*Model`, no LM head, weights without the `model.` prefix) saved as a
    sentence-transformers model is: modules.json, 1_Pooling/config.json, optionally Normalize."""
    import json

    save_hf_dir(model, tokenizer, directory)
    if matryoshka_dimensions is not None:
        path = os.path.join(directory, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg["matryoshka_dimensions"] = matryoshka_dimensions
        with open(path, "w") as f:
            json.dump(cfg, f)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(directory, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(directory, "1_Pooling"), exist_ok=True)
    modes = {"pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean",
             "pooling_mode_lasttoken": pooling == "lasttoken", "pooling_mode_max_tokens": False}
    with open(os.path.join(directory, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": model.config.hidden_size, **modes}, f)
    return directory


def gguf_writer(path: str, arch, c):
    """A gguf.GGUFWriter for architecture `arch` (a gguf.MODEL_ARCH) with the body keys every
    family writes, from the transformers config `c`: layers, context, widths, heads."""
    import gguf

    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    return w


def three_prompts(tokenizer) -> list[list[int]]:
    """The parity tests' 3 prompts (5, 17 and 40 random token ids, seeded)."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, len(tokenizer), (n,), generator=g).tolist() for n in (5, 17, 40)]


def hf_greedy(ref, prompts: Sequence[Sequence[int]], n_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, exactly n_tokens long."""
    expected = []
    with torch.inference_mode():
        for p in prompts:
            out = ref.generate(torch.tensor([list(p)]), max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                               do_sample=False, pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    return expected


def gguf_add_byte_tokenizer(w, tokenizer) -> None:
    """byte_tokenizer()'s vocabulary as a GGUF's gpt2 tokenizer (ids 0-2 control, BOS 1, EOS 2)."""
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
    w.add_token_types([3, 3, 3] + [1] * (len(tokenizer) - 3))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
