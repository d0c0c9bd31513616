"""LoRA adapters on `tokenloom serve` with the official `openai` client: `--lora-modules` serves each
adapter as a model of its own name (listed by /v1/models with its parent), a request's `model`
picks it on every endpoint, and with VLLM_ALLOW_RUNTIME_LORA_UPDATING adapters are loaded and
unloaded while the server runs. Tokens are checked against transformers + peft."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import httpx
import openai
import pytest

_spec = importlib.util.spec_from_file_location(
    "tokenloom_tests_server_helpers", Path(__file__).resolve().parents[1] / "entrypoints" / "conftest.py")
server_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server_helpers)


@pytest.fixture(scope="module")
def server(tiny):
    base_dir, adapters, _ = tiny
    args = ["--model", base_dir, "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "128",
            "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"all={adapters['all']}",
            json.dumps({"name": "qv", "path": adapters["qv"]})]
    srv = server_helpers.ServerProcess(args, None, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    try:
        yield srv
    finally:
        srv.stop()
        os.unlink(srv.log.name)


def completion_ids(client, model: str, prompt: str) -> list[int]:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    return [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]


def test_adapters_are_models_of_their_own_name(server, tiny, references):
    base_dir, adapters, _ = tiny
    client = server.client()
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {base_dir, "all", "qv"}
    assert models["all"].parent == base_dir and models["all"].root == adapters["all"]
    prompt = "Once upon a time"
    i = ["The capital of France is", "Once upon a time", "1, 2, 3,"].index(prompt)
    for name in ("all", "qv"):
        assert completion_ids(client, name, prompt) == references[name][i], name
    assert completion_ids(client, base_dir, prompt) == references["base"][i]
    # Chat, streamed, with the adapter: the same reply as unstreamed.
    messages = [{"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model="all", messages=messages, max_tokens=8, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="all", messages=messages, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == whole.choices[0].message.content
    base = client.chat.completions.create(model=base_dir, messages=messages, max_tokens=8, temperature=0)
    assert base.choices[0].message.content != whole.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=prompt, max_tokens=2)


def test_adapters_load_and_unload_at_run_time(server, tiny, references):
    _, adapters, _ = tiny
    client = server.client()
    r = httpx.post(server.url("/v1/load_lora_adapter"), json={"lora_name": "qv2", "lora_path": adapters["qv"]}, timeout=60)
    assert r.status_code == 200, r.text
    assert completion_ids(client, "qv2", "1, 2, 3,") == references["qv"][2]
    again = httpx.post(server.url("/v1/load_lora_adapter"), json={"lora_name": "qv2", "lora_path": adapters["qv"]}, timeout=60)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    bad = httpx.post(server.url("/v1/load_lora_adapter"), json={"lora_name": "x", "lora_path": "/nowhere"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path", bad.text
    assert httpx.post(server.url("/v1/unload_lora_adapter"), json={"lora_name": "qv2"}, timeout=60).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="qv2", prompt="Hi", max_tokens=2)
    gone = httpx.post(server.url("/v1/unload_lora_adapter"), json={"lora_name": "qv2"}, timeout=60)
    assert gone.status_code == 404
