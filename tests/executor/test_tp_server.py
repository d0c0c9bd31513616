"""`tokenloom serve --tensor-parallel-size 2`, queried with the openai client: it answers what one
rank answers; and a rank killed mid-run ends every request in flight with the engine-death error
(no hang), after which the server exits and leaves no worker behind."""
from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import time
from pathlib import Path

import openai
import pytest

from tokenloom import LLM, SamplingParams

pytestmark = pytest.mark.tp

_spec = importlib.util.spec_from_file_location(
    "tokenloom_tests_server_helpers", Path(__file__).resolve().parents[1] / "entrypoints" / "conftest.py")
server_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server_helpers)

PROMPTS = ["The quick brown fox", "Once upon a time,"]


@pytest.mark.slow
def test_served_two_ranks_answer_like_one_and_die_cleanly(tiny_model_dir):
    model = tiny_model_dir("llama")
    with LLM(model, dtype="float32", multiprocess=False) as whole:
        want = [o.outputs[0].text for o in whole.generate(
            PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)]

    srv = server_helpers.ServerProcess(["--model", model, "--dtype", "float32", "--tensor-parallel-size", "2",
                                        "--max-model-len", "512"], None)
    core = srv.core_pid
    try:
        # One process per rank, children of the engine core (beside multiprocessing's resource tracker).
        workers = [p for p in server_helpers.child_pids(core)
                   if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(workers) == 2, workers
        client = srv.client()
        served = client.models.list().data[0].id
        got = [client.completions.create(model=served, prompt=p, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
        assert got == want

        async def kill_mid_run() -> list:
            async with srv.async_client() as aclient:
                started = asyncio.Event()

                async def streamed(i: int):
                    stream = await aclient.completions.create(
                        model=served, prompt=f"Story {i}:", stream=True, max_tokens=400, temperature=0,
                        extra_body={"ignore_eos": True})
                    try:
                        async for _ in stream:
                            started.set()
                    except openai.APIError as e:
                        return e
                    return None

                tasks = [asyncio.ensure_future(streamed(i)) for i in range(2)]
                await asyncio.wait_for(started.wait(), 120)
                os.kill(workers[1], signal.SIGKILL)
                return await asyncio.wait_for(asyncio.gather(*tasks), 120)

        errors = asyncio.run(kill_mid_run())
        assert all(e is not None and "dead" in str(e).lower() for e in errors), errors
        srv.proc.wait(timeout=60)
        assert srv.proc.returncode == 1, srv.log_text()
        assert "tensor-parallel worker rank 1" in srv.log_text()
        deadline = time.monotonic() + 15
        while any(map(server_helpers.pid_alive, [core, *workers])) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(server_helpers.pid_alive, [core, *workers])), "a process outlived the server"
    finally:
        srv.stop()
        for pid in [core, *server_helpers.child_pids(core)]:
            if server_helpers.pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        os.unlink(srv.log.name)
