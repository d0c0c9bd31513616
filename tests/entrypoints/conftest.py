"""A real `tokenloom serve` subprocess per test module that asks for one.

A module sets `SERVER_ARGS` (extra CLI arguments) and optionally `SERVER_API_KEY`, and uses the
module-scoped `server` fixture. The server and its engine-core child are gone when the module
ends (checked: no orphan).
"""
from __future__ import annotations

import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

STARTUP_TIMEOUT_S = 300.0  # a loaded 2-core machine can take minutes to import torch and load the model
TOKENLOOM = Path(sys.executable).with_name("tokenloom")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie is dead for our purposes
    except (FileNotFoundError, ProcessLookupError):
        return False


def child_pids(pid: int) -> list[int]:
    pids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return pids


def is_render_worker(pid: int) -> bool:
    """A chat-template render worker (entrypoints/openai/chat_render.py), not an engine core."""
    try:
        return b"render_worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def core_pids(pid: int) -> list[int]:
    """The children of a server that are not its render workers: its engine core(s)."""
    return [p for p in child_pids(pid) if not is_render_worker(p)]


class ServerProcess:
    def __init__(self, extra_args: list[str], api_key: str | None, num_cores: int | None = 1,
                 env: dict[str, str] | None = None, tls_ca: str | None = None) -> None:
        """`num_cores`: the engine-core children to expect (data parallelism starts several); None:
        do not check (with Ray the cores are Ray's workers, and Ray's daemons are our children).
        `tls_ca`: the server serves HTTPS (--ssl-* in `extra_args`) with a certificate of this CA."""
        self.port = free_port()
        self.api_key = api_key
        self.verify: ssl.SSLContext | bool = True if tls_ca is None else ssl.create_default_context(cafile=tls_ca)
        self.base_url = f"{'https' if tls_ca else 'http'}://127.0.0.1:{self.port}"
        args = [str(TOKENLOOM), "serve", "--port", str(self.port), *extra_args]
        if api_key is not None:
            args += ["--api-key", api_key]
        self.log = tempfile.NamedTemporaryFile(prefix="tokenloom-serve-", suffix=".log", delete=False)
        env = {k: v for k, v in os.environ.items() if k not in ("TOKENLOOM_API_KEY", "VLLM_API_KEY", "OPENAI_API_KEY")} | (env or {})
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()
        cores = core_pids(self.proc.pid)
        assert num_cores is None or len(cores) == num_cores, f"expected {num_cores} engine-core child(ren), found {cores}"
        self.core_pids = cores
        self.core_pid = cores[0] if cores else None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tokenloom serve exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(self.url("/health"), timeout=2, verify=self.verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"tokenloom serve not ready after {STARTUP_TIMEOUT_S}s:\n{self.log_text()}")

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-5000:]

    def url(self, path: str) -> str:
        return self.base_url + path

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}

    def client(self, **kwargs):
        import openai

        kwargs.setdefault("api_key", self.api_key or "unused")
        if self.verify is not True:
            kwargs.setdefault("http_client", httpx.Client(verify=self.verify))
        return openai.OpenAI(base_url=self.url("/v1"), max_retries=0, timeout=120, **kwargs)

    def async_client(self, **kwargs):
        import openai

        kwargs.setdefault("api_key", self.api_key or "unused")
        return openai.AsyncOpenAI(base_url=self.url("/v1"), max_retries=0, timeout=120, **kwargs)

    def metrics(self) -> dict[str, float]:
        """/metrics as {'name{labels}': value}, plus each unlabelled name summed over labels."""
        text = httpx.get(self.url("/metrics"), timeout=30).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
            name = re.sub(r"\{.*\}$", "", key)
            if name != key:
                values[name] = values.get(name, 0.0) + float(value)
        return values

    def wait_idle(self, timeout: float = 90.0) -> dict[str, float]:
        """Polls /metrics until nothing runs or waits and no KV block is held."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (
                m["tokenloom:num_requests_running"] == 0
                and m["tokenloom:num_requests_waiting"] == 0
                and m["tokenloom:num_kv_blocks_used"] == 0
            )
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def server(request):
    srv = ServerProcess(list(getattr(request.module, "SERVER_ARGS", [])), getattr(request.module, "SERVER_API_KEY", None))
    try:
        yield srv
    finally:
        srv.stop()
        core = getattr(srv, "core_pid", None)
        deadline = time.monotonic() + 10
        while core is not None and pid_alive(core) and time.monotonic() < deadline:
            time.sleep(0.1)
        orphan = core is not None and pid_alive(core)
        if orphan:
            os.kill(core, signal.SIGKILL)
        os.unlink(srv.log.name)
        assert not orphan, f"engine core {core} outlived its server"


@pytest.fixture(scope="session")
def float_llm():
    """SmolLM2 on the float path (float32, unquantized: what transformers' float32 reference
    computes), its engine core in its own process. One for the modules that only generate with it
    (test_llm, test_sampling_e2e: one xdist group, so one start-up): tests read its counters as
    differences and leave it idle, never assuming a fresh cache."""
    from tokenloom import LLM

    with LLM(dtype="float32", kv_cache_memory_bytes=256 * 1024**2, quantization=None) as llm:
        yield llm


DASHBOARD = Path(__file__).parents[2] / "examples" / "grafana" / "tokenloom.json"


@pytest.fixture(scope="session")
def dashboard_metrics():
    """The Grafana dashboard (examples/grafana/tokenloom.json) as Grafana imports it: a `panels`
    list whose Prometheus targets hold `expr`; returns a function giving the sample names its
    queries read with `$metrics_prefix` set to the given prefix."""
    import json

    dashboard = json.loads(DASHBOARD.read_text())
    assert isinstance(dashboard["panels"], list) and dashboard["panels"]
    exprs = []
    for panel in dashboard["panels"]:
        assert {"id", "type", "title", "gridPos", "targets"} <= set(panel), panel.get("title")
        for target in panel["targets"]:
            assert target["refId"] and target["expr"], panel["title"]
            exprs.append(target["expr"])
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])

    def names(prefix: str) -> set[str]:
        found: set[str] = set()
        for expr in exprs:
            expr = expr.replace("${metrics_prefix}", prefix).replace("$metrics_prefix", prefix)
            found |= set(re.findall(r"\b((?:tokenloom|vllm):[A-Za-z0-9_:]+)", expr))
        return found

    return names
