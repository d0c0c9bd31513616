"""Runs the CPU kernels' AVX-512 code on a CPU that does not have it: the kernels of
src/tokenloom/ops/csrc, compiled as a Zen 4's `-march=native` build would compile them, linked
into a static image without an operating system (runtime.c), and called one function at a time
inside Bochs' x86 emulator (the `bochscpu` wheel, its Sapphire Rapids model: AVX-512
F/BW/VL/DQ/CD, VNNI, BF16). Exact but far slower than the hardware, and blind to speed: it lets
an AVX2 machine's test run check the results of code that only AVX-512 machines would otherwise run.

`Image.build()` compiles; `Image.run(calls, buffers)` emulates a list of calls in a child process
(bochscpu keeps one CPU per process, set up before its first use) and returns their return values
and the buffers as they were left. Arguments are ints, `Buf("name", offset)` addresses and
`F32(value)` floats."""
from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[2] / "src" / "tokenloom" / "ops" / "csrc"
SOURCES = ["quant_gemm.c", "f32_panel.c", "f32_gemv.c", "paged_decode.c", "elementwise.c", "mxfp4_gemm.c",
           "amx_gemm.c", "bf16_dp_gemm.c"]
# What GCC's -march=native enables on a Zen 4 (GCC 12 has no -march=znver4), i.e. the build
# cpu_kernels makes there; the emulated Sapphire Rapids runs all of it.
ZEN4 = ["-march=znver3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512cd",
        "-mavx512vnni", "-mavx512bf16", "-mavx512ifma", "-mavx512vbmi", "-mavx512vbmi2",
        "-mavx512bitalg", "-mavx512vpopcntdq", "-mgfni", "-mvpclmulqdq", "-mvaes"]
# cpu_kernels' flags without -fopenmp (the pragmas fall away: one thread) and -fPIC.
KERNEL_FLAGS = ["-O3", "-ffast-math", "-fno-stack-protector", "-fcf-protection=none"]
CPU_INDEX = 30  # Bochs' cpudb.h: sapphire_rapids
PAGE = 4096
TEXT = 0x40_0000
HALT = 0x6000_0000  # the return address of every call: a ud2 that ends the run
STACK = 0x7000_0000
STACK_BYTES = 1 << 20
TLS = 0x7800_0000  # the kernels' __thread buffers: below the thread pointer, which sits mid-block
TLS_BYTES = 64 * 1024
DATA = 0x1_0000_0000
ENV_BYTES = 4096


@dataclass(frozen=True)
class Buf:
    """The address of buffer `name` (plus `offset` bytes)."""
    name: str
    offset: int = 0


@dataclass(frozen=True)
class F32:
    """A float argument (SysV: in the next xmm register)."""
    value: float


def _bochs_library() -> str | None:
    try:
        import importlib.util
        spec = importlib.util.find_spec("bochscpu")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for lib in Path(folder).glob("_bochscpu*.so"):
            return str(lib)
    return None


def unavailable() -> str | None:
    """Why the emulator cannot run here (None: it can)."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return "the emulator image is x86-64 Linux only"
    if shutil.which("gcc") is None:
        return "no gcc"
    if _bochs_library() is None:
        return "bochscpu-python is not installed"
    return None


class Image:
    def __init__(self, path: Path, symbols: dict[str, int], shim: Path):
        self.path, self.symbols, self.shim = path, symbols, shim

    @classmethod
    def build(cls, out: Path) -> Image:
        out.mkdir(parents=True, exist_ok=True)
        key = hashlib.sha256()
        for p in sorted([*CSRC.glob("*.[ch]"), *CSRC.glob("*.inc")]) + [HERE / "runtime.c", HERE / "glibc_shim.c"]:
            key.update(p.name.encode() + p.read_bytes())
        key.update(" ".join(ZEN4 + KERNEL_FLAGS).encode())
        tag = key.hexdigest()[:16]
        image, shim = out / f"kernels-{tag}.elf", out / f"glibc_shim-{tag}.so"
        if not image.exists() or not shim.exists():
            # Built in a folder of its own and renamed into place: concurrent runs share the cache.
            with tempfile.TemporaryDirectory(dir=out) as tmp:
                objs = []
                for src in SOURCES:
                    obj = Path(tmp) / f"{Path(src).stem}.o"
                    _cc(["gcc", *KERNEL_FLAGS, *ZEN4, "-c", str(CSRC / src), "-o", str(obj)])
                    objs.append(obj)
                rt = Path(tmp) / "runtime.o"
                _cc(["gcc", "-O2", *ZEN4, "-fno-builtin", "-ffreestanding", "-fno-stack-protector",
                     "-fcf-protection=none", "-fno-tree-loop-distribute-patterns", "-c",
                     str(HERE / "runtime.c"), "-o", str(rt)])
                _cc(["gcc", "-nostdlib", "-static", "-no-pie", f"-Wl,-Ttext-segment={TEXT:#x}",
                     "-Wl,--build-id=none", "-Wl,-e,tl_emu_init", *map(str, objs), str(rt),
                     "-lgcc", "-o", str(Path(tmp) / image.name)])
                _cc(["gcc", "-O2", "-shared", "-fPIC", str(HERE / "glibc_shim.c"), "-o",
                     str(Path(tmp) / shim.name), "-ldl"])
                os.replace(Path(tmp) / image.name, image)
                os.replace(Path(tmp) / shim.name, shim)
        nm = subprocess.run(["nm", "--defined-only", str(image)], capture_output=True, text=True,
                            check=True).stdout
        symbols = {}
        for line in nm.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] in "TtDdBbRr":
                symbols[parts[2]] = int(parts[0], 16)
        return cls(image, symbols, shim)

    def run(self, calls: list[tuple[str, list]], buffers: dict[str, bytes],
            env: dict[str, str] | None = None, heap_bytes: int = 64 << 20,
            timeout: float = 600) -> tuple[list[int], dict[str, bytes]]:
        """Emulates `calls` [(function, args)] in order on one image, sharing `buffers`.
        Returns each call's rax and the buffers after the last call."""
        for fn, _ in calls:
            if fn not in self.symbols:
                raise KeyError(f"{fn} is not in the emulator image")
        def plain_arg(a):
            if isinstance(a, Buf):
                return ("buf", a.name, a.offset)
            if isinstance(a, F32):
                return ("f32", struct.unpack("<I", struct.pack("<f", a.value))[0])
            return int(a)
        plain = [(fn, [plain_arg(a) for a in args]) for fn, args in calls]
        job = {"image": str(self.path), "symbols": self.symbols, "calls": plain,
               "buffers": buffers, "env": env or {}, "heap_bytes": heap_bytes}
        with tempfile.TemporaryDirectory() as tmp:
            jf, rf = Path(tmp) / "job.pkl", Path(tmp) / "result.pkl"
            jf.write_bytes(pickle.dumps(job))
            child_env = dict(os.environ, LD_PRELOAD=str(self.shim), EMU_CPU_INDEX=str(CPU_INDEX),
                             EMU_BOCHS_SO=_bochs_library() or "")
            proc = subprocess.run([sys.executable, __file__, str(jf), str(rf)], env=child_env,
                                  capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0 or not rf.exists():
                raise RuntimeError(f"emulator failed (exit {proc.returncode}):\n"
                                   f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            result = pickle.loads(rf.read_bytes())
        if "error" in result:
            raise RuntimeError(result["error"])
        return result["returns"], result["buffers"]


def _cc(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\n{proc.stderr[-4000:]}")


def _load_segments(path: str) -> list[tuple[int, bytes, int]]:
    """(vaddr, file bytes, memory size) of each PT_LOAD of a static ELF64 image."""
    data = Path(path).read_bytes()
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    segs = []
    for i in range(phnum):
        p_type, _flags, off, vaddr, _paddr, filesz, memsz, _align = struct.unpack_from(
            "<IIQQQQQQ", data, phoff + i * phentsize)
        if p_type == 1:
            segs.append((vaddr, data[off:off + filesz], memsz))
    return segs


def _serve(job_file: str, result_file: str) -> None:
    """The child: one emulated CPU, the job's calls in order."""
    import bochscpu
    import bochscpu.cpu
    import bochscpu.memory

    job = pickle.loads(Path(job_file).read_bytes())
    sess = bochscpu.Session()
    faults = []
    sess.missing_page_handler = lambda gpa: faults.append(gpa)
    table = bochscpu.memory.PageMapLevel4Table()
    pml4 = 0x1000
    next_gpa = [0x10_0000]
    mapped = set()

    def map_range(va: int, size: int) -> None:
        for page in range(va & ~(PAGE - 1), va + size, PAGE):
            if page in mapped:
                continue
            hva = bochscpu.memory.allocate_host_page()
            gpa = next_gpa[0]
            next_gpa[0] += PAGE
            bochscpu.memory.page_insert(gpa, hva)
            table.insert(page, gpa, 1)
            mapped.add(page)

    def write(va: int, data: bytes) -> None:
        if data and not bochscpu.memory.virt_write(pml4, va, list(data)):
            raise RuntimeError(f"write of {len(data)} bytes at {va:#x} failed")

    def read(va: int, n: int) -> bytes:
        return bytes(bochscpu.memory.virt_read(pml4, va, n)) if n else b""

    segs = _load_segments(job["image"])
    for vaddr, _data, memsz in segs:
        map_range(vaddr, memsz)
    map_range(HALT, PAGE)
    map_range(STACK, STACK_BYTES)
    map_range(TLS, TLS_BYTES)
    addrs, at = {}, DATA
    for name, data in job["buffers"].items():
        addrs[name] = at
        map_range(at, max(len(data), 1))
        at += (len(data) + 2 * PAGE - 1) // PAGE * PAGE  # a page apart: overruns fault
    env_at = at
    heap_at = env_at + ENV_BYTES
    map_range(env_at, ENV_BYTES + job["heap_bytes"])
    for hva, gpa in table.commit(pml4):
        bochscpu.memory.page_insert(gpa, hva)
    for vaddr, data, memsz in segs:
        write(vaddr, data + bytes(memsz - len(data)))
    write(HALT, b"\x0f\x0b")  # ud2
    thread_pointer = TLS + TLS_BYTES // 2
    write(thread_pointer, struct.pack("<Q", thread_pointer))  # %fs:0 points at itself
    for name, data in job["buffers"].items():
        write(addrs[name], data)
    env = b"".join(f"{k}={v}".encode() + b"\0" for k, v in job["env"].items()) + b"\0"
    if len(env) > ENV_BYTES:
        raise ValueError("environment too large for the emulator image")
    write(env_at, env)

    def arg(a) -> int:
        if isinstance(a, tuple):  # ("buf", name, offset)
            return addrs[a[1]] + a[2]
        return int(a) & (2**64 - 1)

    def call(fn: str, args: list) -> int:
        st = bochscpu.State()
        bochscpu.cpu.set_long_mode(st)
        cr4 = bochscpu.cpu.ControlRegister(st.cr4)
        cr4.OSXSAVE = cr4.OSFXSR = cr4.OSXMMEXCPT = True
        st.cr4 = int(cr4)
        st.xcr0 = 0xE7  # x87, SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM
        st.mxcsr = 0x1F80
        st.cr3 = pml4
        rsp = STACK + STACK_BYTES - PAGE  # 16-byte aligned (+ 8 at entry, as after a call); room above for stack arguments
        write(rsp - 8, struct.pack("<Q", HALT))
        st.rsp = rsp - 8
        st.rip = job["symbols"][fn]
        floats = [a[1] for a in args if isinstance(a, tuple) and a[0] == "f32"]
        ints = [arg(a) for a in args if not (isinstance(a, tuple) and a[0] == "f32")]
        if len(floats) > 8:
            raise ValueError(f"{fn}: more than 8 float arguments")
        for i, v in enumerate(ints[6:]):
            write(rsp + 8 * i, struct.pack("<Q", v))
        for r, v in zip(["rdi", "rsi", "rdx", "rcx", "r8", "r9"], ints[:6]):
            setattr(st, r, v)
        if floats:
            zmm = st.zmm
            for i, bits in enumerate(floats):
                zmm[i].q = [bits] + [0] * 7
            st.zmm = zmm
        cs = bochscpu.Segment()
        cs.present, cs.selector, cs.base, cs.limit, cs.attr = True, 0x33, 0, 0xFFFFFFFF, 0x22FB
        ds = bochscpu.Segment()
        ds.present, ds.selector, ds.base, ds.limit, ds.attr = True, 0x2B, 0, 0xFFFFFFFF, 0xCF3
        fs = bochscpu.Segment()
        fs.present, fs.selector, fs.base, fs.limit, fs.attr = True, 0x2B, thread_pointer, 0xFFFFFFFF, 0xCF3
        st.cs, st.ds, st.ss, st.es, st.gs, st.fs = cs, ds, ds, ds, ds, fs
        sess.cpu.state = st
        outcome = {}

        def exception(s, cpu_id, vector, error_code):
            rip = s.cpu.state.rip
            outcome["exc"] = (int(vector), int(error_code), rip)
            s.stop()

        hook = bochscpu.Hook()
        hook.exception = exception
        sess.run([hook])
        vector, error_code, rip = outcome.get("exc", (-1, 0, 0))
        if vector == 6 and rip in (HALT, HALT + 2):  # (Bochs reports the ud2's end)
            return sess.cpu.state.rax
        raise RuntimeError(f"{fn}: exception {vector} (error code {error_code}) at {rip:#x}"
                           f"{' (' + _symbol_at(job['symbols'], rip) + ')' if rip else ''}"
                           f"{'; unmapped pages ' + str([hex(g) for g in faults]) if faults else ''}")

    try:
        returns = [call("tl_emu_init", [heap_at, job["heap_bytes"], env_at])]
        for fn, args in job["calls"]:
            returns.append(call(fn, args))
        out = {"returns": returns[1:],
               "buffers": {n: read(addrs[n], len(d)) for n, d in job["buffers"].items()}}
    except RuntimeError as e:
        out = {"error": str(e)}
    Path(result_file).write_bytes(pickle.dumps(out))


def _symbol_at(symbols: dict[str, int], addr: int) -> str:
    best = max(((a, n) for n, a in symbols.items() if a <= addr), default=(0, "?"))
    return f"{best[1]}+{addr - best[0]:#x}"


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2])
