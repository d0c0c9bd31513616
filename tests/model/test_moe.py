"""Mixture-of-experts families (model/moe.py, ops/moe.py): Qwen3-MoE, Qwen2-MoE (a shared expert)
and Mixtral, each a tiny random transformers model saved as an HF directory and written as a GGUF
under llama.cpp's names (`qwen3moe`, `qwen2moe`, and `llama` with expert tensors for Mixtral:
the experts stacked [E, ...] as convert_hf_to_gguf.py stacks them, names from gguf's own
`get_tensor_name_map`). Greedy tokens must be transformers' own (float32), 3 prompts x 32 tokens;
with the experts quantized (Q8_0, Q4_0 by gguf's quantizer) against transformers on the
dequantized weights. The routing and grouping are checked against a plain loop over tokens."""
from __future__ import annotations

import pytest
import torch
from model_helpers import (byte_tokenizer, gguf_add_byte_tokenizer, gguf_writer, hf_greedy,
                           llama_cpp_permute, randomize_, save_hf_dir, three_prompts)
from test_families import COMMON, N_TOKENS, _greedy

from tokenloom.model.hf_config import hf_model_config
from tokenloom.model.loader import load_model_config
from tokenloom.ops.moe import fused_experts, group_by_expert, select_experts

# case -> (transformers class prefix, config overrides, what our config must say)
CASES = {
    # A dense layer among the sparse ones (mlp_only_layers), renormalised top-k.
    "qwen3_moe": ("Qwen3Moe", dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                   moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                       mlp_only_layers=(1,), qk_norm=True)),
    # Weights not renormalised; a shared expert gated by a sigmoid.
    "qwen2_moe": ("Qwen2Moe", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=64, norm_topk_prob=False),
                  dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
                       shared_expert_intermediate_size=64, attention_bias=True)),
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
                dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)),
}
# Logit gap under which the quantized path may pick the other of two tokens (its activation
# rounding moves these tiny models' logits by a few 1e-3 at most).
NEAR_TIE = 0.01
GGUF_ARCHES = {"qwen3_moe": "QWEN3MOE", "qwen2_moe": "QWEN2MOE", "mixtral": "LLAMA"}


# ----------------------------------------------------------------------------- routing
def _naive_moe(x, logits, k, renormalize, experts):
    """Token by token, expert by expert: what fused_experts must equal."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].float(), -1)
        w, ids = torch.topk(probs, k)
        if renormalize:
            w = w / w.sum()
        for weight, e in zip(w.tolist(), ids.tolist()):
            out[t] += weight * experts[e](x[t:t + 1])[0]
    return out


@pytest.mark.parametrize("T", [1, 2, 37])
@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_experts_equal_a_loop_over_tokens(T, renormalize):
    g = torch.Generator().manual_seed(T)
    E, k, H = 6, 3, 8
    mats = torch.randn(E, H, H, generator=g)
    experts = [lambda rows, m=mats[e]: torch.tanh(rows @ m) for e in range(E)]
    x, logits = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
    weights, ids = select_experts(logits, k, renormalize=renormalize)
    calls: list[tuple[int, int]] = []

    def expert_fn(e, rows):
        calls.append((e, rows.shape[0]))
        return experts[e](rows)

    got = fused_experts(x, weights, ids, expert_fn)
    torch.testing.assert_close(got, _naive_moe(x, logits, k, renormalize, experts), rtol=1e-5, atol=1e-5)
    # each chosen expert runs once, over exactly the tokens that chose it, in expert order
    hit = torch.bincount(ids.reshape(-1), minlength=E)
    assert calls == [(e, int(hit[e])) for e in range(E) if hit[e]]


def test_grouping_sorts_pairs_by_expert():
    groups = group_by_expert(torch.tensor([[3, 0], [0, 2]]))
    assert groups.experts == [0, 2, 3] and groups.offsets == [0, 2, 3, 4]
    assert groups.token_rows.tolist() == [0, 1, 1, 0]
    assert groups.pair_ids.tolist() == [1, 2, 3, 0]


def test_routing_scores():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = select_experts(logits, 2, "sigmoid", renormalize=False)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(w, torch.sigmoid(logits[:, :2]))
    w_soft, _ = select_experts(logits, 2, "softmax", renormalize=True)
    w_topk, ids_topk = select_experts(logits, 2, "topk_softmax")
    assert ids_topk.tolist() == [[0, 1]]
    torch.testing.assert_close(w_soft, w_topk)
    with pytest.raises(ValueError, match="top_k must be between 1 and the 4 experts"):
        select_experts(logits, 5)
    with pytest.raises(ValueError, match="scoring must be one of"):
        select_experts(logits, 2, "relu")


def test_quantized_layer_in_one_call_equals_the_per_expert_path():
    """Quantized experts (Q8_0 gate|up, Q4_0 down) at decode sizes: ops/quant_moe's one C call
    per layer gives the per-expert matmuls' sum (float rounding apart), experts chosen by several
    tokens included; a step whose expert has the plan's rows or more takes the per-expert path."""
    from tokenloom.model.moe import FusedMoE
    from tokenloom.model.quant_linear import QuantLinear
    from tokenloom.ops import quant

    torch.manual_seed(0)
    E, H, I, k = 6, 64, 32, 2
    moe = FusedMoE(E, k, H, I)
    codes = torch.randint(0, 16, (E, H, I), dtype=torch.uint8).numpy()
    moe.install_quantized([QuantLinear([quant.quantize_q8(torch.randn(2 * I, H) * 0.1)]) for _ in range(E)],
                          [QuantLinear([quant.tile_int4_groups(codes[e], torch.rand(H, 1).numpy() * 0.02)])
                           for e in range(E)])
    layer = moe.quant_layer
    assert layer is not None and (layer.fmt13, layer.fmt2) == (quant.FMT_Q8, quant.FMT_Q4_0)
    for T in (1, 5):
        x, logits = torch.randn(T, H), torch.randn(T, E)
        weights, ids = select_experts(logits, k)
        assert layer.takes(x, ids)
        torch.testing.assert_close(layer.forward(x, weights, ids),
                                   fused_experts(x, weights, ids, moe.expert_forward), rtol=1e-5, atol=1e-5)
    crowded = torch.zeros(layer.below, k, dtype=torch.int64)  # expert 0 chosen by every token
    assert not layer.takes(torch.randn(layer.below, H), crowded)


# ----------------------------------------------------------------------------- families
@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def _reference(case: str, tokenizer):
    import transformers

    prefix, overrides, _ = CASES[case]
    kwargs = COMMON | dict(vocab_size=len(tokenizer)) | overrides
    torch.manual_seed(0)
    ref = getattr(transformers, f"{prefix}ForCausalLM")(getattr(transformers, f"{prefix}Config")(**kwargs))
    ref = ref.to(torch.float32).eval()
    randomize_(ref, seed=sum(map(ord, case)))
    return ref


def _prompts(tokenizer) -> list[list[int]]:
    return three_prompts(tokenizer)


def _hf_greedy(ref, prompts) -> list[list[int]]:
    return hf_greedy(ref, prompts, N_TOKENS)


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, tokenizer, tmp_path_factory):
    """(case, directory, prompts, transformers' greedy tokens, the transformers model)."""
    ref = _reference(request.param, tokenizer)
    directory = save_hf_dir(ref, tokenizer, str(tmp_path_factory.mktemp(request.param)))
    prompts = _prompts(tokenizer)
    return request.param, directory, prompts, _hf_greedy(ref, prompts), ref


def _slow_but(case: str):
    """The first case runs in the fast tier, the others in the slow one."""
    return case if case == "qwen3_moe" else pytest.param(case, marks=pytest.mark.slow)


@pytest.mark.parametrize("family", [_slow_but(c) for c in sorted(CASES)], indirect=True)
def test_config_and_greedy_tokens_match_transformers(family):
    case, directory, prompts, expected, _ = family
    cfg = hf_model_config(directory)
    for field, value in CASES[case][2].items():
        assert getattr(cfg, field) == value, field
    assert _greedy(directory, prompts) == expected, case


def _write_gguf(ref, case: str, tokenizer, path: str, expert_type=None) -> str:
    """ref's weights as llama.cpp's converter writes them: experts stacked [E, ...] per layer
    (ffn_gate_exps / ffn_up_exps / ffn_down_exps), Mixtral's q/k rows permuted; with
    `expert_type` (a GGMLQuantizationType) the expert matrices quantized by gguf's quantizer."""
    import re
    import tempfile

    import gguf
    import numpy as np
    from safetensors.torch import load_file

    c = ref.config
    arch = getattr(gguf.MODEL_ARCH, GGUF_ARCHES[case])
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    # llama.cpp's qwen3moe has no dense layers (Qwen3-MoE's checkpoints have none): ours, under
    # Llama's names, test that a layer without a router loads as a dense MLP.
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    w = gguf_writer(path, arch, c)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    experts = c.num_local_experts if case == "mixtral" else c.num_experts
    w.add_expert_count(experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if case != "mixtral":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if case == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if case == "mixtral":  # LlamaModel's converter also writes these
        w.add_vocab_size(len(tokenizer))
        w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    gguf_add_byte_tokenizer(w, tokenizer)

    def add(name: str, a: np.ndarray, quantize: bool = False) -> None:
        if quantize and expert_type is not None:
            w.add_tensor(name, gguf.quants.quantize(a, expert_type), raw_dtype=expert_type)
        else:
            w.add_tensor(name, a)

    with tempfile.TemporaryDirectory() as d:  # the checkpoint's names: experts one by one
        ref.save_pretrained(d)
        state = load_file(f"{d}/model.safetensors")
    stacked: dict[str, dict[int, np.ndarray]] = {}
    for name, t in state.items():
        a = t.detach().float().numpy()
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name)
        if m:
            stacked.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = a
            continue
        if case == "mixtral" and ".q_proj." in name:
            a = llama_cpp_permute(a, c.num_attention_heads)
        elif case == "mixtral" and ".k_proj." in name:
            a = llama_cpp_permute(a, c.num_key_value_heads)
        gguf_name = (names.get_name(name, try_suffixes=(".weight", ".bias"))
                     or dense_names.get_name(name, try_suffixes=(".weight", ".bias")))
        add(gguf_name, a, quantize=".shared_expert." in name)
    for name, parts in stacked.items():
        add(names.get_name(name) + ".weight", np.stack([parts[e] for e in range(len(parts))]), quantize=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _dequantized_reference(ref, case: str, expert_type):
    """A copy of ref whose expert (and shared expert) matrices went through gguf's quantizer and
    back: what the GGUF holds, in transformers."""
    import copy

    import gguf

    q = copy.deepcopy(ref)
    with torch.no_grad():
        for name, p in q.named_parameters():
            if ".experts." in name or ".shared_expert." in name:
                a = p.detach().numpy()
                rows = a.reshape(-1, a.shape[-1])
                back = gguf.quants.dequantize(gguf.quants.quantize(rows, expert_type), expert_type)
                p.copy_(torch.from_numpy(back.reshape(a.shape)))
    return q


@pytest.mark.slow  # the fast tier reads GGUF experts in test_quantized_experts_...[qwen3_moe-Q8_0]
@pytest.mark.parametrize("family", sorted(CASES), indirect=True)
def test_gguf_greedy_tokens_match_transformers(family, tokenizer, tmp_path):
    """From a GGUF of the same weights (float32 tensors), on the float path."""
    case, _, prompts, expected, ref = family
    path = _write_gguf(ref, case, tokenizer, str(tmp_path / f"{case}.gguf"))
    cfg = load_model_config(path)
    assert cfg.architecture == case
    for field, value in CASES[case][2].items():
        if field != "mlp_only_layers":  # llama.cpp's files say it by the tensors present
            assert getattr(cfg, field) == value, field
    assert _greedy(path, prompts, quantization=None) == expected, case


@pytest.mark.parametrize("qtype", ["Q8_0", pytest.param("Q4_0", marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", [_slow_but(c) for c in sorted(CASES)], indirect=True)
def test_quantized_experts_match_transformers_on_dequantized_weights(family, tokenizer, tmp_path, qtype):
    """Experts quantized in the file, computed by the quantized kernels one expert at a time:
    transformers' greedy tokens on the dequantized weights, up to a near tie."""
    import gguf

    case, _, prompts, _, ref = family
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    path = _write_gguf(ref, case, tokenizer, str(tmp_path / f"{case}-{qtype}.gguf"), expert_type=qt)
    deq = _dequantized_reference(ref, case, qt)
    expected = _hf_greedy(deq, prompts)
    # K and V in float32: the quantized path keeps them in bfloat16 by default, whose rounding
    # moves a router's near tie (a choice of experts: a jump, not a drift) in these tiny models.
    got = _greedy(path, prompts, kv_cache_dtype="float32")
    for p, ours, theirs in zip(prompts, got, expected):
        n = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if n is None:
            continue
        # The kernels quantize the activations (two int8 planes per 32, ops/quant.ACT_LEVELS; or
        # bf16 tiles from 16 rows): a token may differ only where transformers' two candidates
        # are a near tie.
        with torch.inference_mode():
            logits = deq(torch.tensor([p + theirs[:n]])).logits[0, -1]
        margin = float(logits[theirs[n]] - logits[ours[n]])
        assert margin < NEAR_TIE, (case, qtype, n, margin)


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)
def test_int8_one_rank_and_fused_decode(family, monkeypatch):
    """quantization="int8" makes every expert Q8 (routers stay float), logits close to the float
    path; a step reads top_k experts per MoE layer; tensor parallelism is refused naming the
    option; the fused C decode step takes the quantized experts (not the float ones) and its
    greedy tokens are the eager layers'."""
    from model_helpers import run_flat_batch

    from tokenloom.model.loader import load_model
    from tokenloom.model.moe import FusedMoE
    from tokenloom.model.quant_linear import QuantLinear, weight_bytes_per_token
    from tokenloom.model.tensor_parallel import check_tensor_parallel

    _, directory, prompts, _, _ = family
    f = load_model(directory, dtype="float32")
    q = load_model(directory, dtype="float32", quantization="int8")
    moe = [m for m in q.model.modules() if isinstance(m, FusedMoE)]
    assert len(moe) == 2 and all(m.w13_weight is None and isinstance(m.quant_w13[0], QuantLinear) for m in moe)
    assert not isinstance(q.model.layers[0].mlp.gate, QuantLinear)
    lf, lq = run_flat_batch(f, prompts), run_flat_batch(q, prompts)
    assert (lf - lq).abs().max() < 0.05 * lf.abs().max()
    # a token reads 2 of the 8 experts of each MoE layer: 6/8 of their bytes fewer than all 8
    experts = sum(p.nbytes for x in moe for m in (*x.quant_w13, *x.quant_w2) for p in m.parts)
    two = weight_bytes_per_token(q.model)
    for x in moe:
        x.top_k = x.num_experts
    assert weight_bytes_per_token(q.model) - two == pytest.approx(experts * 6 / 8, abs=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=2: .* use tensor_parallel_size=1"):
        check_tensor_parallel(f.config, 2)
    from tokenloom.model.fused_decode import FusedDecode

    assert FusedDecode.build(f.model) is None and FusedDecode.build(q.model).moe_experts
    fused = _greedy(directory, prompts, quantization="int8")
    monkeypatch.setenv("TOKENLOOM_FUSED_DECODE", "0")
    assert fused == _greedy(directory, prompts, quantization="int8")
