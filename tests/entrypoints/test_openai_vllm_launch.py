"""`tokenloom serve` started as a vLLM launch script starts vLLM: its flag spellings, its API-key
variable, CORS for browser clients, and its /tokenize, /detokenize and /ping routes, with the real
server and the official `openai` client."""
from __future__ import annotations

import os
import shutil
import tempfile

import httpx
import openai
import pytest
from conftest import ServerProcess, pid_alive

VLLM_KEY = "vllm-env-key-42"
ORIGIN = "http://app.example"
# A template of our own, so the reply's prompt is visibly the server's --chat-template.
TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}<<assistant>>"
MODEL = "tiny"


@pytest.fixture(scope="module")
def vllm_style_server():
    with tempfile.NamedTemporaryFile("w", suffix=".jinja", delete=False) as f:
        f.write(TEMPLATE)
    args = ["--max_model_len", "256", "--dtype", "float", "--enable-prefix-caching", "--enable-auto-tool-choice",
            "--chat-template", f.name, "--response-role", "helper", "--allowed-origins", f'["{ORIGIN}"]',
            "--disable-log-requests", "--disable-log-stats", "--trust-remote-code", "--served-model-name", MODEL,
            "--kv-cache-memory-bytes", str(64 * 1024**2), "--enable-prompt-tokens-details",
            "--return-tokens-as-token-ids", "--disable-fastapi-docs", "--enable-force-include-usage",
            "--enable-log-requests", "--max-log-len", "16"]
    traces = tempfile.mkdtemp(prefix="tokenloom-traces-")
    srv = ServerProcess(args, api_key=None, env={"VLLM_API_KEY": VLLM_KEY, "VLLM_TORCH_PROFILER_DIR": traces})
    srv.api_key = VLLM_KEY  # what the clients below send
    try:
        yield srv
    finally:
        srv.stop()
        if srv.core_pid is not None and pid_alive(srv.core_pid):
            os.kill(srv.core_pid, 9)
        os.unlink(srv.log.name)
        os.unlink(f.name)
        shutil.rmtree(traces, ignore_errors=True)


def test_vllm_flags_start_the_server_and_say_what_runs(vllm_style_server):
    srv = vllm_style_server
    (card,) = srv.client().models.list().data
    assert card.id == MODEL and card.model_extra["max_model_len"] == 256  # --max_model_len, underscores
    log = srv.log_text()
    assert "--trust-remote-code is vLLM's and has no effect" in log
    # The start-up lines name the model, its path and the cache, without --log-level info.
    assert "tokenloom serve: model" in log and "max_model_len 256" in log and "quantization gguf Q4_1" in log


def test_docs_off_usage_forced_and_logged_prompts_cut(vllm_style_server):
    """--disable-fastapi-docs, --enable-force-include-usage (a stream that did not ask ends with
    usage), --enable-log-requests with --max-log-len."""
    srv = vllm_style_server
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(srv.url(path), headers=srv.headers, timeout=30).status_code == 404
    question = "Tell me something about the river Seine, please."
    chunks = list(srv.client().chat.completions.create(model=MODEL, max_tokens=3, stream=True,
                                                       messages=[{"role": "user", "content": question}]))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    chunks = list(srv.client().completions.create(model=MODEL, prompt=question, max_tokens=2, stream=True))
    assert chunks[-1].choices == [] and 1 <= chunks[-1].usage.completion_tokens <= 2
    logged = [line for line in srv.log_text().splitlines() if "Received request" in line and "Seine" not in line
              and "prompt: " in line]
    shown = logged[-1].split("prompt: ", 1)[1].split(", params: ")[0]
    assert len(shown) == 16 and repr(question).startswith(shown)


def test_profiling_routes_with_vllms_profiler_dir(vllm_style_server):
    """With VLLM_TORCH_PROFILER_DIR set, vLLM's POST /start_profile and /stop_profile (behind the
    key) trace the engine core's steps; a second stop is a 400."""
    srv = vllm_style_server
    assert httpx.post(srv.url("/start_profile"), timeout=60).status_code == 401
    assert httpx.post(srv.url("/start_profile"), headers=srv.headers, timeout=60).status_code == 200
    srv.client().completions.create(model=MODEL, prompt="Profile me", max_tokens=2)
    r = httpx.post(srv.url("/stop_profile"), headers=srv.headers, timeout=120)
    assert r.status_code == 200, r.text
    (trace,) = r.json()["traces"]
    assert os.path.getsize(trace) > 0 and trace.endswith(".pt.trace.json.gz")
    r = httpx.post(srv.url("/stop_profile"), headers=srv.headers, timeout=60)
    assert r.status_code == 400 and "not running" in r.json()["error"]["message"]


def test_vllm_api_key_variable_guards_the_api(vllm_style_server):
    srv = vllm_style_server
    assert httpx.get(srv.url("/v1/models"), timeout=30).status_code == 401
    assert httpx.get(srv.url("/v1/models"), headers=srv.headers, timeout=30).status_code == 200
    for method in ("GET", "POST"):  # vLLM's /ping, open like /health
        assert httpx.request(method, srv.url("/ping"), timeout=30).status_code == 200


def test_cors_lets_the_allowed_origin_call_from_a_browser(vllm_style_server):
    srv = vllm_style_server
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(srv.url("/v1/chat/completions"), headers=preflight, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN  # no key needed
    r = httpx.options(srv.url("/v1/chat/completions"), headers={**preflight, "Origin": "http://evil.example"}, timeout=30)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(srv.url("/v1/models"), headers={**srv.headers, "Origin": ORIGIN}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_tokenize_and_detokenize_count_what_the_endpoints_count(vllm_style_server):
    srv = vllm_style_server
    client = srv.client()

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(srv.url(path), headers=srv.headers, json=body, timeout=60)

    prompt = "The capital of France is"
    r = post("/tokenize", {"model": MODEL, "prompt": prompt, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert body["count"] == len(body["tokens"]) == completion.usage.prompt_tokens
    assert body["max_model_len"] == 256 and "".join(body["token_strs"]).replace("Ġ", " ") == prompt
    assert post("/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": prompt}

    # A conversation is rendered by the server's --chat-template, as the chat endpoint renders it.
    messages = [{"role": "user", "content": "Say hi."}]
    tokens = post("/tokenize", {"messages": messages}).json()["tokens"]
    rendered = post("/detokenize", {"tokens": tokens}).json()["prompt"]
    assert rendered == "<<user>>Say hi.\n<<assistant>>"
    chat = httpx.post(srv.url("/v1/chat/completions"), headers=srv.headers, timeout=60,
                      json={"messages": messages, "max_tokens": 2, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(tokens)
    assert chat.json()["choices"][0]["message"]["role"] == "helper"  # --response-role

    for path, bad, param in (("/detokenize", {"tokens": [10**6]}, "tokens"),
                             ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                             ("/tokenize", {"model": "nope", "prompt": "a"}, "model")):
        r = post(path, bad)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    with pytest.raises(openai.AuthenticationError):
        srv.client(api_key="wrong").models.list()


def test_cached_prompt_tokens_and_tokens_as_ids(vllm_style_server):
    """--enable-prompt-tokens-details: usage says how many prompt tokens the prefix cache served
    (none the first time, whole blocks the second); --return-tokens-as-token-ids: logprobs name
    tokens `token_id:<id>`, the ids whose text the plain entries show (a request can say no)."""
    srv = vllm_style_server
    client = srv.client()
    messages = [{"role": "user", "content": "Tell me about the history of the printing press in Europe, in detail."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True,
                                           top_logprobs=2)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                            logprobs=True, extra_body={"return_tokens_as_token_ids": False})
    prompt_tokens = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < prompt_tokens and cached % 16 == 0, (cached, prompt_tokens)
    entries = first.choices[0].logprobs.content
    ids = [int(e.token.removeprefix("token_id:")) for e in entries]
    assert all(e.token.startswith("token_id:") and all(t.token.startswith("token_id:") for t in e.top_logprobs)
               for e in entries)
    texts = [httpx.post(srv.url("/detokenize"), headers=srv.headers, json={"tokens": [i]}, timeout=60).json()["prompt"]
             for i in ids]
    assert [e.token for e in second.choices[0].logprobs.content] == texts
    # Streamed, the closing usage chunk says it too; completions sum it over their prompts.
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True})
    assert [c.usage for c in stream if c.usage][-1].prompt_tokens_details.cached_tokens == cached
    prompts = ["The printing press, invented by Johannes Gutenberg around 1440, changed how books were made and read "
               "across Europe, because"] * 2
    completions = [client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, logprobs=1) for _ in range(2)]
    first_cached, again_cached = (c.usage.prompt_tokens_details.cached_tokens for c in completions)
    assert again_cached > first_cached and again_cached % 16 == 0 and again_cached >= 2 * 16
    assert completions[0].choices[0].logprobs.tokens[0].startswith("token_id:")
