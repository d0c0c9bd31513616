"""`tokenloom run-batch` (vLLM's offline batch, the OpenAI Batch API's file format), run as a user
runs it: a real process on the embedded model, a JSONL file in, a JSONL file out."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

LINES = [
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12,
              "temperature": 0}},
    {"custom_id": "completion", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0.8, "n": 2, "seed": 3}},
    {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}},
    {"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hi"}},
]


def run_batch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenloom.entrypoints.cli", "run-batch", *args],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture
def file_server():
    """A local HTTP file store (GET what it holds, PUT to store), as an object store's presigned
    URLs behave: {path: bytes}, and the base URL."""
    files: dict[str, bytes] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def do_PUT(self):  # noqa: N802
            files[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(201)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield files, f"http://127.0.0.1:{httpd.server_port}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_batch_file_runs_through_the_servers_routes(tmp_path, file_server):
    """The input read from a URL (vLLM's GET), the output written to a local file."""
    files, base = file_server
    dst = tmp_path / "out.jsonl"
    files["/in.jsonl"] = ("\n".join(json.dumps(x) for x in LINES[:2]) + "\n\n"
                          + "\n".join(json.dumps(x) for x in LINES[2:])).encode()
    r = run_batch("-i", f"{base}/in.jsonl", "-o", str(dst), "--max-model-len", "512", "--disable-progress-bar")
    assert r.returncode == 0, r.stderr
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["chat", "completion", "bad", "embed"]  # input order
    assert len({o["id"] for o in out}) == 4 and all(o["error"] is None for o in out)
    chat = out[0]["response"]
    assert chat["status_code"] == 200 and chat["body"]["object"] == "chat.completion"
    assert "Paris" in chat["body"]["choices"][0]["message"]["content"]
    assert chat["body"]["usage"]["completion_tokens"] <= 12
    completion = out[1]["response"]["body"]
    assert completion["object"] == "text_completion" and len(completion["choices"]) == 2
    # What the server refuses is written with its status and OpenAI's error body, naming the field.
    assert out[2]["response"]["status_code"] == 400
    assert out[2]["response"]["body"]["error"]["param"] == "max_tokens"
    assert out[3]["response"]["status_code"] == 400
    assert out[3]["response"]["body"]["error"]["code"] == "model_not_embedding"


@pytest.mark.parametrize("line, message", [
    ("not json", "line 2: not JSON"),
    (json.dumps({**LINES[0], "custom_id": "completion"}), "line 2: custom_id 'completion' is not unique .line 1"),
    (json.dumps({**LINES[0], "url": "/v1/files"}), "line 2: url must be one of"),
    (json.dumps({**LINES[0], "body": {**LINES[0]["body"], "stream": True}}), "line 2: stream is not supported"),
    (json.dumps({**LINES[0], "method": "GET"}), "line 2: method must be POST"),
])
def test_a_malformed_file_stops_before_the_engine_starts(tmp_path, line, message):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps(LINES[1]) + "\n" + line + "\n")
    r = run_batch("-i", str(src), "-o", str(dst))
    assert r.returncode == 2
    assert r.stderr.startswith("tokenloom: error:")
    assert re.search(message, r.stderr), r.stderr
    assert not dst.exists()


def test_batch_urls_put_the_output_and_name_a_missing_input(file_server):
    """vLLM's run-batch takes URLs: the output is one PUT of the whole file; an input URL that
    answers 404 stops the run before the engine starts, naming it."""
    from tokenloom.entrypoints.openai.run_batch import _write_jsonl

    files, base = file_server
    rows = [{"custom_id": "a", "response": {"status_code": 200}}, {"custom_id": "b", "response": {"status_code": 400}}]
    _write_jsonl(f"{base}/results/out.jsonl", rows)
    assert [json.loads(line) for line in files["/results/out.jsonl"].decode().splitlines()] == rows
    r = run_batch("-i", f"{base}/missing.jsonl", "-o", f"{base}/out.jsonl")
    assert r.returncode != 0 and f"GET {base}/missing.jsonl: HTTP 404" in r.stderr
    assert "/out.jsonl" not in files
