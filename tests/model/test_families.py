"""The families that run on Llama's decoder with a difference (and OLMo 2's layer), and the RoPE
scalings and biases they bring: each a tiny random transformers model saved as an HF directory,
run through `LLM(dir, dtype="float32")`; greedy tokens must be transformers' own (float32), 3
prompts x 32 tokens. One module-scoped fixture per family: a few seconds each.

Where llama.cpp's converter writes the architecture (granite, olmo2, stablelm, smollm3; Mistral's
files are plain `llama`, covered by test_tiny_models), the same weights also go into a GGUF written
with the `gguf` package under llama.cpp's names: the tensor names from gguf's own
`get_tensor_name_map` (the table convert_hf_to_gguf.py uses), the keys and the q/k row permutation
as convert_hf_to_gguf.py writes them. These were checked once against files that the converter in
llama.cpp's sources (the llama-cpp-python 0.3.36 source distribution) wrote from these configs:
the same tensors byte for byte, its keys but the tokenizer's pre/padding/unknown with the same
values, and, loaded here, greedy tokens equal to transformers'."""
from __future__ import annotations

import pytest
import torch
from model_helpers import (byte_tokenizer, gguf_add_byte_tokenizer, gguf_writer, hf_greedy,
                           randomize_, save_hf_dir, three_prompts)

from tokenloom import LLM, SamplingParams
from tokenloom.model.errors import ModelLoadError
from tokenloom.model.hf_config import hf_model_config
from tokenloom.model.loader import load_model_config

N_TOKENS = 32
# rms_norm_eps exact in float32, which is what a GGUF stores.
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False, rms_norm_eps=2.0 ** -20)

# case -> (transformers class prefix, config overrides, what our config must say)
CASES = {
    "mistral_sliding": ("Mistral", dict(head_dim=16, sliding_window=8),
                        dict(sliding_window=8, layer_types=("sliding_attention",) * 2)),
    "qwen2_sliding": ("Qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
                      dict(sliding_window=8, layer_types=("full_attention", "sliding_attention"), attention_bias=True)),
    "granite": ("Granite", dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.25,
                                logits_scaling=4.0, attention_bias=True, mlp_bias=True),
                dict(embedding_multiplier=3.0, logits_scaling=4.0, o_proj_bias=True, mlp_bias=True)),
    "olmo2": ("Olmo2", dict(), dict(architecture="olmo2")),
    # Every fourth layer without RoPE, SmolLM3's default (and all a GGUF can say: llama.cpp fixes it).
    "smollm3": ("SmolLM3", dict(num_hidden_layers=4), dict(nope_layers=(3,))),
    "stablelm": ("StableLm", dict(partial_rotary_factor=0.25, use_qkv_bias=True, layer_norm_eps=2.0 ** -17),
                 dict(layer_norm=True, rotary_dim=4, attention_bias=True, o_proj_bias=False)),
    "llama_yarn": ("Llama", dict(max_position_embeddings=128, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}),
        dict(max_position_embeddings=128)),
    # Decoding runs past the original 48 positions, where dynamic NTK grows the base each token.
    "llama_dynamic": ("Llama", dict(max_position_embeddings=48, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), dict(max_position_embeddings=96)),
    "llama_biases": ("Llama", dict(attention_bias=True, mlp_bias=True),
                     dict(attention_bias=True, o_proj_bias=True, mlp_bias=True)),
}


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, tokenizer, tmp_path_factory):
    """(case, directory, prompts, transformers' greedy tokens, the transformers model)."""
    import transformers

    prefix, overrides, _ = CASES[request.param]
    kwargs = COMMON | dict(vocab_size=len(tokenizer)) | overrides
    torch.manual_seed(0)
    ref = getattr(transformers, f"{prefix}ForCausalLM")(getattr(transformers, f"{prefix}Config")(**kwargs))
    ref = ref.to(torch.float32).eval()
    randomize_(ref, seed=sum(map(ord, request.param)))
    directory = save_hf_dir(ref, tokenizer, str(tmp_path_factory.mktemp(request.param)))
    prompts = three_prompts(tokenizer)
    expected = hf_greedy(ref, prompts, N_TOKENS)
    return request.param, directory, prompts, expected, ref


def test_config_translation(family):
    case, directory, _, _, _ = family
    cfg = hf_model_config(directory)
    for field, value in CASES[case][2].items():
        assert getattr(cfg, field) == value, field


def _greedy(path: str, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
    with LLM(path, dtype="float32", multiprocess=False, num_kv_blocks=64, block_size=4,
             max_num_batched_tokens=32, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_tokens_match_transformers(family):
    case, directory, prompts, expected, _ = family
    assert _greedy(directory, prompts) == expected, case


# case -> gguf.MODEL_ARCH member. llama.cpp's LlamaModel converter (and Granite's and SmolLM3's,
# built on it) permutes q/k rows and biases for its interleaved RoPE; the others keep HF's order.
GGUF_ARCHES = {"granite": "GRANITE", "olmo2": "OLMO2", "stablelm": "STABLELM", "smollm3": "SMOLLM3"}
PERMUTED = {"granite", "smollm3"}


def _write_gguf(ref, case: str, tokenizer, path: str) -> str:
    import gguf
    from model_helpers import llama_cpp_permute

    c = ref.config
    arch = getattr(gguf.MODEL_ARCH, GGUF_ARCHES[case])
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    w = gguf_writer(path, arch, c)
    head_dim = c.hidden_size // c.num_attention_heads
    if case == "stablelm":  # its converter writes no rope base (10,000: the default) and LayerNorm's eps
        w.add_rope_dimension_count(int(head_dim * c.rope_parameters["partial_rotary_factor"]))
        w.add_parallel_residual(False)
        w.add_layer_norm_eps(c.layer_norm_eps)
    else:
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if case in PERMUTED:  # LlamaModel's converter also writes these
        w.add_vocab_size(len(tokenizer))
        w.add_rope_dimension_count(head_dim)
    if case == "granite":
        w.add_attention_scale(c.attention_multiplier)
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)
    gguf_add_byte_tokenizer(w, tokenizer)
    for name, t in ref.state_dict().items():
        a = t.detach().float().numpy()
        if case in PERMUTED and ".q_proj." in name:
            a = llama_cpp_permute(a, c.num_attention_heads)
        elif case in PERMUTED and ".k_proj." in name:
            a = llama_cpp_permute(a, c.num_key_value_heads)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("family", sorted(GGUF_ARCHES), indirect=True)
def test_gguf_greedy_tokens_match_transformers(family, tokenizer, tmp_path):
    """From a GGUF of the same weights, with the GGUF's tokenizer. quantization=None: the float
    path, as transformers loads a GGUF."""
    case, _, prompts, expected, ref = family
    path = _write_gguf(ref, case, tokenizer, str(tmp_path / f"{case}.gguf"))
    cfg = load_model_config(path)
    assert cfg.architecture == case
    for field, value in CASES[case][2].items():
        assert getattr(cfg, field) == value, field
    assert _greedy(path, prompts, quantization=None) == expected, case


@pytest.mark.parametrize("arch, extra, message", [
    ("StableLmForCausalLM", {"use_parallel_residual": True}, "use_parallel_residual=true is not supported"),
    ("StableLmForCausalLM", {"qk_layernorm": True}, "qk_layernorm=true is not supported"),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": -4}, "sliding_window must be a positive integer"),
    ("SmolLM3ForCausalLM", {"no_rope_layers": [1, 0, 1]}, "no_rope_layers has 3 entries for 2 layers"),
    ("LlamaForCausalLM", {"use_sliding_window": True, "sliding_window": 8}, "not supported for LlamaForCausalLM"),
])
def test_unsupported_settings_name_the_field(arch, extra, message, tmp_path):
    import json

    cfg = COMMON | {"architectures": [arch], "vocab_size": 259} | extra
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message):
        hf_model_config(str(tmp_path))
