"""The kernel plan (ops/kernel_plan.py): for every ISA level the project knows, the plan built
from that CPU's flags is what the code documents; on this machine's own ISA, the plan matches
the functions the dispatch actually calls (csrc/quant_gemm.c's last-kernel probe, the C side's
own level and availability answers, spies on the Python dispatch)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tokenloom.ops import amx, cpu_features, cpu_kernels, kernel_plan, quant
from tokenloom.ops.kernel_plan import KernelEnv, build_kernel_plan, known_features

ZEN3, ZEN4, SPR = kernel_plan.KNOWN_CPUS
README = Path(kernel_plan.__file__).with_name("csrc") / "README.md"


def _plan(cpu: str, **env: object) -> kernel_plan.KernelPlan:
    return build_kernel_plan(known_features(cpu), KernelEnv(**env))


def test_avx2_zen3_plan():
    p = _plan(ZEN3)
    assert p.cpu_isa == "avx2" and p.quant_level == 1 and p.bf16_matmul == "F.linear"
    assert p.f32_panels and p.kernel("f32_matmul", "float32", 1).kernel == "tl_f32_panel_linear"
    assert p.kernel("f32_matmul", "float32", 4096).kernel == "tl_f32_panel_linear"
    assert p.kernel("quant_matmul", "Q4_K", 15).kernel == "tile2_TL_Q4_K"
    assert p.kernel("quant_matmul", "Q4_K", 16).kernel == "f32p_linear"
    assert p.quant_silu_rows == 0 and p.kernel("quant_gate_up_silu", "Q8_0", 64).kernel == "two passes"
    assert p.kernel("decode_step", "bfloat16", 1).kernel == "eager layers"
    # panels off: the C GEMV below 16 rows, oneDNN's copy, MKL on the plain weight from 512
    q = _plan(ZEN3, f32_panel=False)
    assert [q.kernel("f32_matmul", "float32", m).kernel for m in (15, 16, 511, 512)] == [
        "tl_f32_linear", "mkldnn._linear_pointwise", "mkldnn._linear_pointwise", "F.linear"]
    assert _plan(ZEN3, quant_f32_rows=0).kernel("quant_matmul", "Q8_0", 500).kernel == "tile2_TL_Q8"


def test_avx512_zen4_plan_without_amx():
    p = _plan(ZEN4)
    assert p.cpu_isa == "avx512" and p.quant_level == 2 and p.bf16_matmul == "dot_products"
    assert {p.quant_level_for(f) for f in kernel_plan.QUANT_FORMATS} == {"avx512_vnni"}
    assert all(p.kernel("quant_matmul", f, m).kernel == "tile_avx512"
               for f in kernel_plan.QUANT_FORMATS for m in (1, 8, 16, 512))
    assert p.kernel("bf16_matmul", "bfloat16", 64).kernel == "tl_bf16dp_linear"
    assert not p.f32_panels and p.f32_plain_from_rows is None
    assert p.kernel("f32_matmul", "float32", 512).kernel == "mkldnn._linear_pointwise"
    assert _plan(ZEN4, bf16_dp=False).bf16_matmul == "onednn"


def test_sapphire_rapids_plan_with_amx():
    p = _plan(SPR)
    assert p.quant_level == 4 and p.bf16_matmul == "tiles" and p.quant_silu_rows == 16
    assert [p.kernel("quant_matmul", "Q4_0", m).kernel for m in (1, 7, 8, 15, 16, 1000)] == [
        "tile_avx512", "tile_avx512", "amx_TL_Q4_0_2", "amx_TL_Q4_0_2", "tl_q_linear_amx_bf16",
        "tl_q_linear_amx_bf16"]
    assert p.kernel("quant_matmul", "Q6_K", 8).kernel == "tile_avx512"  # no AMX int8 kernel
    assert p.kernel("bf16_matmul", "bfloat16", 1).kernel == "tl_amx_bf16_linear"
    assert _plan(SPR, amx_bf16=False).bf16_matmul == "dot_products"
    # TOKENLOOM_QUANT_ISA caps the level; "amx" stops short of the bf16 tiles
    assert _plan(SPR, quant_isa="amx").quant_level == 3
    assert _plan(SPR, quant_isa="amx").quant_level_for("Q6_K") == "avx512_vnni"
    assert _plan(SPR, quant_isa="avx2").quant_level == 1 and _plan(ZEN3, quant_isa="avx512").quant_level == 1
    assert _plan(SPR, quant_bf16_rows=0).kernel("quant_matmul", "Q8_0", 4096).kernel == "amx_TL_Q8_2"


def test_kernels_off_means_torch_everywhere():
    for cpu in kernel_plan.KNOWN_CPUS:
        p = _plan(cpu, cpu_kernels=False)
        assert not p.c_kernels and not any(c.op.startswith("quant") for c in p.choices)
        assert not any(c.kernel.startswith("tl_") for c in p.choices), cpu


def test_every_op_covers_every_row_count_once():
    for cpu in kernel_plan.KNOWN_CPUS:
        p = _plan(cpu)
        for op, dtype in {(c.op, c.dtype) for c in p.choices}:
            for rows in (1, 7, 8, 15, 16, 511, 512, 100000):
                assert sum(c.covers(rows) for c in p.choices if (c.op, c.dtype) == (op, dtype)) == 1


def test_plan_vocabulary_matches_ops_quant():
    assert quant.FORMAT_NAMES == dict(enumerate(kernel_plan.QUANT_FORMATS))
    assert quant.ACT_LEVELS == kernel_plan.ACT_LEVELS
    assert quant.ISA_NAMES == dict(enumerate(kernel_plan.QUANT_LEVELS))


def test_csrc_readme_table_is_current():
    """ops/csrc/README.md's op x ISA x dtype table is the one the plans give (regenerate with
    `python -c 'from tokenloom.ops import kernel_plan; print(kernel_plan.csrc_readme_table())'`)."""
    assert kernel_plan.csrc_readme_table() in README.read_text()


# ---------------------------------------------------------------- this machine's own ISA

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="C kernels not built here")


@needs_kernels
def test_host_plan_matches_the_c_libraries_own_decisions():
    plan = kernel_plan.current()
    assert cpu_kernels.isa() == plan.cpu_isa
    for fmt, name in quant.FORMAT_NAMES.items():
        assert quant.kernel_isa(fmt) == plan.quant_level_for(name)
        assert quant.silu_epilogue_rows(fmt) == plan.quant_silu_rows
        assert quant.f32_panel_rows(fmt) == (plan.quant_f32_rows if plan.quant_level_for(name) == "avx2" else 0)
    expected = {"tiles": "AMX tiles", "dot_products": "AVX512-BF16 dot products"}.get(plan.bf16_matmul)
    assert amx.kernel_name() == expected


@needs_kernels
@pytest.mark.parametrize("fmt", [quant.FMT_Q8, quant.FMT_Q6_K])
def test_host_quantized_matmul_runs_the_planned_kernel(fmt):
    """A real matmul through ops/quant at every row range of the plan; the C probe says which
    kernel ran."""
    plan = kernel_plan.current()
    name = quant.FORMAT_NAMES[fmt]
    w = quant.quantize_q8(torch.randn(32, 256)) if fmt == quant.FMT_Q8 else _q6k_weight()
    for c in [c for c in plan.choices if c.op in ("quant_matmul", "quant_matmul_bf16") and c.dtype == name]:
        for rows in {c.rows_from, (c.rows_to or c.rows_from + 40) - 1}:
            dtype = torch.bfloat16 if c.op == "quant_matmul_bf16" else torch.float32
            quant.qlinear(torch.randn(rows, w.in_features).to(dtype), w)
            assert c.kernel.startswith(quant.last_kernel()) and quant.last_kernel(), (c, rows)


def _q6k_weight() -> quant.TiledQuantWeight:
    import sys

    from gguf import GGMLQuantizationType as Q

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))  # the K-quant quantizer
    import kquants

    raw = kquants.quantize(torch.randn(32, 256).numpy(), Q.Q6_K)
    return quant.tile_gguf(raw, Q.Q6_K)


@needs_kernels
def test_host_float_matmuls_run_the_planned_kernel(monkeypatch):
    """model/packed_linear.linear on a plain float32 weight (the C GEMV below the plan's rows,
    then F.linear without a packed copy), and the bf16 packed matmul on the planned kernel."""
    from tokenloom.model import packed_linear

    plan = kernel_plan.current()
    called = []
    real = cpu_kernels.f32_linear
    monkeypatch.setattr(cpu_kernels, "f32_linear", lambda *a: called.append("tl_f32_linear") or real(*a))
    w = torch.randn(32, 64)
    for rows in (1, plan.f32_gemv_below_rows):
        called.clear()
        packed_linear.linear(torch.randn(rows, 64), w, None, None)
        gemv = plan.f32_gemv_below_rows > rows
        assert called == (["tl_f32_linear"] if gemv else [])
    if plan.bf16_matmul in ("tiles", "dot_products"):
        assert packed_linear.packed_linear_available(torch.bfloat16)
        packed = packed_linear.pack_weight(w.bfloat16())
        assert isinstance(packed, amx.AmxPackedWeight)
        assert amx.tiles() == (plan.bf16_matmul == "tiles")
    assert packed_linear.panels_wanted() == plan.f32_panels


def test_plan_follows_the_environment(monkeypatch):
    monkeypatch.setenv("TOKENLOOM_F32_GEMV", "0")
    monkeypatch.setenv("TOKENLOOM_QUANT_BF16_ROWS", "32")
    monkeypatch.setenv("TOKENLOOM_FUSED_DECODE", "0")
    p = kernel_plan.current()
    assert p.f32_gemv_below_rows == 0 and p.quant_bf16_rows == 32 and not p.fused_decode
    assert dataclasses.replace(KernelEnv.from_environ(), f32_gemv=True).f32_gemv


def test_host_features_give_a_known_level():
    assert cpu_features.detect().isa in cpu_features.ISA_LEVELS
    assert kernel_plan.format_table(kernel_plan.current()).splitlines()[1].split()[:4] == ["op", "dtype", "rows", "kernel"]


def test_engine_info_carries_the_plan():
    import msgspec

    from tokenloom.messages import EngineInfo

    plan = kernel_plan.current()
    info = EngineInfo(max_model_len=1, vocab_size=1, num_kv_blocks=1, block_size=16, dtype="float32",
                      attention_backend="torch", pid=1, kernel_plan_summary=plan.header(), kernel_plan=plan.encode())
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(info), type=EngineInfo)
    assert back.kernel_plan == plan.encode() and back.kernel_plan_summary == plan.header()
    assert f"kernel_plan=<{len(plan.choices)} rows>" in repr(back)


def test_mxfp4_experts_plan():
    """gpt-oss's MXFP4 experts: the C kernel below 64 rows on the vector builds (16 for bfloat16
    activations where bf16 matmuls are native), below 4 on plain C; the unpacking above; without
    the C kernels torch's unpacking throughout."""
    def kernels(p, dtype):
        return [p.kernel("mxfp4_matmul", dtype, m).kernel for m in (1, 3, 4, 15, 16, 63, 64)]

    c, unpack = "tl_mxfp4_linear", "tl_mxfp4_unpack + F.linear"
    assert kernels(_plan(ZEN3), "float32") == kernels(_plan(ZEN3), "bfloat16") == [c] * 6 + [unpack]
    for cpu in (ZEN4, SPR):
        assert kernels(_plan(cpu), "float32") == [c] * 6 + [unpack]
        assert kernels(_plan(cpu), "bfloat16") == [c] * 4 + [unpack] * 3
    scalar = dataclasses.replace(known_features(ZEN3), isa="scalar")
    assert kernels(build_kernel_plan(scalar, KernelEnv()), "float32") == [c] * 2 + [unpack] * 5
    off = _plan(SPR, cpu_kernels=False)
    assert off.mxfp4_c_below_rows == 0 and kernels(off, "float32") == ["unpack + F.linear"] * 7
