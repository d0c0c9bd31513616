"""benchmarks/gguf_shapes.py writes GGUF files that load as the shape they name: a tiny shape of
each architecture (llama with an untied head and Llama 3's rope factors; qwen2 with a tied head
and q/k/v biases) through the script's own writer, read back by tokenloom's loader."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gguf_shapes.py"


@pytest.fixture(scope="module")
def gguf_shapes():
    spec = importlib.util.spec_from_file_location("gguf_shapes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gguf_shapes"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gguf_shapes"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_shape_loads_as_written(gguf_shapes, smollm2_path, tmp_path, arch):
    from tokenloom.model.loader import load_model, load_tokenizer

    qwen = arch == "qwen2"
    shape = gguf_shapes.Shape(arch, 64, 2, 4, 2, 128, 1e6 if qwen else 500000.0, 1e-6, tied=qwen, context=4096,
                              rope_factor=None if qwen else 8.0)
    path = str(tmp_path / f"{arch}.gguf")
    gguf_shapes.write_f16(arch, shape, path, smollm2_path, seed=0)
    loaded = load_model(path, dtype="float32", quantization=None)
    c = loaded.config
    assert (c.architecture, c.hidden_size, c.num_hidden_layers, c.intermediate_size) == (arch, 64, 2, 128)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (4, 2, 16, 49152)
    assert c.tie_word_embeddings == qwen and c.attention_bias == qwen
    assert (c.rope_scaling is None) == qwen  # Llama 3's factors come from rope_freqs.weight
    assert c.rope_theta == shape.rope_theta and c.max_position_embeddings == 4096
    # The embedded model's vocabulary, so its tokenizer reads the file.
    assert load_tokenizer(path).encode("Hello world") == load_tokenizer(None).encode("Hello world")
    if not qwen:
        assert c.rope_scaling["freq_factors"] == pytest.approx(_transformers_llama3_factors(shape), rel=1e-5)


def _transformers_llama3_factors(shape) -> list[float]:
    """The divisors transformers' own llama3 rope init applies to each frequency (the reference)."""
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=shape.hidden, num_attention_heads=shape.heads, rope_theta=shape.rope_theta,
                         max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": shape.rope_factor, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    d = shape.head_dim
    base = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    return (base / inv_freq.double()).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_config_of_a_shape_builds_with_dummy_weights(gguf_shapes, smollm2_path, tmp_path, arch):
    """`--hf-config` writes the shape's config and tokenizer, no weights; load_format="dummy" builds
    the model of that shape from it, the same one that the GGUF of the shape describes."""
    from tokenloom.model.loader import load_model

    qwen = arch == "qwen2"
    shape = gguf_shapes.Shape(arch, 64, 2, 4, 2, 128, 1e6 if qwen else 500000.0, 1e-6, tied=qwen, context=4096,
                              rope_factor=None if qwen else 8.0)
    directory = gguf_shapes.write_hf_config(arch, shape, str(tmp_path), smollm2_path)
    assert not [f for f in Path(directory).iterdir() if f.suffix in (".safetensors", ".bin", ".gguf")]
    c = load_model(directory, dtype="float32", quantization=None, load_format="dummy").config
    assert (c.architecture, c.hidden_size, c.num_hidden_layers, c.intermediate_size) == (arch, 64, 2, 128)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (4, 2, 16, 49152)
    assert c.tie_word_embeddings == qwen and c.attention_bias == qwen
    assert (c.rope_scaling is None) == qwen
