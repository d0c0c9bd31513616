"""Which kernel runs, for every op, dtype and row range, on a given CPU: one frozen `KernelPlan`.

Built by a pure function, `build_kernel_plan(features, env)`, from the CPU's flags
(`cpu_features.CpuFeatures`) and the environment's switches (`KernelEnv`, read through
`tokenloom.envs`), as llama.cpp's ggml-cpu fills one traits table per type for the CPU it runs
on: one table a reader can print. The dispatch takes its decisions from it:

- the C library's build level (`cpu_isa`, `-march=native` capped by TOKENLOOM_CPU_ISA) and
  whether it is built at all (`c_kernels`, TOKENLOOM_CPU_KERNELS);
- the quantized matmul's thresholds and level cap (ops/quant.py hands `quant_bf16_rows`,
  `quant_f32_rows` and `quant_force_level` to csrc/quant_gemm.c when it binds);
- the float32 matmul's C GEMV threshold, panels and plain-weight threshold
  (model/packed_linear.py), the bfloat16 matmul's kernel (ops/amx.py) and the fused decode step
  (model/fused_decode.py);
- the rows below which gpt-oss's MXFP4 experts run the C kernel (model/gpt_oss.py,
  `mxfp4_c_below_rows`, `mxfp4_c_below_rows_bf16`) rather than being unpacked to float for
  torch's matmul.

Some decisions stay in C because only the running CPU can answer them: the quantized kernel
level (`__builtin_cpu_supports`, Linux granting the AMX tile state) and the function tables in
csrc/quant_gemm.c, and the AMX / AVX512-BF16 bf16 matmuls' availability (compiler macros). The
plan states the same decisions from the flags (`quant_level`), and tests/ops/test_kernel_plan.py
checks them against the library on this machine and the plan of every ISA level against what
this module documents.

`current()` is the plan of this process (the detected CPU, the environment now);
`format_table()` prints it (`tokenloom env`, the start-up log), and `csrc_readme_table()`
writes the op x ISA x dtype table of ops/csrc/README.md.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from tokenloom import envs
from tokenloom.ops import cpu_features
from tokenloom.ops.cpu_features import CpuFeatures

# Quantized kernel levels of csrc/quant_gemm.c, by id (tl_q_isa's answer).
QUANT_LEVELS = ("c", "avx2", "avx512_vnni", "avx512_vnni+amx_int8", "avx512_vnni+amx_bf16")
# TOKENLOOM_QUANT_ISA's words -> the level id they cap at (any other word: 0, as the C did).
QUANT_ISA_WORDS = {"amx_bf16": 4, "amx": 3, "avx512": 2, "avx2": 1, "c": 0}
# Formats in csrc/quant_gemm.c's id order (ops/quant.FORMAT_NAMES); Q6_K has no AMX int8 kernel.
QUANT_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K")
_C_FORMAT = {"Q4_0": "TL_Q4_0", "Q4_1": "TL_Q4_1", "Q8_0": "TL_Q8", "Q5_0": "TL_Q5_0",
             "Q4_K": "TL_Q4_K", "Q5_K": "TL_Q5_K", "Q6_K": "TL_Q6_K"}
_NO_AMX_INT8 = frozenset({"Q6_K"})

# The thresholds, in one place (each named by its benchmarks/CHANGELOG.md section).
QUANT_BF16_ROWS = 16  # "Quantized matmuls on AMX-BF16 tiles"
QUANT_F32_ROWS = 16  # "Float32 panels from 16 rows on AVX2"
AMX_INT8_ROWS = {1: 16, 2: 8}  # csrc/quant_gemm_amx.inc's AMX_MIN_ROWS, by activation planes
ACT_LEVELS = 2  # activation planes of a quantized matmul (ops/quant.ACT_LEVELS)
F32_GEMV_BELOW_ROWS = 16  # "float32 GEMV"
F32_PLAIN_FROM_ROWS = 512  # MKL on the plain weight beats oneDNN's copy from here (AVX2 only)
# "MXFP4 experts in C": csrc/mxfp4_gemm.c below these rows, by the library's build level (its
# vector loops outrun the unpacked float32 matmul well past a decode step's rows; the plain C ones
# only for a few); with bfloat16 activations on CPUs that multiply bfloat16 natively, below
# MXFP4_C_BELOW_ROWS_BF16 (the unpacked bfloat16 matmul catches up sooner).
MXFP4_C_BELOW_ROWS = {"avx512": 64, "avx2": 64, "scalar": 4}
MXFP4_C_BELOW_ROWS_BF16 = 16
MOE_FUSED_BELOW_ROWS = 16  # "Mixture of experts at the real shape"

# The "last kernel" probe of csrc/quant_gemm.c (tl_q_last_kernel) -> the prefix of the kernel
# names below that it stands for.
QUANT_PROBE = {0: "tile_portable", 1: "tile2_", 2: "tile_avx512", 3: "amx_", 4: "tl_q_linear_amx_bf16",
               5: "f32p_linear"}

TORCH = "torch"  # the PyTorch fallback

# csrc/lowp_gemm.c's levels (tl_lp_level) by id, and the level TOKENLOOM_QUANT_ISA's words cap it
# at (its cap on the quantized kernels, read for these: "amx" is AMX int8, so no bf16 tiles).
LOWP_LEVELS = ("lp_portable", "lp_avx2", "lp_avx512", "lp_amx_bf16")
_LOWP_CAP = {4: 3, 3: 2, 2: 2, 1: 1, 0: 0}


@dataclass(frozen=True)
class KernelEnv:
    """The environment's switches that pick kernels (tokenloom.envs has each one's doc line);
    TOKENLOOM_CPU_ISA is in `CpuFeatures.isa` already."""

    cpu_kernels: bool = True
    quant_isa: str | None = None
    quant_bf16_rows: int | None = None
    quant_f32_rows: int | None = None
    f32_gemv: bool = True
    f32_panel: bool = True
    amx_bf16: bool = True
    bf16_dp: bool = True
    fused_decode: bool = True
    fused_moe: bool = True

    @classmethod
    def from_environ(cls) -> KernelEnv:
        return cls(cpu_kernels=envs.TOKENLOOM_CPU_KERNELS, quant_isa=envs.TOKENLOOM_QUANT_ISA,
                   quant_bf16_rows=envs.TOKENLOOM_QUANT_BF16_ROWS,
                   quant_f32_rows=envs.TOKENLOOM_QUANT_F32_ROWS, f32_gemv=envs.TOKENLOOM_F32_GEMV,
                   f32_panel=envs.TOKENLOOM_F32_PANEL, amx_bf16=envs.TOKENLOOM_AMX_BF16,
                   bf16_dp=envs.TOKENLOOM_BF16_DP, fused_decode=envs.TOKENLOOM_FUSED_DECODE,
                   fused_moe=envs.TOKENLOOM_FUSED_MOE)


@dataclass(frozen=True)
class KernelChoice:
    """`kernel` runs `op` for `dtype` on rows_from <= rows < rows_to (None: no upper bound)."""

    op: str
    dtype: str
    rows_from: int
    rows_to: int | None
    kernel: str
    note: str = ""

    def rows(self) -> str:
        if self.rows_to is None:
            return f"{self.rows_from}+"
        return f"{self.rows_from}-{self.rows_to - 1}"

    def covers(self, rows: int) -> bool:
        return rows >= self.rows_from and (self.rows_to is None or rows < self.rows_to)


@dataclass(frozen=True)
class KernelPlan:
    cpu_isa: str  # the C library's build level: "avx512" | "avx2" | "scalar"
    cpu_flags: tuple[str, ...]  # CpuFeatures.isa_flags()
    c_kernels: bool  # False: TOKENLOOM_CPU_KERNELS=0, every op on its PyTorch path
    quant_level: int  # csrc/quant_gemm.c's level id (QUANT_LEVELS), before Q6_K's exception
    quant_force_level: int  # what tl_q_force_isa gets (-1: no cap)
    quant_bf16_rows: int  # what tl_q_set_amx_bf16_rows gets (0: never)
    quant_f32_rows: int  # what tl_q_set_f32_panel_rows gets (0: never)
    quant_silu_rows: int  # rows from which the gate|up matmul applies SiLU in its epilogue (0: never)
    f32_gemv_below_rows: int  # plain float32 weights: the C GEMV below this many rows (0: never)
    f32_panels: bool  # float32 weights packed in panels (csrc/f32_panel.c)
    f32_plain_from_rows: int | None  # F.linear on the plain weight from here (None: never, released)
    bf16_matmul: str  # "tiles" | "dot_products" | "onednn" | "F.linear"
    fused_decode: bool  # whether FusedDecode.build may fuse a decode step into one C call
    mxfp4_c_below_rows: int  # MXFP4 experts: csrc/mxfp4_gemm.c below this many rows (0: never)
    mxfp4_c_below_rows_bf16: int  # the same for bfloat16 activations
    lowp_level: int  # csrc/lowp_gemm.c's level (LOWP_LEVELS): FP8 and bf16 weights as stored
    lowp_force_level: int  # what tl_lp_limit_level gets (-1: no cap)
    # quantized MoE experts: one tl_q_moe call per layer while every chosen expert has fewer
    # rows than this (0: never; from here each expert's matmuls run on their own, AMX included)
    moe_fused_below_rows: int = 0
    choices: tuple[KernelChoice, ...] = field(default=())

    def quant_level_for(self, fmt: str) -> str:
        """The level csrc/quant_gemm.c's tl_q_isa answers for format `fmt` (a QUANT_FORMATS name)."""
        level = 2 if self.quant_level == 3 and fmt in _NO_AMX_INT8 else self.quant_level
        return QUANT_LEVELS[level]

    def kernel(self, op: str, dtype: str, rows: int) -> KernelChoice:
        """The choice that runs `op` for `dtype` on `rows` rows."""
        for c in self.choices:
            if c.op == op and c.dtype == dtype and c.covers(rows):
                return c
        raise KeyError(f"no kernel planned for {op} {dtype} at {rows} rows")

    def encode(self) -> list[list[str]]:
        """The choices as [op, dtype, rows, kernel, note] rows (EngineInfo.kernel_plan)."""
        return [[c.op, c.dtype, c.rows(), c.kernel, c.note] for c in self.choices]

    def header(self) -> str:
        quant = ", ".join(sorted({self.quant_level_for(f) for f in QUANT_FORMATS}))
        return (f"C kernels {'built for ' + self.cpu_isa if self.c_kernels else 'off'}; "
                f"quantized level {quant}; bf16 matmul {self.bf16_matmul}; "
                f"f32 {'panels' if self.f32_panels else 'GEMV/oneDNN/MKL'}; "
                f"fused decode {'on' if self.fused_decode else 'off'}")


def quant_level(flags: frozenset[str], force: str | None = None) -> int:
    """csrc/quant_gemm.c's detect_isa from the flags: AVX2+FMA 1; AVX-512 F/BW/VL+VNNI 2; AMX
    int8 3 (Linux granting the tile state, assumed here and checked on the host); AMX-BF16 with
    AVX512-BF16 and VBMI 4. `force` (TOKENLOOM_QUANT_ISA) caps it; below 3 without AMX."""
    best = 0
    if {"avx2", "fma"} <= flags:
        best = 1
    if best and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        best = 2
    want = None if force is None else QUANT_ISA_WORDS.get(force, 0)
    if want is not None and want < 3:
        return min(want, best)
    if best == 2 and {"amx_tile", "amx_int8"} <= flags:
        best = 3
    if best == 3 and {"amx_bf16", "avx512_bf16", "avx512vbmi"} <= flags and want in (None, 4):
        best = 4
    return best


def lowp_level(flags: frozenset[str], force: int = -1) -> int:
    """csrc/lowp_gemm.c's lp_detect from the flags: AVX2+FMA+F16C 1; AVX-512 F/BW/VL 2; AMX-BF16
    with AVX512-BF16 3 (Linux granting the tile state, assumed here); capped at `force` (-1: none)."""
    best = 0
    if {"avx2", "fma", "f16c"} <= flags:
        best = 1
    if best and {"avx512f", "avx512bw", "avx512vl"} <= flags:
        best = 2
    if best == 2 and {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags:
        best = 3
    return best if force < 0 else min(best, force)


def _lowp_choices(level: int, bf16_rows: int) -> list[KernelChoice]:
    """FP8 e4m3 and bfloat16 weights kept as stored, float32 activations (ops/lowp.py)."""
    notes = ("portable C", "AVX2, widened in registers", "AVX-512, widened in registers")
    points = [(1, LOWP_LEVELS[min(level, 2)], notes[min(level, 2)])]
    if level == 3 and bf16_rows > 0:
        points.append((bf16_rows, LOWP_LEVELS[3], "widened to bf16 panels on AMX-BF16"))
    return [c for dtype in ("float8_e4m3", "bfloat16 weight") for c in _segments("lowp_matmul", dtype, points)]


def _segments(op: str, dtype: str, points: list[tuple[int, str, str]]) -> list[KernelChoice]:
    """[(from rows, kernel, note), ...] in rising order -> choices up to the next one's rows;
    a point at or past the next one's rows is dropped."""
    points = [p for i, p in enumerate(points) if all(p[0] < q[0] for q in points[i + 1:])]
    return [KernelChoice(op, dtype, p[0], points[i + 1][0] if i + 1 < len(points) else None, p[1], p[2])
            for i, p in enumerate(points)]


def _quant_points(level: int, fmt: str, bf16_rows: int, f32_rows: int) -> list[tuple[int, str, str]]:
    """The float32-activation kernels of tl_q_linear for `fmt` at `level`, by rows."""
    c = _C_FORMAT[fmt]
    if level == 0:
        return [(1, "tile_portable", "portable C")]
    if level == 1:
        points = [(1, f"tile2_{c}", "AVX2 int8 (VPMADDUBSW)")]
        if f32_rows > 0:
            points.append((max(f32_rows, 1), "f32p_linear", "dequantized float32 panels"))
        return points
    points = [(1, "tile_avx512", "AVX-512 VNNI")]
    if level >= 3 and fmt not in _NO_AMX_INT8:
        points.append((AMX_INT8_ROWS[ACT_LEVELS], f"amx_{c}_{ACT_LEVELS}", "AMX int8 tiles"))
    if level == 4 and bf16_rows > 0:
        points.append((bf16_rows, "tl_q_linear_amx_bf16", "dequantized bf16 panels on AMX-BF16"))
    return points


def _quant_choices(plan_level: int, bf16_rows: int, f32_rows: int, silu_rows: int) -> list[KernelChoice]:
    out = []
    for fmt in QUANT_FORMATS:
        level = 2 if plan_level == 3 and fmt in _NO_AMX_INT8 else plan_level
        points = _quant_points(level, fmt, bf16_rows, f32_rows)
        out += _segments("quant_matmul", fmt, points)
        # bfloat16 activations: the tiles take them as they are; below, widened to float32
        bf16 = [(r, k, n + ("" if k == "tl_q_linear_amx_bf16" else ", activations widened to float32"))
                for r, k, n in points]
        out += _segments("quant_matmul_bf16", fmt, bf16)
        silu = [(1, "two passes", "matmul, then silu_and_mul")]
        if silu_rows > 0:
            silu.append((silu_rows, "tl_q_linear_silu", "SiLU in the epilogue"))
        out += _segments("quant_gate_up_silu", fmt, silu)
    return out


def _moe_fused_rows(c: bool, fused: bool, level: int, bf16_rows: int, f32_rows: int) -> int:
    """Rows per expert below which a quantized MoE layer runs as one tl_q_moe call: its tile
    kernels are tl_q_linear's below the AMX int8 tiles (and the bf16 / float32 panels), so it stops
    where a lone expert's matmul would change kernel."""
    if not (c and fused):
        return 0
    stops = [MOE_FUSED_BELOW_ROWS]
    if level >= 3:
        stops.append(AMX_INT8_ROWS[ACT_LEVELS])
    if level == 4 and bf16_rows > 0:
        stops.append(bf16_rows)
    if level == 1 and f32_rows > 0:
        stops.append(f32_rows)
    return min(stops)


def _moe_choices(below: int) -> list[KernelChoice]:
    points = [(1, "per-expert quant_matmul", "two matmuls, an activation and an add per chosen expert")]
    if below > 1:
        points = [(1, "tl_q_moe", "one call per layer over the chosen experts"),
                  (below, *points[0][1:])]
    return _segments("quant_moe_experts", "float32", points)


def _f32_choices(c: bool, panels: bool, gemv_below: int, plain_from: int | None) -> list[KernelChoice]:
    if panels:
        return _segments("f32_matmul", "float32", [(1, "tl_f32_panel_linear", "one panel-packed copy")])
    points = []
    if c and gemv_below > 1:
        note = "plain weight" if plain_from is not None else "plain weight; the engine releases it here"
        points.append((1, "tl_f32_linear", note))
    points.append((max(gemv_below, 1) if points else 1, "mkldnn._linear_pointwise", "oneDNN packed copy"))
    if plain_from is not None:
        points.append((plain_from, "F.linear", "MKL on the plain weight"))
    return _segments("f32_matmul", "float32", points)


def _mxfp4_choices(isa: str, below: int, below_bf16: int, c: bool) -> list[KernelChoice]:
    out = []
    for dtype, rows in (("float32", below), ("bfloat16", below_bf16)):
        points = [(1, "tl_mxfp4_linear", f"{isa} loops, each weight byte read once")] if rows > 1 else []
        unpack = "tl_mxfp4_unpack + F.linear" if c else "unpack + F.linear"
        points.append((max(rows, 1) if points else 1, unpack, f"the expert made {dtype} for the step"))
        out += _segments("mxfp4_matmul", dtype, points)
    return out


def _bf16_kernel(features: CpuFeatures, env: KernelEnv) -> str:
    """ops/amx.py's choice: our AMX tile kernel where the avx512 build has AMX-BF16 (Linux
    granting the tile state), else the AVX512-BF16 dot products, else oneDNN where the CPU
    multiplies bf16 natively, else F.linear."""
    f, built = features.flags, env.cpu_kernels and features.isa == "avx512"
    if built and env.amx_bf16 and {"amx_tile", "amx_bf16", "avx512_bf16"} <= f:
        return "tiles"
    if built and env.bf16_dp and "avx512_bf16" in f:
        return "dot_products"
    return "onednn" if features.native_bf16 else "F.linear"


_BF16_KERNELS = {"tiles": ("tl_amx_bf16_linear", "AMX tiles, weight packed once"),
                 "dot_products": ("tl_bf16dp_linear", "AVX512-BF16 dot products, weight packed once"),
                 "onednn": ("mkldnn._linear_pointwise", "oneDNN packed copy"),
                 "F.linear": ("F.linear", "no native bf16: widened by PyTorch")}


def _other_choices(features: CpuFeatures, c: bool, bf16: str, fused: bool, panels: bool) -> list[KernelChoice]:
    loops = features.isa
    out = [KernelChoice("bf16_matmul", "bfloat16", 1, None, *_BF16_KERNELS[bf16])]
    dp = " (AVX512-BF16 dot products)" if loops == "avx512" and "avx512_bf16" in features.flags else ""
    for dtype, fn, note in (("float32", "tl_paged_decode_f32", ""),
                            ("float32/bf16 cache", "tl_paged_decode_f32_bf16kv", ""),
                            ("bfloat16", "tl_paged_decode_bf16", dp)):
        out.append(KernelChoice("decode_attention", dtype, 1, None, fn if c else "SDPA",
                                f"{loops} loops{note}" if c else "gathered, then torch SDPA"))
    for op in ("add_rms_norm", "silu_and_mul", "rope"):
        for dtype, sfx in (("float32", "f32"), ("bfloat16", "bf16")):
            out.append(KernelChoice(op, dtype, 1, None, f"tl_{op}_{sfx}" if c else TORCH,
                                    f"{loops} loops" if c else ""))
    out.append(KernelChoice("argmax", "float32", 1, None, "tl_argmax_f32" if c else TORCH))
    step = c and fused
    out.append(KernelChoice("decode_step", "float32", 1, None, "tl_llama_decode" if step else "eager layers",
                            ("panel or quantized weights" if panels else "quantized weights, or below the GEMV rows")
                            if step else ""))
    bf16_step = step and bf16 in ("tiles", "dot_products")
    out.append(KernelChoice("decode_step", "bfloat16", 1, None, "tl_llama_decode" if bf16_step else "eager layers",
                            "packed bf16 weights" if bf16_step else ""))
    return out


def build_kernel_plan(features: CpuFeatures, env: KernelEnv) -> KernelPlan:
    """The plan for a CPU with `features` (its `isa` already capped by TOKENLOOM_CPU_ISA) under
    the switches `env`. Pure: the same inputs give the same plan on any machine."""
    c = env.cpu_kernels
    force = -1 if env.quant_isa is None else QUANT_ISA_WORDS.get(env.quant_isa, 0)
    level = quant_level(features.flags, env.quant_isa) if c else 0
    bf16_rows = QUANT_BF16_ROWS if env.quant_bf16_rows is None else env.quant_bf16_rows
    f32_rows = QUANT_F32_ROWS if env.quant_f32_rows is None else env.quant_f32_rows
    silu_rows = bf16_rows if level == 4 and features.isa == "avx512" else 0
    panels = c and env.f32_panel and features.isa == "avx2"
    gemv_below = F32_GEMV_BELOW_ROWS if env.f32_gemv else 0
    plain_from = None if features.isa == "avx512" else F32_PLAIN_FROM_ROWS
    bf16 = _bf16_kernel(features, env)
    choices = _f32_choices(c, panels, gemv_below, plain_from)
    moe_rows = _moe_fused_rows(c, env.fused_moe, level, bf16_rows, f32_rows)
    if c:
        choices += _quant_choices(level, bf16_rows if level == 4 else 0, f32_rows if level == 1 else 0, silu_rows)
        choices += _moe_choices(moe_rows)
    mxfp4_below = MXFP4_C_BELOW_ROWS[features.isa] if c else 0
    mxfp4_below_bf16 = min(mxfp4_below, MXFP4_C_BELOW_ROWS_BF16) if features.native_bf16 else mxfp4_below
    choices += _mxfp4_choices(features.isa, mxfp4_below, mxfp4_below_bf16, c)
    lowp_force = -1 if env.quant_isa is None else _LOWP_CAP[QUANT_ISA_WORDS.get(env.quant_isa, 0)]
    lowp = lowp_level(features.flags, lowp_force) if c else 0
    if c:
        choices += _lowp_choices(lowp, bf16_rows)
    choices += _other_choices(features, c, bf16, env.fused_decode, panels)
    return KernelPlan(cpu_isa=features.isa, cpu_flags=tuple(features.isa_flags()), c_kernels=c,
                      quant_level=level, quant_force_level=force, quant_bf16_rows=bf16_rows,
                      quant_f32_rows=f32_rows, quant_silu_rows=silu_rows, f32_gemv_below_rows=gemv_below,
                      f32_panels=panels, f32_plain_from_rows=plain_from, bf16_matmul=bf16,
                      fused_decode=env.fused_decode, mxfp4_c_below_rows=mxfp4_below,
                      mxfp4_c_below_rows_bf16=mxfp4_below_bf16, moe_fused_below_rows=moe_rows,
                      lowp_level=lowp, lowp_force_level=lowp_force,
                      choices=tuple(choices))


@functools.lru_cache(maxsize=8)
def _cached(features: CpuFeatures, env: KernelEnv) -> KernelPlan:
    return build_kernel_plan(features, env)


def current() -> KernelPlan:
    """This process's plan: the detected CPU under the environment as it is now (cached per
    environment, so a test that sets a switch gets the plan for it)."""
    return _cached(cpu_features.detect(), KernelEnv.from_environ())


def format_table(plan: KernelPlan) -> str:
    """The plan as an aligned text table, its header line first (`tokenloom env`)."""
    return plan.header() + "\n" + format_plan_rows(plan.encode())


def format_plan_rows(rows: list[list[str]]) -> str:
    """`KernelPlan.encode()` rows (as EngineInfo carries them) as an aligned text table (the
    engine's start-up log)."""
    table = [["op", "dtype", "rows", "kernel", "note"], *rows]
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    return "\n".join(("  ".join(v.ljust(w) for v, w in zip(r[:4], widths)) + "  " + r[4]).rstrip()
                     for r in table)


# The CPUs the project knows, by ISA level, as their /proc/cpuinfo flags (the kernel-relevant ones).
_AVX2 = frozenset({"avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni", "avx512vbmi"}
KNOWN_CPUS: dict[str, frozenset[str]] = {
    "AVX2 (Zen 3)": _AVX2,
    "AVX-512+VNNI+BF16, no AMX (Zen 4)": _AVX512 | {"avx512_bf16"},
    "AVX-512+AMX (Sapphire Rapids)": _AVX512 | {"avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"},
}


def known_features(name: str) -> CpuFeatures:
    """The `CpuFeatures` of one of KNOWN_CPUS (its ISA level from its flags, uncapped)."""
    flags = KNOWN_CPUS[name]
    isa = "avx512" if {"avx512f", "avx512bw", "avx512vl"} <= flags else "avx2" if {"avx2", "fma"} <= flags else "scalar"
    return CpuFeatures(model_name=name, flags=flags, isa=isa, num_cores=1)


def csrc_readme_table() -> str:
    """The op x ISA x dtype table of ops/csrc/README.md: each known CPU's plan under the default
    switches, one column per CPU (a house test checks the committed README against it)."""
    plans = {name: build_kernel_plan(known_features(name), KernelEnv()) for name in KNOWN_CPUS}
    keys: list[tuple[str, str, str]] = []
    cells: dict[tuple[str, str, str, str], str] = {}
    for name, plan in plans.items():
        for c in plan.choices:
            for r in _row_points(plans, c.op, c.dtype):
                if c.covers(r):
                    key = (c.op, c.dtype, _range(plans, c.op, c.dtype, r))
                    if key not in keys:
                        keys.append(key)
                    cells[(*key, name)] = f"`{c.kernel}`"
    head = "| op | dtype | rows | " + " | ".join(plans) + " |"
    lines = [head, "|" + "---|" * (3 + len(plans))]
    for key in keys:
        lines.append("| " + " | ".join([*key, *(cells.get((*key, n), "") for n in plans)]) + " |")
    return "\n".join(lines)


def _row_points(plans: dict[str, KernelPlan], op: str, dtype: str) -> list[int]:
    return sorted({c.rows_from for p in plans.values() for c in p.choices if c.op == op and c.dtype == dtype})


def _range(plans: dict[str, KernelPlan], op: str, dtype: str, r: int) -> str:
    """The rows from `r` to the next point where any known CPU's plan changes kernel."""
    later = [p for p in _row_points(plans, op, dtype) if p > r]
    return f"{r}+" if not later else f"{r}-{later[0] - 1}"
