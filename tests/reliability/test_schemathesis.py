"""Schemathesis against the live server's own OpenAPI document (/openapi.json, which documents the
request bodies): generated requests, valid and invalid, never get a 5xx.

Bounded: TOKENLOOM_SCHEMATHESIS_EXAMPLES (25) per operation, the fuzzing and stateful phases
(positive and negative data), one worker, and valid length fields brought down to 2 by the hooks
(schemathesis_hooks.py), so no generated request runs long. The hand-picked boundary cases are in
test_bad_input.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from reliability_helpers import API_KEY, AUTH, SMALL_SERVER_ARGS, running_server, wait_until_clean

ST = Path(sys.executable).with_name("st")
HOOKS = Path(__file__).with_name("schemathesis_hooks.py")
EXAMPLES = int(os.environ.get("TOKENLOOM_SCHEMATHESIS_EXAMPLES", "25"))
# The stateful phase chains operations through the schema's links; TOKENLOOM_SCHEMATHESIS_PHASES
# widens the run (e.g. "examples,coverage,fuzzing,stateful" for the long one in the report).
PHASES = os.environ.get("TOKENLOOM_SCHEMATHESIS_PHASES", "fuzzing,stateful")


def run_schemathesis(srv, tmp_path, *extra: str, phases: str = PHASES, examples: int = EXAMPLES) -> None:
    """Schemathesis over `srv`'s operations (those `extra` selects), asserting no 5xx, then that
    the server is still healthy, idle and serving."""
    cmd = [
        str(ST), "run", srv.url("/openapi.json"),
        "--checks", "not_a_server_error",
        "--phases", phases,  # the coverage phase alone sends ~700 boundary cases
        "--max-examples", str(examples),
        "--workers", "1",
        "--seed", "1",
        "--request-timeout", "120",
        "--suppress-health-check", "all",
        "--header", f"Authorization: Bearer {API_KEY}",
        *extra,
    ]  # fmt: skip
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS), "NO_COLOR": "1"}
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    summary = out.stdout[-3000:] + out.stderr[-2000:]
    print(summary[-600:])
    assert out.returncode == 0, summary
    assert "generated" in out.stdout and " passed" in out.stdout, summary
    # Still healthy, idle and serving afterwards.
    assert httpx.get(srv.url("/health"), timeout=30).status_code == 200
    assert wait_until_clean(srv), srv.metrics()
    r = httpx.post(srv.url("/v1/completions"), headers=AUTH, json={"prompt": "Hi", "max_tokens": 1}, timeout=120)
    assert r.status_code == 200, r.text


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(shared_server, tmp_path):
    schema = httpx.get(shared_server.url("/openapi.json"), headers=AUTH, timeout=30).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert "$defs" not in str(body) and body["properties"], path  # documented, self-contained
    run_schemathesis(shared_server, tmp_path)


@pytest.mark.slow
def test_schemathesis_on_the_open_surface(tmp_path):
    """The fields a hostile client reaches for, opened up as far as an operator can: request
    chat templates trusted (rendered under a 2 s limit), LoRA adapters loaded at run time, and
    the structured-output fields (guided_*, structured_outputs, response_format) under their
    limits: the chat, completion and LoRA routes, no 5xx."""
    args = [*SMALL_SERVER_ARGS, "--trust-request-chat-template", "--chat-template-timeout", "2", "--enable-lora"]
    with running_server(args, API_KEY, env={"TOKENLOOM_ALLOW_RUNTIME_LORA_UPDATING": "true"}) as srv:
        # Fuzzing alone: the stateful phase follows links to routes this run leaves out.
        run_schemathesis(srv, tmp_path, "--include-path-regex", "^/v1/(chat/completions|completions|(load|unload)_lora_adapter)$",
                         phases="fuzzing", examples=4 * EXAMPLES)
