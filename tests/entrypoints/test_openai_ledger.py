"""The ledger behind `tokenloom serve`: after a mixed run (chat and completions, streamed and not,
n=2, a stop string, a client that leaves mid-stream), every finished request carried the engine
core's account exactly once, so the histograms agree with each other and nothing is
unattributed."""
from __future__ import annotations

import asyncio

import httpx

SERVER_ARGS = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(64 * 1024**2), "--served-model-name", "tiny"]
MODEL = "tiny"


def _count(m: dict[str, float], name: str) -> float:
    return m.get(f"{name}_count", 0.0)


def test_mixed_run_every_request_accounted_once(server):
    async def completion(aclient, i: int, **kw):
        kw.setdefault("temperature", 0)
        return await aclient.completions.create(model=MODEL, prompt=f"{i} little pigs went", max_tokens=5, **kw)

    async def chat(aclient, i: int, **kw):
        kw.setdefault("temperature", 0)
        return await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=5, **kw)

    async def drain(stream, quit_after: int | None = None):
        n = 0
        async for _ in stream:
            n += 1
            if quit_after is not None and n >= quit_after:
                await stream.close()  # the client goes away mid-stream
                return n
        return n

    async def run():
        async with server.async_client() as c:
            jobs = [
                completion(c, 1),
                completion(c, 2, n=2, temperature=1.0, extra_body={"seed": 3}),
                chat(c, 3),
                chat(c, 4, n=2, temperature=1.0, extra_body={"seed": 4}),
                completion(c, 5, stop=[" "], extra_body={"ignore_eos": True}),  # ended by the caller
                chat(c, 6, stop=[" "]),
            ]
            streams = [
                await completion(c, 7, stream=True),
                await completion(c, 8, stream=True, n=2, temperature=1.0, extra_body={"seed": 5}),
                await chat(c, 9, stream=True),
                await chat(c, 10, stream=True, n=2, temperature=1.0, extra_body={"seed": 6}),
            ]
            quitter = await c.completions.create(model=MODEL, prompt="A very long story:", max_tokens=200,
                                                 stream=True, extra_body={"ignore_eos": True})
            await asyncio.gather(*jobs, *(drain(s) for s in streams), drain(quitter, quit_after=2))
            return len(jobs) + len(streams) + 1

    before = server.metrics()
    num = asyncio.run(run())
    # A client that leaves while its non-streamed request runs.
    try:
        httpx.post(server.url("/v1/completions"), json={"model": MODEL, "prompt": "Once", "max_tokens": 200,
                                                          "ignore_eos": True}, timeout=httpx.Timeout(30, read=0.5))
    except httpx.ReadTimeout:
        pass
    num += 1
    after = server.wait_idle()

    def grew(name: str) -> float:
        return _count(after, name) - _count(before, name)

    e2e = grew("tokenloom:e2e_request_latency_seconds")
    assert e2e == num
    # Every request, aborted ones included, carried the core's account, once.
    for name in ("tokenloom:request_queue_time_seconds", "tokenloom:request_prefill_time_seconds",
                 "tokenloom:request_decode_time_seconds", "tokenloom:request_inference_time_seconds"):
        assert grew(name) == e2e, name
    assert after.get('tokenloom:request_part_seconds_total{model_name="tiny",part="core_unattributed"}', 0.0) == 0.0
    dominant = sum(v for k, v in after.items() if k.startswith("tokenloom:requests_by_dominant_wait_total{"))
    dominant_before = sum(v for k, v in before.items() if k.startswith("tokenloom:requests_by_dominant_wait_total{"))
    assert dominant - dominant_before == num
    aborted = sum(v for k, v in after.items() if k.startswith("tokenloom:request_success_total{") and "abort" in k)
    assert aborted >= 1


def test_grafana_dashboard_queries_exist(server, dashboard_metrics):
    names = dashboard_metrics("tokenloom")
    assert len(names) >= 15
    missing = sorted(n for n in names if n not in server.metrics())
    assert not missing, missing


def test_live_ledger_view(server, tmp_path):
    """`GET /ledger`: the last steps and the requests in flight with their state in the core;
    `?format=trace` is what `tokenloom explain --url` draws."""
    import subprocess
    import sys
    import threading

    # A long request in flight while the view is read.
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True}
    thread = threading.Thread(target=lambda: httpx.post(server.url("/v1/completions"), json=body, timeout=120))
    thread.start()
    try:
        view = {}
        for _ in range(200):
            view = httpx.get(server.url("/ledger"), params={"steps": 5}, timeout=30).json()
            if view["in_flight"] and view["in_flight"][0].get("state") in ("decode", "prefill"):
                break
        assert view["in_flight"], view
        row = view["in_flight"][0]
        assert row["state"] in ("decode", "prefill") and row["in_core_s"] >= row["in_state_s"] >= 0
        assert 0 < len(view["steps"]) <= 5
        assert {"step", "prefill", "decode", "budget", "running", "waiting", "age_s"} <= set(view["steps"][-1])
    finally:
        thread.join()
    view = httpx.get(server.url("/ledger"), params={"requests": 3}, timeout=30).json()
    assert len(view["finished"]) == 3 and all("parts" in r for r in view["finished"])
    assert httpx.get(server.url("/ledger"), params={"steps": "x"}).status_code == 400

    png = tmp_path / "live.png"
    proc = subprocess.run([sys.executable, "-m", "tokenloom.entrypoints.cli", "explain", "--url", server.base_url,
                           "--plot", str(png)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "verdict:" in proc.stdout and png.read_bytes()[:4] == b"\x89PNG"
