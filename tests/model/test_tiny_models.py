"""Tiny random-weight Llama (llama3 rope scaling), Qwen2 (qkv bias, tied embeddings) and Qwen3
(q/k norm, head_dim != hidden/heads) built from transformers configs, saved as HF directories
(one sharded) and as GGUF files (llama.cpp names and q/k permutation, some tensors quantized),
loaded through our loader: logits match transformers'."""
from __future__ import annotations

import json
import os

import gguf
import pytest

import torch
from model_helpers import (byte_vocab, gguf_tensors_from_hf, hf_last_logits, run_flat_batch, save_hf_dir,
                           tiny_hf_model, write_gguf)

from tokenloom.model.loader import load_model, load_model_config
from tokenloom.ops.elementwise import torch_ops_only

# float32 on both sides with 2 layers: measured max |diff| ~2e-6.
ATOL = 1e-4

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
CASES = {
    "llama3": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3": ("qwen3", dict(head_dim=32)),
}


def _prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in (1, 5, 17, 40, 150, 300)]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from tokenloom.model.loader import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_directory_matches_transformers(case, tokenizer, tmp_path):
    kind, overrides = CASES[case]
    ref = tiny_hf_model(kind, vocab_size=len(tokenizer), seed=hash(case) % 1000, **overrides)
    shard = "2MB" if case == "llama3" else None  # ~13 MB of weights -> several shards + index
    directory = save_hf_dir(ref, tokenizer, str(tmp_path / case), max_shard_size=shard,
                            generation_eos=[2, 5] if case == "llama3" else None)
    if shard:
        assert os.path.isfile(os.path.join(directory, "model.safetensors.index.json"))
        assert len([f for f in os.listdir(directory) if f.endswith(".safetensors")]) > 1

    loaded = load_model(directory, dtype="float32")
    cfg = loaded.config
    assert cfg.architecture == kind
    assert cfg.attention_bias == (kind == "qwen2") and cfg.qk_norm == (kind == "qwen3")
    assert cfg.head_dim == (getattr(ref.config, "head_dim", None) or 64 // 4)
    assert cfg.tie_word_embeddings == ref.config.tie_word_embeddings
    if case == "llama3":
        assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_theta == 500000.0
        assert cfg.eos_token_ids == [2, 5]
    assert load_model_config(directory) == cfg
    assert loaded.tokenizer("héllo 😀").input_ids == tokenizer("héllo 😀").input_ids
    assert loaded.tokenizer.chat_template == tokenizer.chat_template

    prompts = _prompts(cfg.vocab_size)
    expected = hf_last_logits(ref, prompts)
    with torch_ops_only():
        got = run_flat_batch(loaded, prompts, chunk_sizes=[1, 2, 5, 13, 64, 128], scatter=True)
    print(f"{case} HF dir: max abs logits diff {(got - expected).abs().max().item():.3g}")
    assert (got - expected).abs().max().item() <= ATOL
    assert torch.equal(got.argmax(-1), expected.argmax(-1))

    # The CPU model runner's fast path on the same model: packed weights and the C kernels (the
    # qk-norm of Qwen3, head_dim 32 and Qwen2's q/k/v bias go through them too).
    from tokenloom.model.packed_linear import pack_linear_weights

    pack_linear_weights(loaded.model)
    fast = run_flat_batch(loaded, prompts, chunk_sizes=[1, 2, 5, 13, 64, 128], scatter=True)
    print(f"{case} HF dir, CPU fast path: max abs logits diff "
          f"{(fast - expected).abs().max().item():.3g}")
    assert (fast - expected).abs().max().item() <= ATOL
    assert torch.equal(fast.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_file_matches_transformers(case, tmp_path):
    """The same kind of model written as llama.cpp would (names, Llama's q/k row permutation,
    llama3 rope scaling as a `rope_freqs` tensor), with the big matrices in Q8_0 / F16: we
    dequantize, un-permute and match transformers run on the dequantized weights."""
    kind, overrides = CASES[case]
    vocab = byte_vocab()
    ref = tiny_hf_model(kind, vocab_size=len(vocab), seed=7, **overrides)
    tensors = gguf_tensors_from_hf(ref, kind)
    if case == "llama3":
        # llama.cpp stores Llama 3.1 scaling as per-pair divisors of the base frequencies.
        from tokenloom.model.rope import inv_frequencies

        D, theta = ref.config.head_dim, LLAMA3_ROPE["rope_theta"]
        tensors["rope_freqs.weight"] = (inv_frequencies(D, theta, None) / inv_frequencies(D, theta, LLAMA3_ROPE)).numpy()
    Q = gguf.GGMLQuantizationType
    qtypes = {n: (Q.Q8_0 if i % 2 else Q.F16) for i, n in enumerate(tensors) if tensors[n].ndim == 2}
    c = ref.config
    path = write_gguf(str(tmp_path / f"{case}.gguf"), kind, tensors, block_count=c.num_hidden_layers,
                      hidden=c.hidden_size, ffn=c.intermediate_size, heads=c.num_attention_heads,
                      kv_heads=c.num_key_value_heads, context=c.max_position_embeddings,
                      head_dim=getattr(c, "head_dim", None), qtypes=qtypes, rope_theta=c.rope_parameters["rope_theta"],
                      eps=c.rms_norm_eps)
    # The float path (dequantized, as transformers loads a GGUF); the quantized kernels' own
    # tests are in test_quantized_models.
    loaded = load_model(path, dtype="float32", quantization=None)
    assert loaded.config.architecture == kind and loaded.config.vocab_size == len(vocab)
    if case == "llama3":
        assert loaded.config.rope_scaling["rope_type"] == "freq_factors"
    assert loaded.config.eos_token_ids == [257]

    # The reference gets the weights as the file holds them (quantization included).
    from tokenloom.model.gguf_file import read_gguf

    g = read_gguf(path)
    with torch.no_grad():
        sd = ref.state_dict()
        for name, t in tensors.items():
            if name == "rope_freqs.weight":
                continue
            info = g.tensors[name]
            dq = torch.tensor(gguf.quants.dequantize(g.raw(info), Q(info.ggml_type))).float()
            assert dq.shape == t.shape
            t_back = torch.from_numpy(t).float()
            assert (dq - t_back).abs().max() < 0.02  # Q8_0 / F16 of ~N(0, 0.08)
        for hf_name, p in sd.items():
            gname = next(n for n in tensors if _same(n, hf_name, c.tie_word_embeddings))
            dq = torch.tensor(gguf.quants.dequantize(g.raw(g.tensors[gname]), Q(g.tensors[gname].ggml_type)))
            if kind == "llama" and ("q_proj.weight" in hf_name or "k_proj.weight" in hf_name):
                heads = c.num_attention_heads if "q_proj" in hf_name else c.num_key_value_heads
                dq = _unpermute(dq, heads)
            p.copy_(dq.reshape(p.shape))
    prompts = _prompts(len(vocab))
    expected = hf_last_logits(ref, prompts)
    got = run_flat_batch(loaded, prompts, chunk_sizes=[1, 3, 8, 16, 100, 256])
    print(f"{case} GGUF: max abs logits diff {(got - expected).abs().max().item():.3g}")
    assert (got - expected).abs().max().item() <= ATOL
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def _same(gguf_name: str, hf_name: str, tied: bool) -> bool:
    from tokenloom.model.gguf_loader import gguf_to_hf_name

    if tied and hf_name == "lm_head.weight" and gguf_name == "token_embd.weight":
        return True
    return gguf_to_hf_name(gguf_name) == hf_name


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def test_bfloat16_close_to_float32(tokenizer, tmp_path):
    ref = tiny_hf_model("qwen3", vocab_size=len(tokenizer), seed=11, head_dim=32)
    directory = save_hf_dir(ref, tokenizer, str(tmp_path / "bf16"))
    prompts = _prompts(len(tokenizer))[:4]
    fp32 = run_flat_batch(load_model(directory, dtype="float32"), prompts)
    bf16_model = load_model(directory, dtype="bfloat16")
    assert bf16_model.dtype == torch.bfloat16 and bf16_model.model.cos_sin.dtype == torch.float32
    bf16 = run_flat_batch(bf16_model, prompts)
    assert bf16.dtype == torch.float32
    assert (bf16 - fp32).abs().max().item() < 0.05 * fp32.abs().max().item()


def test_chat_template_jinja_file(tokenizer, tmp_path):
    """transformers 5 saves the template as chat_template.jinja; older dirs keep it in
    tokenizer_config.json. Either way the loaded tokenizer has it."""
    ref = tiny_hf_model("llama", vocab_size=len(tokenizer), seed=3)
    directory = save_hf_dir(ref, tokenizer, str(tmp_path / "jinja"))
    jinja = os.path.join(directory, "chat_template.jinja")
    cfg_path = os.path.join(directory, "tokenizer_config.json")
    with open(cfg_path) as f:
        tok_cfg = json.load(f)
    if not os.path.isfile(jinja):  # older layout: move it out into the file
        with open(jinja, "w") as f:
            f.write(tok_cfg.pop("chat_template"))
        with open(cfg_path, "w") as f:
            json.dump(tok_cfg, f)
    from tokenloom.model.loader import load_tokenizer

    assert load_tokenizer(directory).chat_template == tokenizer.chat_template
