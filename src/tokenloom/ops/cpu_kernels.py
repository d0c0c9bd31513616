"""CPU kernels in C (csrc/), float32 and bfloat16, built on first use and called through ctypes.

- `paged_decode` (csrc/paged_decode.c): decode attention read in place through the block table.
  The torch backend's SDPA path gathers every sequence's K/V blocks into a padded buffer first,
  a large share of a batch-64 decode step; the kernel reads the cache in place
  (benchmarks/cpu_kernels.py).
- `add_rms_norm`, `silu_and_mul`, `rope` (csrc/elementwise.c): the decoder's element-wise steps,
  one pass each instead of 2-7 eager ops (the model uses them through `model/llama.py`).
- `tl_q_*` (csrc/quant_gemm.c): matmuls on block-quantized weights (GGUF Q4_0/Q4_1/Q5_0/Q8_0,
  the K-quants Q4_K/Q5_K/Q6_K, int8), bound and called by `ops/quant.py`; that file dispatches
  on the CPU's ISA itself.
- `tl_llama_decode` (csrc/decode_step.c): a whole decode step of a Llama-family decoder in one
  call (`ops/decode_step.py`).
- `tl_amx_bf16_*` (csrc/amx_gemm.c): bfloat16 matmuls on AMX tiles with the weight packed once
  (`ops/amx.py`), for the fused decode step.
- `f32_linear` (csrc/f32_gemv.c): float32 matmuls of a few rows on a plain row-major weight, at
  the speed the weight streams from memory (model/packed_linear.py picks it for decode-sized
  inputs where the weights stay plain; the fused decode step calls it too).
- `f32_panel_linear` (csrc/f32_panel.c): float32 matmuls of any row count on a weight packed once
  into panels of 16 output columns (`f32_panel_pack`); on AVX2 CPUs the float path's one copy of
  each weight (model/packed_linear.py), read by the eager layers and the fused decode step.
- `mxfp4_linear` (csrc/mxfp4_gemm.c): float32 matmuls of a few rows on MXFP4 weights as gpt-oss
  ships its experts (model/mxfp4.py), each weight byte read once, with no float copy of the weight.
- `tl_lp_linear` (csrc/lowp_gemm.c): matmuls on FP8 e4m3 (with scales) and bfloat16 weights kept
  in their stored width, float32 activations and outputs (`ops/lowp.py`).

The sources are compiled together with the system C compiler (`$CC`, else `cc`) into one library
for the ISA level `cpu_features.detect()` found (AVX-512 F/BW/VL, AVX2+FMA or plain; the C code
picks its loops from the compiler's target macros), in `$TOKENLOOM_CACHE_DIR/kernels` (default
`~/.cache/tokenloom/kernels`), named by a hash of the sources, the flags, the ISA level, the CPU's
flags and the compiler, so a changed source or machine builds anew; the build takes a few
seconds (the sources compile side by side) and is written atomically (concurrent engines may
race to build it). It links against the OpenMP runtime torch already loaded (same soname), so
the kernels' threads are torch's. Without a compiler, or with `TOKENLOOM_CPU_KERNELS=0`, `load()` returns None and every
caller keeps its PyTorch path. Each function takes float32 or bfloat16 tensors (the dtype picks the
C entry point); callers check dtype, device and layout once, not here.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenloom.disk_cache import cache_dir
from tokenloom.ops import cpu_features, kernel_plan

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / name for name in ("paged_decode.c", "elementwise.c", "quant_gemm.c",
                                              "decode_step.c", "lora_decode.c", "amx_gemm.c", "bf16_dp_gemm.c",
                                              "f32_gemv.c", "f32_panel.c", "mxfp4_gemm.c",
                                              "lowp_gemm.c")]
# Every header (*.h, self-contained) and included fragment (*.inc, code included after the
# macros it is a template over) is part of the build's hash: a changed (or new) one builds anew.
_HEADERS = sorted([*_CSRC.glob("*.h"), *_CSRC.glob("*.inc")])
_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
# What takes the build down from the native target to a detected or requested narrower level.
_ISA_FLAGS = {"avx512": [], "avx2": ["-mno-avx512f"], "scalar": ["-mno-avx"]}
_LINK_FLAGS = ["-shared", "-fopenmp"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_isa: str | None = None  # the ISA level `_lib` was built for

_c_i64, _c_i32, _c_p, _c_f = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_float


def _compiler() -> str | None:
    cc = os.environ.get("CC", "cc")
    return shutil.which(cc)


def compile_flags(isa: str) -> list[str]:
    return [*_COMPILE_FLAGS, *_ISA_FLAGS[isa]]


def _build(cc: str, isa: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    features = cpu_features.detect()
    flags = compile_flags(isa)
    key = hashlib.sha256("\0".join([*(src.read_text() for src in _SOURCES + _HEADERS),
                                    " ".join(flags + _LINK_FLAGS), version, isa,
                                    " ".join(sorted(features.flags))]).encode()).hexdigest()[:16]
    out_dir = cache_dir("kernels")
    target = out_dir / f"tokenloom_cpu-{isa}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        objs = [Path(tmp) / f"{src.stem}.o" for src in _SOURCES]
        lib = Path(tmp) / "tokenloom_cpu.so"
        # Compile with -ffast-math but link without it: gcc would otherwise link crtfastmath.o,
        # which turns on flush-to-zero for the whole process when the library is loaded.
        # The sources compile side by side (the quantized GEMM alone takes seconds at -O3).
        procs = [subprocess.Popen([cc, *flags, "-c", str(src), "-o", str(obj)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for src, obj in zip(_SOURCES, objs)]
        for proc in procs:
            out, err = proc.communicate()
            if proc.returncode:
                raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
        subprocess.run([cc, *_LINK_FLAGS, *map(str, objs), "-o", str(lib), "-lm"],
                       check=True, capture_output=True, text=True)
        os.replace(lib, target)
    _prune(out_dir, keep=target)
    return target


def _prune(out_dir: Path, keep: Path, max_age_s: float = 7 * 24 * 3600) -> None:
    """Drops builds of other sources or flags older than a week, so that the cache does not grow
    with every version. A process that still has one loaded keeps its mapping."""
    now = time.time()
    for old in (*out_dir.glob("tokenloom_cpu-*.so"), *out_dir.glob("paged_decode-*.so")):
        try:
            if old != keep and now - old.stat().st_mtime > max_age_s:
                old.unlink()
        except OSError:  # another process pruned it first
            pass


def isa() -> str | None:
    """The ISA level the loaded kernels were built for, None when they are not in use."""
    return _isa if load() is not None else None


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declares the C signatures on a loaded library."""
    for fn in (lib.tl_paged_decode_f32, lib.tl_paged_decode_f32_bf16kv,
               lib.tl_paged_decode_bf16):
        fn.restype = _c_i32
        fn.argtypes = [_c_p, _c_i64, _c_p, _c_p, _c_p, _c_i64, _c_p, _c_p, _c_i64,
                       _c_i32, _c_i32, _c_i32, _c_i32, _c_i32, _c_f, _c_i32]
    for sfx in ("f32", "bf16"):
        fn = getattr(lib, f"tl_add_rms_norm_{sfx}")
        fn.restype = None
        fn.argtypes = [_c_p, _c_i64, _c_p, _c_i64, _c_p, _c_p, _c_i64, _c_i32, _c_i32, _c_f]
        fn = getattr(lib, f"tl_silu_and_mul_{sfx}")
        fn.restype = None
        fn.argtypes = [_c_p, _c_i64, _c_p, _c_i64, _c_i32, _c_i32]
        fn = getattr(lib, f"tl_rope_{sfx}")
        fn.restype = None
        fn.argtypes = [_c_p, _c_i64, _c_i32, _c_i32, _c_i32, _c_p, _c_p, _c_i64]
    lib.tl_argmax_f32.restype = None
    lib.tl_argmax_f32.argtypes = [_c_p, _c_i64, _c_i32, _c_i64, _c_p]
    lib.tl_f32_linear.restype = _c_i32
    lib.tl_f32_linear.argtypes = [_c_p, _c_i64, _c_i64, _c_p, _c_i64, _c_i64, _c_p, _c_i64, _c_p]
    lib.tl_f32_panel_linear.restype = _c_i32
    lib.tl_f32_panel_linear.argtypes = [_c_p, _c_i64, _c_i64, _c_p, _c_i64, _c_i64, _c_p, _c_i64, _c_p]
    return bind_mxfp4(lib)


def bind_mxfp4(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declares csrc/mxfp4_gemm.c's signatures (also on a library built from that source alone)."""
    lib.tl_mxfp4_linear.restype = _c_i32
    lib.tl_mxfp4_linear.argtypes = [_c_p, _c_p, _c_i64, _c_i64, _c_p, _c_i64, _c_i64, _c_p, _c_i64, _c_p]
    lib.tl_mxfp4_isa.restype = _c_i32
    lib.tl_mxfp4_isa.argtypes = []
    lib.tl_mxfp4_unpack.restype = _c_i32
    lib.tl_mxfp4_unpack.argtypes = [_c_p, _c_p, _c_i64, _c_i64, _c_p, _c_i32]
    return lib


_silu_tables: list[torch.Tensor] = []  # kept alive: the C libraries hold their addresses


def _set_silu_table(lib: ctypes.CDLL) -> None:
    """Hands the bf16 SiLU kernel F.silu's own result for each of the 65,536 bfloat16 values, so
    it rounds exactly as transformers' bf16 SiLU does (csrc/elementwise.c)."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    table = torch.zeros(65537, dtype=torch.bfloat16)
    table[:65536] = torch.nn.functional.silu(every)
    _silu_tables.append(table)
    lib.tl_set_silu_bf16_table.restype = None
    lib.tl_set_silu_bf16_table.argtypes = [_c_p]
    lib.tl_set_silu_bf16_table(table.data_ptr())


@functools.cache
def mkl_bf16_avx2_order() -> bool:
    """Whether MKL's bf16 gemm (cblas_gemm_bf16bf16f32, which torch's CPU flash attention calls
    for a bf16 decode query) sums a dot product in its AVX2 order on this CPU. MKL picks its
    kernel by the CPU, not only by its flags: on AMD's AVX512-BF16 CPUs it runs the AVX2 one,
    on Intel's AVX512-BF16 CPUs another. Probed once: in a row of 2^24 at element 0 and ones at
    1 and 5, the AVX2 order (four running sums of the elements i mod 4, paged_decode_chunk.inc)
    adds the two ones to each other first, 2^24 + 2; the AVX-512 one adds the first one to 2^24
    (rounding it away), 2^24."""
    try:
        gemm = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")).cblas_gemm_bf16bf16f32
    except (OSError, AttributeError):
        return False
    gemm.restype = None
    gemm.argtypes = [ctypes.c_int] * 6 + [_c_f, _c_p, ctypes.c_int, _c_p, ctypes.c_int, _c_f, _c_p,
                                          ctypes.c_int]
    row = torch.zeros(64)
    row[0], row[1], row[5] = 2.0 ** 24, 1.0, 1.0
    keys, q, out = row[None].bfloat16(), torch.ones(64).bfloat16(), torch.zeros(1)
    # column-major, keys transposed: out[0] = K^T q, as torch's kernel calls it
    gemm(102, 112, 111, 1, 1, 64, 1.0, keys.data_ptr(), 64, q.data_ptr(), 64, 0.0, out.data_ptr(), 1)
    return float(out[0]) == 2.0 ** 24 + 2


def _follow_mkl_order(lib: ctypes.CDLL) -> None:
    """Points the AVX-512 build's bf16 decode at MKL's AVX2 order where MKL runs it beside
    torch's AVX-512 vectors (csrc/paged_decode.c, g_mkl_avx2_order)."""
    lib.tl_paged_decode_set_mkl_avx2_order.restype = None
    lib.tl_paged_decode_set_mkl_avx2_order.argtypes = [_c_i32]
    torch_avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    lib.tl_paged_decode_set_mkl_avx2_order(int(torch_avx512 and mkl_bf16_avx2_order()))


def load_isa(level: str) -> ctypes.CDLL:
    """The kernels built for ISA `level` (one of cpu_features.ISA_LEVELS, at most what this CPU
    has), whatever `load()` chose: for benchmarks comparing the levels in one process."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler ($CC or cc)")
    lib = _bind(ctypes.CDLL(str(_build(cc, level))))
    _set_silu_table(lib)
    _follow_mkl_order(lib)
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it is disabled or cannot be built here."""
    global _lib, _tried, _isa
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        plan = kernel_plan.current()
        if not plan.c_kernels:
            return None
        cc = _compiler()
        if cc is None:
            logger.warning("no C compiler found ($CC or cc): the CPU path uses the slower "
                           "PyTorch ops")
            return None
        level = plan.cpu_isa
        try:
            path = _build(cc, level)
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            logger.warning("building the CPU kernels failed, using the PyTorch ops: %s", detail)
            return None
        _bind(lib)
        _set_silu_table(lib)
        _follow_mkl_order(lib)
        _lib, _isa = lib, level
        return _lib


def _fn(lib: ctypes.CDLL, name: str, x: torch.Tensor):  # noqa: ANN202 - a ctypes function
    """The float32 or bfloat16 entry point of kernel `name` for `x`'s dtype."""
    return getattr(lib, f"{name}_{'bf16' if x.dtype == torch.bfloat16 else 'f32'}")


def paged_decode(lib: ctypes.CDLL, query: torch.Tensor, kv_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                 scale: float, sliding_window: int | None = None) -> None:
    """Decode attention of `query` [B, Hq, D] (rows may be strided) over the paged cache
    `kv_cache` [2, num_blocks, block_size, Hkv, D] into `out` [B, Hq, D]; with `sliding_window`
    W each query sees only its last W positions (blocks before them are not read).

    `block_table` [B, >= max blocks] and `seq_lens` [B] are contiguous int32 CPU tensors; query
    and out are float32 over a float32 or bfloat16 cache, or all three bfloat16, on the CPU, with
    the head/row layout
    inside a row contiguous. The caller checks these once per step (the torch backend's plan),
    not here.

    `sliding_window` (a sliding-window layer's size, None or <= 0 for none): the query at position
    p = seq_len - 1 attends keys p - window < j <= p; blocks wholly before the window are not
    read, so their table entries may name any block."""
    B, Hq, D = query.shape
    _, _, bs, Hkv, _ = kv_cache.shape
    k_ptr = kv_cache.data_ptr()
    v_ptr = k_ptr + kv_cache.element_size() * kv_cache.stride(0)
    if query.dtype == torch.bfloat16:
        fn = lib.tl_paged_decode_bf16
    else:
        fn = lib.tl_paged_decode_f32_bf16kv if kv_cache.dtype == torch.bfloat16 else lib.tl_paged_decode_f32
    rc = fn(
        query.data_ptr(), query.stride(0), k_ptr, v_ptr,
        block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(),
        out.data_ptr(), out.stride(0), B, Hq, Hkv, D, bs, scale, sliding_window or 0)
    if rc == -3:
        raise MemoryError("CPU decode kernel: no memory for the partial results of a split "
                          "context")
    if rc != 0:
        raise ValueError(f"CPU decode kernel rejected the shapes (code {rc}): heads {Hq}/{Hkv}, "
                         f"head_dim {D}, block_size {bs}")


def bf16_decode_follows_torch() -> bool:
    """Whether a bfloat16 model's decode attention here is, bit for bit, torch's SDPA (what
    transformers in bfloat16 computes): where the loaded build's width and the CPU make MKL run
    the kernel whose summation order csrc/paged_decode_chunk.inc follows, read on AVX512-BF16 CPUs
    (the AVX-512 build, torch at AVX512; on those where MKL runs its AVX2 order, AMD's,
    the build follows that, `mkl_bf16_avx2_order`) and on AVX2-only ones (the AVX2 build, torch
    at AVX2). Elsewhere (an AVX-512 CPU without BF16, a build pinned narrower) the two agree to
    rounding."""
    feats = cpu_features.detect()
    torch_isa = torch.backends.cpu.get_cpu_capability()
    if isa() == "avx512":
        return feats.avx512_bf16 and torch_isa == "AVX512"
    return isa() == "avx2" and "avx512f" not in feats.flags and torch_isa == "AVX2"


def add_rms_norm(lib: ctypes.CDLL, x: torch.Tensor, residual: torch.Tensor | None,
                 weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of `x` [T, H] (of `residual += x` when `residual` is given, updated in place, as
    vLLM's fused_add_rms_norm), times `weight`; returns a new [T, H] tensor. Rows of `x` and
    `residual` may be strided, their elements contiguous."""
    T, H = x.shape
    out = torch.empty(T, H, dtype=x.dtype)
    _fn(lib, "tl_add_rms_norm", x)(x.data_ptr(), x.stride(0),
                            None if residual is None else residual.data_ptr(),
                            0 if residual is None else residual.stride(0),
                            weight.data_ptr(), out.data_ptr(), H, T, H, eps)
    return out


def silu_and_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    T, I2 = gate_up.shape
    out = torch.empty(T, I2 // 2, dtype=gate_up.dtype)
    _fn(lib, "tl_silu_and_mul", gate_up)(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), I2 // 2,
                            T, I2 // 2)
    return out


def rope_(lib: ctypes.CDLL, x: torch.Tensor, positions: torch.Tensor,
          cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of `x` [T, heads, D] in place (heads contiguous within a row, rows
    strided), position `positions[t]` (int64) read from the [max_pos, D] table `cos_sin`
    (cos | sin halves, float32 for either dtype of `x`). Returns `x`."""
    T, H, D = x.shape
    _fn(lib, "tl_rope", x)(x.data_ptr(), x.stride(0), T, H, D, positions.data_ptr(),
                    cos_sin.data_ptr(), cos_sin.stride(0))
    return x


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`x` [..., K] as 2-D rows whose elements are contiguous (a view when they are), and the
    rows' stride for the C matmuls (a lone row's own stride is arbitrary)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, (x2.stride(0) if x2.shape[0] > 1 else x2.shape[1])


def f32_linear(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for float32 `x` [..., K] (rows may be strided, elements
    contiguous) and a contiguous row-major float32 `weight` [N, K] and `bias` [N]: each output
    summed in one fixed order whatever the row count (csrc/f32_gemv.c)."""
    x2, ldx = _rows(x)
    N, K = weight.shape
    out = torch.empty(x2.shape[0], N, dtype=torch.float32)
    rc = lib.tl_f32_linear(weight.data_ptr(), N, K, x2.data_ptr(), ldx, x2.shape[0],
                           out.data_ptr(), N, None if bias is None else bias.data_ptr())
    if rc != 0:
        raise ValueError(f"f32_linear rejected the shapes: x {tuple(x.shape)}, weight {(N, K)}")
    return out.view(*x.shape[:-1], N)


PANEL_COLUMNS = 16  # csrc/f32_panel.c's NR


@dataclass(frozen=True, eq=False)
class F32Panels:
    """A float32 weight [out_features, in_features] packed by `f32_panel_pack`: what
    model/packed_linear keeps for a layer on AVX2 CPUs and the fused decode step multiplies."""

    data: torch.Tensor  # [ceil(out_features / 16), in_features, 16]
    out_features: int
    dtype = torch.float32  # what `packed_linear.linear` compares with the input's

    @property
    def in_features(self) -> int:
        return self.data.shape[1]


def f32_panel_pack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 [N, K] weight as csrc/f32_panel.c reads it: [ceil(N / 16), K, 16], panel p
    holding output columns 16p..16p+15 K-major, zeros past N."""
    N, K = weight.shape
    pad = -N % PANEL_COLUMNS
    w = torch.nn.functional.pad(weight.detach().float(), (0, 0, 0, pad)) if pad else weight.detach().float()
    return w.reshape(-1, PANEL_COLUMNS, K).transpose(1, 2).contiguous()


def f32_panel_rows(panels: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of the weight that `f32_panel_pack` packed into `panels`: `weight[rows]`, shape
    [*rows.shape, K], the same values (row r is column r % 16 of panel r // 16). The caller
    checks `rows` against the weight's row count (a row in the last panel's padding reads zeros)."""
    return panels[rows // PANEL_COLUMNS, :, rows % PANEL_COLUMNS]


def f32_panel_linear(lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, out_features: int,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for float32 `x` [..., K] (rows may be strided, elements
    contiguous) on `f32_panel_pack(weight)`, `weight` [out_features, K], and a contiguous float32
    `bias`: each output summed in one fixed order whatever the row count (csrc/f32_panel.c)."""
    x2, ldx = _rows(x)
    K = panels.shape[1]
    if (x2.shape[1] != K or panels.shape[0] != -(-out_features // PANEL_COLUMNS)
            or (bias is not None and bias.numel() != out_features)):
        raise ValueError(f"f32_panel_linear rejected the shapes: x {tuple(x.shape)}, panels "
                         f"{tuple(panels.shape)}, out_features {out_features}")
    out = torch.empty(x2.shape[0], out_features, dtype=torch.float32)
    rc = lib.tl_f32_panel_linear(panels.data_ptr(), out_features, K, x2.data_ptr(), ldx, x2.shape[0],
                                 out.data_ptr(), out_features, None if bias is None else bias.data_ptr())
    if rc != 0:
        raise ValueError(f"f32_panel_linear rejected the shapes: x {tuple(x.shape)}, out_features {out_features}")
    return out.view(*x.shape[:-1], out_features)


def mxfp4_linear(lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, mxfp4.dequantize(blocks, scales), bias)` for float32 `x` [..., K] (rows may be
    strided, elements contiguous), MXFP4 `blocks` [N, K / 32, 16] and `scales` [N, K / 32]
    (contiguous uint8) and a contiguous float32 `bias` [N], without the float weight
    (csrc/mxfp4_gemm.c): float32 [..., N], summed in its own order."""
    x2, ldx = _rows(x)
    N, G, _ = blocks.shape
    K = x2.shape[1]
    if (x.dtype != torch.float32 or G * 32 != K or scales.shape != (N, G) or not blocks.is_contiguous()
            or not scales.is_contiguous() or (bias is not None and bias.numel() != N)):
        raise ValueError(f"mxfp4_linear rejected the shapes: x {tuple(x.shape)} {x.dtype}, blocks "
                         f"{tuple(blocks.shape)}, scales {tuple(scales.shape)}")
    out = torch.empty(x2.shape[0], N, dtype=torch.float32)
    rc = lib.tl_mxfp4_linear(blocks.data_ptr(), scales.data_ptr(), N, K, x2.data_ptr(), ldx, x2.shape[0],
                             out.data_ptr(), N, None if bias is None else bias.data_ptr())
    if rc == -3:
        raise MemoryError("mxfp4_linear: no memory for the reordered activations")
    if rc != 0:
        raise ValueError(f"mxfp4_linear rejected the shapes (code {rc}): x {tuple(x.shape)}, N {N}")
    return out.view(*x.shape[:-1], N)


def mxfp4_unpack(lib: ctypes.CDLL, blocks: torch.Tensor, scales: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`mxfp4.dequantize(blocks, scales, dtype)` for contiguous uint8 `blocks` [N, K / 32, 16] and
    `scales` [N, K / 32], float32 or bfloat16 (csrc/mxfp4_gemm.c): [N, K]."""
    N, G, _ = blocks.shape
    if (dtype not in (torch.float32, torch.bfloat16) or scales.shape != (N, G) or not blocks.is_contiguous()
            or not scales.is_contiguous()):
        raise ValueError(f"mxfp4_unpack rejected blocks {tuple(blocks.shape)}, scales {tuple(scales.shape)}, {dtype}")
    out = torch.empty(N, G * 32, dtype=dtype)
    lib.tl_mxfp4_unpack(blocks.data_ptr(), scales.data_ptr(), N, G * 32, out.data_ptr(), int(dtype == torch.bfloat16))
    return out


def argmax_f32(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) of a float32 [T, V] tensor (rows may be strided): the first largest
    index of each row, a NaN counting as the largest. int64 [T]."""
    T, V = x.shape
    out = torch.empty(T, dtype=torch.int64)
    lib.tl_argmax_f32(x.data_ptr(), x.stride(0), T, V, out.data_ptr())
    return out

