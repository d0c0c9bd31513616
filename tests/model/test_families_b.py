"""Gemma 1, Gemma 2, Phi-3, Phi-4-mini (LongRoPE, partial rotary), GLM-4 and Command-R, each a tiny
random-weight model that transformers builds from its own config class and saves as an HF
directory (with the SmolLM2 tokenizer): greedy tokens through `LLM(dir, dtype="float32")` are
transformers' own, 3 prompts x 32 tokens, and the last-position logits of chunked prefills and
decodes through the paged cache match transformers'."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from model_helpers import byte_vocab, hf_last_logits, randomize_, run_flat_batch, save_hf_dir, write_gguf

from tokenloom.attention.torch_backend import TorchAttentionBackend
from tokenloom.model.loader import load_model, load_model_config
from tokenloom.ops.elementwise import torch_ops_only

# float32 on both sides, a few layers: measured max |diff| ~1e-6.
ATOL = 1e-4
NEW_TOKENS = 32
WINDOW = 8  # the sliding window of the Gemma 2 and Phi-3 cases: every prompt reaches past it

_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# case -> (transformers class prefix, our architecture name, config overrides).
CASES = {
    "gemma": ("Gemma", "gemma", dict(head_dim=16)),
    # Attention scores are capped hard enough that capping changes the tokens.
    "gemma2": ("Gemma2", "gemma2", dict(head_dim=16, num_hidden_layers=4, sliding_window=WINDOW,
                                        query_pre_attn_scalar=24, attn_logit_softcapping=1.0,
                                        final_logit_softcapping=20.0)),
    "phi3": ("Phi3", "phi3", dict(sliding_window=WINDOW)),
    # Phi-4-mini's shape: LongRoPE (the long factors: the context reaches past the original 16
    # positions) on three quarters of each head, and a tied LM head.
    "phi4": ("Phi3", "phi3", dict(original_max_position_embeddings=16, tie_word_embeddings=True,
                                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.75,
                                                   "original_max_position_embeddings": 16,
                                                   "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0],
                                                   "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]})),
    "glm4": ("Glm4", "glm4", dict(head_dim=16)),
    "cohere": ("Cohere", "cohere", dict(logit_scale=0.25)),
}


def tiny_model(case: str, vocab_size: int, seed: int = 0, **extra):
    import transformers

    prefix, _, overrides = CASES[case]
    config = getattr(transformers, f"{prefix}Config")(vocab_size=vocab_size, **(_COMMON | overrides | extra))
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).to(torch.float32).eval()
    randomize_(model, seed)
    if prefix.startswith("Gemma"):
        with torch.no_grad():  # Gemma's norms scale by 1 + w: weights around 0, not 1
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.sub_(1.0)
    return model


def _hf_greedy(ref, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens, EOS a token like any other (as ignore_eos makes it ours):
    min_new_tokens would mask it instead."""
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in (17, 24, 41)]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from tokenloom.model.loader import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, tokenizer, tmp_path_factory):
    case = request.param
    ref = tiny_model(case, len(tokenizer), seed=sorted(CASES).index(case))
    return case, ref, save_hf_dir(ref, tokenizer, str(tmp_path_factory.mktemp(case)))


def test_config_is_read_as_the_family(family):
    case, ref, directory = family
    cfg = load_model_config(directory)
    assert cfg.architecture == CASES[case][1]
    if case == "gemma2":
        assert cfg.layer_types == tuple(ref.config.layer_types) and cfg.sliding_window == WINDOW
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (1.0, 20.0)
    if case == "phi4":
        assert cfg.rope_scaling["rope_type"] == "longrope" and cfg.rotary_dim == 12
    if case == "glm4":
        assert cfg.attention_bias and not cfg.o_proj_bias and cfg.rotary_dim == 8
    if case == "cohere":
        assert cfg.logits_scaling == 4.0 and cfg.tie_word_embeddings


def test_logits_match_transformers_through_the_paged_cache(family):
    """Prefill in chunks, then decodes that read the context back from scattered blocks, on the
    torch ops and on the C kernels where a family's layers reach them."""
    case, ref, directory = family
    loaded = load_model(directory, dtype="float32")
    prompts = _prompts(loaded.config.vocab_size)
    expected = hf_last_logits(ref, prompts)
    with torch_ops_only():
        got = run_flat_batch(loaded, prompts, chunk_sizes=[1, 5, 16], scatter=True,
                             backend=TorchAttentionBackend(prefill_mode="padded"))
    fast = run_flat_batch(loaded, prompts, chunk_sizes=[3, 7, 41])
    for name, out in (("torch ops", got), ("kernels", fast)):
        err = (out - expected).abs().max().item()
        print(f"{case} {name}: max abs logits diff {err:.3g}")
        assert err <= ATOL, (name, err)


def test_engine_greedy_matches_transformers(family):
    from tokenloom import LLM, SamplingParams

    case, ref, directory = family
    prompts = _prompts(ref.config.vocab_size)
    with torch.inference_mode():
        expected = [_hf_greedy(ref, p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(directory, dtype="float32", multiprocess=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_unsupported_variants_are_clear_errors(tmp_path, tokenizer):
    """What a family's model class cannot run is refused when the config is read, naming the key."""
    import json

    from tokenloom.model.errors import ModelLoadError

    ref = tiny_model("cohere", len(tokenizer))
    directory = save_hf_dir(ref, tokenizer, str(tmp_path / "cohere"))
    path = tmp_path / "cohere" / "config.json"
    original = json.loads(path.read_text())
    for key, value, message in (("use_qk_norm", True, "use_qk_norm=True is not supported for CohereForCausalLM"),
                                ("hidden_act", "gelu", "unsupported hidden activation 'gelu'"),
                                ("logit_scale", 0.0, "logit_scale must be positive")):
        path.write_text(json.dumps(original | {key: value}))
        with pytest.raises(ModelLoadError, match=message):
            load_model_config(directory)
    path.write_text(json.dumps(original | {"architectures": ["GemmaForCausalLM"], "hidden_act": "gelu_pytorch_tanh",
                                           "tie_word_embeddings": False}))
    with pytest.raises(ModelLoadError, match="tie_word_embeddings=false is not supported for GemmaForCausalLM"):
        load_model_config(directory)


def test_lora_and_triton_refused_where_they_would_be_wrong(family):
    """Command-R's and GLM-4's q/k rows are reordered at load (an adapter's would not be) and
    Phi-3's adapters name fused projections: enable_lora is refused before any worker starts.
    Gemma 2's score capping is the torch backend's alone: 'auto' picks it, 'triton' is refused."""
    from tokenloom import LLM
    from tokenloom.attention.selector import get_attn_backend

    case, _, directory = family
    if case in ("cohere", "glm4", "phi3", "phi4"):
        with pytest.raises(ValueError, match=r"enable_lora=True: \w+ \(\w+\) does not take LoRA adapters"):
            LLM(directory, dtype="float32", enable_lora=True, multiprocess=False)
    if case == "gemma2":
        assert get_attn_backend("auto", "cuda", softcap=True).name == "torch"
        with pytest.raises(ValueError, match="'triton' cannot cap attention scores"):
            get_attn_backend("triton", "cuda", softcap=True)


# ----------------------------------------------------------------------------------- GGUF
# llama.cpp's names for Gemma, Gemma 2, Phi-3, GLM-4 and Command-R (conversion/gemma.py, phi.py,
# glm.py and command_r.py of the converter that the llama-cpp-python 0.3.36 source distribution
# carries): Llama's, Gemma 2 with Gemma 3's four norms, GLM-4 with its own two more, Phi-3's and
# GLM-4's fused tensors, Command-R with its one LayerNorm; Gemma's norm weights stored as 1 + w;
# no LM head where tied; no q/k permutation (Command-R's and GLM-4's adjacent-pair RoPE is
# llama.cpp's own); Phi-3's LongRoPE factors as tensors. Checked once against files that
# converter wrote from these tiny models (its vocabulary step swapped for the byte-level one):
# the same tensor names and data, and the same architecture keys; and its files load and match
# transformers.
_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
GGUF_NAMES = {
    "cohere": dict(_GGUF_NAMES),
    "glm4": _GGUF_NAMES | {"post_self_attn_layernorm.weight": "post_attention_norm.weight",
                           "post_attention_layernorm.weight": "ffn_norm.weight",
                           "post_mlp_layernorm.weight": "post_ffw_norm.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",
                           "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                           "self_attn.v_proj.bias": "attn_v.bias"},
    "phi3": {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.qkv_proj.weight": "attn_qkv.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"},
    "gemma": _GGUF_NAMES | {"post_attention_layernorm.weight": "ffn_norm.weight"},
    "gemma2": _GGUF_NAMES | {"post_attention_layernorm.weight": "post_attention_norm.weight",
                             "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                             "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
}


def write_family_gguf(ref, case: str, path: str, qtypes: dict[str, int] | None = None) -> str:
    """`ref` written as llama.cpp's converter writes its architecture (float32, or as `qtypes`
    says per tensor)."""
    c = ref.config
    tensors = {}
    for name, t in ref.state_dict().items():
        a = t.detach().float().numpy()
        if name.endswith("norm.weight") and case.startswith("gemma"):
            a = a + 1.0
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = a
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = a
        elif name == "lm_head.weight":
            if not c.tie_word_embeddings:
                tensors["output.weight"] = a
        else:
            _, _, layer, rest = name.split(".", 3)
            tensors[f"blk.{layer}.{GGUF_NAMES[case.replace('phi4', 'phi3')][rest]}"] = a
    extra, eps = None, getattr(c, "rms_norm_eps", None)
    if case == "gemma2":
        extra = {"attn_logit_softcapping": c.attn_logit_softcapping, "final_logit_softcapping": c.final_logit_softcapping}
    if case == "cohere":
        extra, eps = {"logit_scale": c.logit_scale, "attention.layer_norm_epsilon": c.layer_norm_eps}, c.layer_norm_eps
    window = getattr(c, "sliding_window", None)
    if case == "glm4":
        extra = {"rope.dimension_count": c.head_dim // 2}
    if case.startswith("phi"):
        window = window or 0  # the converter's 0: no window (Phi-4)
        rope = c.rope_parameters
        extra = {"rope.dimension_count": int(c.hidden_size // c.num_attention_heads * rope.get("partial_rotary_factor", 1.0)),
                 "rope.scaling.original_context_length": c.original_max_position_embeddings}
        if rope.get("rope_type") == "longrope":  # as the converter computes it, and the factors as tensors
            scale = c.max_position_embeddings / c.original_max_position_embeddings
            extra["rope.scaling.attn_factor"] = math.sqrt(1 + math.log(scale) / math.log(c.original_max_position_embeddings))
            tensors |= {"rope_factors_long.weight": np.array(rope["long_factor"], np.float32),
                        "rope_factors_short.weight": np.array(rope["short_factor"], np.float32)}
    return write_gguf(path, {"cohere": "command-r", "phi4": "phi3"}.get(case, case), tensors, qtypes=qtypes, block_count=c.num_hidden_layers, hidden=c.hidden_size,
                      ffn=c.intermediate_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                      context=c.max_position_embeddings, head_dim=getattr(c, "head_dim", None), eps=eps,
                      rope_theta=c.rope_parameters["rope_theta"], sliding_window=window,
                      extra=extra)


@pytest.mark.parametrize("case", sorted(GGUF_NAMES) + ["phi4"])
def test_gguf_matches_transformers(case, tmp_path):
    """The GGUF (float32, the byte-level vocabulary) gives transformers' logits through the paged
    cache and its greedy tokens through the engine. Gemma 2's GGUF carries no
    query_pre_attn_scalar: llama.cpp's rule (head_dim) is the config's here."""
    from tokenloom import LLM, SamplingParams

    overrides = {"query_pre_attn_scalar": 16} if case == "gemma2" else {}
    ref = tiny_model(case, len(byte_vocab()), seed=9, **overrides)
    path = write_family_gguf(ref, case, str(tmp_path / f"{case}.gguf"))
    cfg = load_model_config(path)
    assert cfg.architecture == CASES[case][1] and cfg.tie_word_embeddings == ref.config.tie_word_embeddings
    if case == "gemma2":
        assert cfg.layer_types == tuple(ref.config.layer_types) and cfg.sliding_window == WINDOW
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.query_pre_attn_scalar) == (1.0, 20.0, 16)
    loaded = load_model(path, dtype="float32")
    prompts = _prompts(cfg.vocab_size)
    got = run_flat_batch(loaded, prompts, chunk_sizes=[1, 5, 16], scatter=True)
    assert (got - hf_last_logits(ref, prompts)).abs().max().item() <= ATOL
    with torch.inference_mode():
        expected = [_hf_greedy(ref, p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # A GGUF's KV cache defaults to bfloat16 where the CPU has it; the reference is float32.
    with LLM(path, dtype="float32", kv_cache_dtype="float32", multiprocess=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("case, quantized_tensors", [("cohere", ("attn_q", "attn_k")),
                                                     ("phi3", ("attn_qkv", "ffn_up")),
                                                     ("glm4", ("attn_q", "attn_k", "ffn_up"))])
def test_quantized_gguf_follows_its_float_path(case, quantized_tensors, tmp_path):
    """Command-R's and GLM-4's q/k rows are reordered for our RoPE, and Phi-3's q/k/v and GLM-4's
    gate/up come fused: on the quantized path too, where the file's Q8_0 blocks are computed as they are (the
    reorder moves whole rows). Logits follow the dequantized float path of the same file
    (activations are quantized to 8 bits there)."""
    import gguf

    ref = tiny_model(case, len(byte_vocab()), seed=9)
    names = [f"blk.{i}.{t}.weight" for i in range(ref.config.num_hidden_layers) for t in quantized_tensors]
    path = write_family_gguf(ref, case, str(tmp_path / "q8.gguf"),
                             qtypes={n: gguf.GGMLQuantizationType.Q8_0 for n in names})
    prompts = _prompts(len(byte_vocab()))
    quantized = load_model(path, dtype="float32")
    assert quantized.quantization.startswith("gguf")
    got = run_flat_batch(quantized, prompts, chunk_sizes=[1, 5, 16])
    want = run_flat_batch(load_model(path, dtype="float32", quantization=None), prompts, chunk_sizes=[1, 5, 16])
    err = ((got - want).abs().max() / want.abs().max()).item()
    print(f"{case} Q8_0 {quantized_tensors}: max logits diff {err:.3g} of the largest logit")
    assert err < 0.02
    assert torch.equal(got.argmax(-1), want.argmax(-1))
