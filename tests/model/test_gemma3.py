"""A tiny random-weight Gemma 3 (six layers, five with a sliding window of 8, one global; q/k
norms, GeGLU, embedding scale, four norms per layer, two RoPE bases, logit softcapping) built from
transformers' `Gemma3TextConfig`, saved as an HF directory and written as llama.cpp writes a
Gemma 3 GGUF (its names, norm weights stored as 1 + w, a sentencepiece vocabulary): logits match
transformers on prompts shorter and longer than the window, one-shot and chunked, on the torch
backend's paths and the C kernels; greedy tokens match through the engine with chunked prefill
and the prefix cache."""
from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from model_helpers import (GEMMA3_LAYERS as LAYERS, GEMMA3_WINDOW as WINDOW, SENTENCEPIECE_VOCAB, hf_last_logits,
                           run_flat_batch, save_hf_dir, tiny_gemma3, write_gguf)

from tokenloom.attention.torch_backend import TorchAttentionBackend
from tokenloom.kv_cache_spec import kv_cache_groups
from tokenloom.model.loader import load_model, load_model_config
from tokenloom.ops.elementwise import torch_ops_only

# float32 on both sides, six layers: measured max |diff| ~1e-6.
ATOL = 1e-4


def _prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    # Shorter than the window, exactly it, one past it, and several windows long.
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in (1, 5, 8, 9, 40, 150)]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from tokenloom.model.loader import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def hf_dir(tokenizer, tmp_path_factory):
    ref = tiny_gemma3(len(tokenizer), seed=5)
    return ref, save_hf_dir(ref, tokenizer, str(tmp_path_factory.mktemp("gemma3") / "hf"))


def test_config_groups_layers_by_attention_type(hf_dir):
    ref, directory = hf_dir
    cfg = load_model_config(directory)
    assert cfg.architecture == "gemma3" and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.sliding_window == WINDOW and cfg.layer_types == tuple(ref.config.layer_types)
    assert cfg.layer_types.count("full_attention") == 1  # layer 5 of 6
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert (cfg.query_pre_attn_scalar, cfg.final_logit_softcapping) == (24, 30.0)
    groups = kv_cache_groups(cfg)
    # Groups of equal layer count share the KV tensors (vLLM's hybrid allocator): one full layer
    # and five sliding ones make six groups of one layer.
    assert [(g.layer_ids, g.sliding_window) for g in groups] == [((5,), None)] + [((i,), WINDOW) for i in range(5)]


@pytest.mark.parametrize("prefill_mode", ["auto", "padded", "per_request"])
def test_hf_directory_matches_transformers(hf_dir, prefill_mode):
    ref, directory = hf_dir
    loaded = load_model(directory, dtype="float32")
    assert loaded.model.kv_cache_group_of_layer == [1, 2, 3, 4, 5, 0]
    prompts = _prompts(loaded.config.vocab_size)
    expected = hf_last_logits(ref, prompts)
    backend = TorchAttentionBackend(prefill_mode=prefill_mode)
    with torch_ops_only():
        got = run_flat_batch(loaded, prompts, backend=backend, scatter=True)
        # Chunks and decodes read their window back from the paged cache.
        chunked = run_flat_batch(loaded, prompts, chunk_sizes=[1, 2, 3, 7, 16, 33], backend=backend)
    for name, out in (("one-shot", got), ("chunked", chunked)):
        err = (out - expected).abs().max().item()
        print(f"gemma3 HF dir {prefill_mode} {name}: max abs logits diff {err:.3g}")
        assert err <= ATOL
        assert torch.equal(out.argmax(-1), expected.argmax(-1))
    if prefill_mode == "auto":
        # The CPU model runner's fast path: packed weights, the C element-wise and decode kernels.
        from tokenloom.model.packed_linear import pack_linear_weights

        pack_linear_weights(loaded.model)
        fast = run_flat_batch(loaded, prompts, chunk_sizes=[1, 1, 1, 1, 1, 5], scatter=True)
        assert (fast - expected).abs().max().item() <= ATOL


def test_without_the_window_logits_differ(hf_dir):
    """The window matters: the same model attending fully in every layer gives other logits on
    prompts longer than the window (and the same on shorter ones)."""
    ref, directory = hf_dir
    loaded = load_model(directory, dtype="float32")
    prompts = _prompts(loaded.config.vocab_size)
    windowed = run_flat_batch(loaded, prompts)
    loaded.config = dataclasses.replace(loaded.config, sliding_window=None)  # one group, no window
    loaded.model.kv_cache_group_of_layer = [0] * LAYERS
    full = run_flat_batch(loaded, prompts)
    diff = (windowed - full).abs().amax(-1)
    assert torch.all(diff[:3] < 1e-5) and torch.all(diff[4:] > 1e-3), diff


# ----------------------------------------------------------------------------------- GGUF
_GEMMA3_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gemma3_gguf_tensors(model) -> dict[str, np.ndarray]:
    """The state dict as llama.cpp's converter writes a Gemma 3: its names, no q/k permutation,
    every norm weight stored as 1 + w, the LM head tied (not written)."""
    out: dict[str, np.ndarray] = {}
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy()
        if name.endswith("norm.weight"):
            a = a + 1.0
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = a
        elif name == "model.norm.weight":
            out["output_norm.weight"] = a
        elif name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            out[f"blk.{layer}.{_GEMMA3_GGUF_NAMES[rest]}"] = a
    return out


def test_gguf_file_matches_transformers(tmp_path):
    """The file holds Q8_0 matrices and +1 norms under llama.cpp's names, and says nothing of the
    layer pattern (llama.cpp's default: one global layer in six), the local RoPE base (10,000) or
    the attention scale (head_dim): transformers on the dequantized weights agrees."""
    vocab = SENTENCEPIECE_VOCAB
    ref = tiny_gemma3(len(vocab), seed=9, query_pre_attn_scalar=16, final_logit_softcapping=None,
                      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    tensors = gemma3_gguf_tensors(ref)
    Q = gguf.GGMLQuantizationType
    qtypes = {n: Q.Q8_0 for n, a in tensors.items() if a.ndim == 2}
    c = ref.config
    path = write_gguf(str(tmp_path / "gemma3.gguf"), "gemma3", tensors, block_count=LAYERS,
                      hidden=c.hidden_size, ffn=c.intermediate_size, heads=c.num_attention_heads,
                      kv_heads=c.num_key_value_heads, context=c.max_position_embeddings, head_dim=16,
                      qtypes=qtypes, rope_theta=1e6, eps=c.rms_norm_eps, tokenizer="llama",
                      sliding_window=WINDOW)
    loaded = load_model(path, dtype="float32", quantization=None)
    cfg = loaded.config
    assert cfg.layer_types == tuple(ref.config.layer_types) and cfg.sliding_window == WINDOW
    assert (cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e4, 16)

    # The reference gets the weights as the file holds them: Q8_0 matrices, norms less the 1.
    from tokenloom.model.gguf_file import read_gguf

    g = read_gguf(path)
    by_gguf = {v: k for k, v in _GEMMA3_GGUF_NAMES.items()}
    with torch.no_grad():
        for gname, info in g.tensors.items():
            dq = torch.tensor(gguf.quants.dequantize(g.raw(info), Q(info.ggml_type))).float()
            if gname == "token_embd.weight":
                hf_name = "model.embed_tokens.weight"
            elif gname == "output_norm.weight":
                hf_name = "model.norm.weight"
            else:
                _, layer, rest = gname.split(".", 2)
                hf_name = f"model.layers.{layer}.{by_gguf[rest]}"
            if hf_name.endswith("norm.weight"):
                dq = dq - 1.0
            ref.get_parameter(hf_name).copy_(dq)
    prompts = _prompts(len(vocab))
    expected = hf_last_logits(ref, prompts)
    got = run_flat_batch(loaded, prompts, chunk_sizes=[1, 3, 4, 9, 16, 50])
    err = (got - expected).abs().max().item()
    print(f"gemma3 GGUF: max abs logits diff {err:.3g}")
    assert err <= ATOL
    assert torch.equal(got.argmax(-1), expected.argmax(-1))

    # The quantized path (the GGUF's Q8_0 computed as shipped) stays close, same argmax.
    quant = load_model(path, quantization="auto")
    assert quant.quantization.startswith("gguf Q8_0")
    assert torch.equal(run_flat_batch(quant, prompts).argmax(-1), expected.argmax(-1))


def test_gguf_tokenizer_matches_transformers(tmp_path):
    """Gemma's sentencepiece vocabulary built from the GGUF's metadata (merges recovered from
    the vocabulary) encodes and decodes as transformers' own conversion of the file does."""
    import os

    from transformers import AutoTokenizer

    from tokenloom.model.loader import load_tokenizer

    vocab = SENTENCEPIECE_VOCAB
    tensors = gemma3_gguf_tensors(tiny_gemma3(len(vocab), num_hidden_layers=1,
                                              layer_types=["full_attention"]))
    path = write_gguf(str(tmp_path / "tok.gguf"), "gemma3", tensors, block_count=1, hidden=64, ffn=96,
                      heads=4, kv_heads=2, head_dim=16, tokenizer="llama", sliding_window=WINDOW)
    ours = load_tokenizer(path)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
    for text in ["hello", " hello hello", "hell  o\n\tÿ 😀", "<s>hello</s>", ""]:
        assert ours(text).input_ids == ref(text).input_ids, text
        ids = ours(text).input_ids
        assert ours.decode(ids) == ref.decode(ids), text
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)


def test_gguf_tokenizer_merges_kept_in_the_disk_cache(tmp_path, monkeypatch):
    """The merges recovered from a Gemma vocabulary are written once to $TOKENLOOM_CACHE_DIR and
    read back by the next build: the same tokenizer. An entry that is damaged is rebuilt, and an
    unwritable cache only costs the time (the tokenizer is built all the same)."""
    from tokenloom.model.loader import load_tokenizer

    tensors = gemma3_gguf_tensors(tiny_gemma3(len(SENTENCEPIECE_VOCAB), num_hidden_layers=1,
                                              layer_types=["full_attention"]))
    path = write_gguf(str(tmp_path / "tok.gguf"), "gemma3", tensors, block_count=1, hidden=64, ffn=96,
                      heads=4, kv_heads=2, head_dim=16, tokenizer="llama", sliding_window=WINDOW)
    texts = ["hello", " hello hello", "hell  o\n\tÿ 😀", "<s>hello</s>"]

    def encoded() -> list[list[int]]:
        tok = load_tokenizer(path)
        return [tok(t).input_ids for t in texts]

    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    cold = encoded()
    [entry] = (tmp_path / "cache" / "tokenizers").glob("gemma-merges-*.npy")
    ids = np.load(entry)
    assert ids.dtype == np.int32 and ids.shape[1] == 2 and len(ids) >= 5
    assert encoded() == cold
    # The entry is what the next build uses: emptied (well-formed, no merges), every word falls
    # apart into characters.
    np.save(entry, ids[:0])
    assert encoded() != cold
    for damage in (b"", b"not an npy file", entry.read_bytes()[:100]):
        entry.write_bytes(damage)
        assert encoded() == cold
        assert np.array_equal(np.load(entry), ids)  # rebuilt and written back
    np.save(entry, np.full_like(ids, len(SENTENCEPIECE_VOCAB)))  # ids past the vocabulary
    assert encoded() == cold
    (tmp_path / "blocked").write_text("a file where the cache folder would be")
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "blocked"))
    assert encoded() == cold


# ----------------------------------------------------------------------------------- engine
def _hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def test_engine_greedy_matches_transformers_with_chunks_and_prefix_cache(hf_dir):
    """Through the engine: prompts past the window, prefilled in chunks of 16 with a prefix
    shared by two of them (the second hits the prefix cache), then decoded past more windows:
    greedy tokens are transformers' own."""
    from tokenloom import LLM, SamplingParams

    ref, directory = hf_dir
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, ref.config.vocab_size, (40,), generator=g).tolist()
    prompts = [shared + [5, 6, 7], shared + [9, 10], torch.randint(3, 1000, (21,), generator=g).tolist()]
    n = 24
    expected = [_hf_greedy(ref, p, n) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    with LLM(directory, dtype="float32", max_num_batched_tokens=16, block_size=4, num_kv_blocks=128,
             enable_prefix_caching=True, multiprocess=False) as llm:
        first = llm.generate([{"prompt_token_ids": prompts[0]}], params)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
    got = [o.outputs[0].token_ids for o in first + rest]
    assert got == expected
    assert rest[0].num_cached_tokens >= 36  # the shared 40-token prefix, in whole blocks of 4
