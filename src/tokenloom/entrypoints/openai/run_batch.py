"""`tokenloom run-batch`: vLLM's offline batch in the OpenAI Batch API's file format. A JSONL file
of requests in (`{"custom_id", "method": "POST", "url", "body"}` per line), a JSONL file of
responses out, one per request in input order (`{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error": null}`).

Each request goes through the server's own app (api_server.build_app) in this process, over an
in-memory ASGI transport instead of a socket: the same validation, the same 400s naming their
field, the same response bodies as `tokenloom serve`, and all requests in flight at once (up to
`--max-concurrency`) so the engine batches them continuously. A request the server refuses is
written with its status code and OpenAI-style error body; the run goes on. The input file is
checked whole before the engine starts: a malformed line stops the run at once, naming it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

# The routes a batch line may name: those that answer one JSON body (no streams).
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/score", "/v1/rerank",
              "/rerank", "/v2/rerank", "/classify", "/v1/classify", "/pooling")

logger = logging.getLogger("tokenloom.run_batch")


@dataclass(frozen=True)
class BatchLine:
    custom_id: str
    url: str
    body: dict[str, Any]


def read_batch(path: str) -> list[BatchLine]:
    """The requests of a batch input file (`-`: standard input), checked line by line; a
    ValueError names the first line that is not a request (blank lines are skipped)."""
    if path == "-":
        import sys

        text = sys.stdin.read()
    elif is_url(path):
        text = _http("GET", path).text
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    lines: list[BatchLine] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        where = f"{path} line {number}"
        try:
            item = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected a JSON object with custom_id, method, url and body")
        custom_id, method, url, body = item.get("custom_id"), item.get("method", "POST"), item.get("url"), item.get("body")
        if not isinstance(custom_id, str) or not custom_id:
            raise ValueError(f"{where}: custom_id must be a non-empty string, got {custom_id!r}")
        if custom_id in seen:
            raise ValueError(f"{where}: custom_id {custom_id!r} is not unique (line {seen[custom_id]} has it too)")
        if method != "POST":
            raise ValueError(f"{where}: method must be POST, got {method!r}")
        if url not in BATCH_URLS:
            raise ValueError(f"{where}: url must be one of {', '.join(BATCH_URLS)}, got {url!r}")
        if not isinstance(body, dict):
            raise ValueError(f"{where}: body must be a JSON object, got {type(body).__name__}")
        if body.get("stream"):
            raise ValueError(f"{where}: stream is not supported in a batch (each response is written whole)")
        seen[custom_id] = number
        lines.append(BatchLine(custom_id, url, body))
    if not lines:
        raise ValueError(f"{path}: no requests")
    return lines


def _output_line(line: BatchLine, status_code: int, body: Any) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": status_code, "request_id": f"batch-{uuid.uuid4().hex}", "body": body},
            "error": None}


async def _run(app: Any, lines: list[BatchLine], max_concurrency: int, show_progress: bool) -> list[dict[str, Any]]:
    import httpx
    from tqdm.auto import tqdm

    limit = asyncio.Semaphore(max_concurrency)
    bar = tqdm(total=len(lines), unit="req", desc="Running batch", disable=not show_progress)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://batch",
                                 timeout=None) as client:
        async def one(line: BatchLine) -> dict[str, Any]:
            async with limit:
                r = await client.post(line.url, json=line.body)
            bar.update()
            try:
                body = r.json()
            except ValueError:
                body = {"error": {"message": r.text, "type": "server_error", "param": None, "code": None}}
            return _output_line(line, r.status_code, body)

        try:
            return await asyncio.gather(*(one(line) for line in lines))
        finally:
            bar.close()


def is_url(path: str) -> bool:
    """vLLM's batch files may be URLs (e.g. presigned object-store links): read with GET,
    written with PUT."""
    return path.startswith(("http://", "https://"))


def _http(method: str, url: str, content: bytes | None = None) -> Any:
    import httpx

    try:
        r = httpx.request(method, url, content=content, timeout=300, follow_redirects=True)
    except httpx.HTTPError as e:
        raise ValueError(f"{method} {url}: {e}") from None
    if r.status_code >= 400:
        raise ValueError(f"{method} {url}: HTTP {r.status_code} {r.reason_phrase}")
    return r


def _write_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    """Written whole or not at all: a temporary file beside `path`, renamed over it (a URL: one
    PUT of the whole file)."""
    if is_url(path):
        _http("PUT", path, "".join(json.dumps(row) + "\n" for row in rows).encode("utf-8"))
        return
    if path == "-":
        import sys

        for row in rows:
            sys.stdout.write(json.dumps(row) + "\n")
        sys.stdout.flush()
        return
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".run-batch-", suffix=".jsonl")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def run_batch(args: argparse.Namespace) -> int:
    from tokenloom.engine.async_llm import AsyncLLM
    from tokenloom.entrypoints.engine_args import engine_config_from_args
    from tokenloom.entrypoints.openai.api_server import build_app

    if args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}.")
    from tokenloom.entrypoints.openai.serve import read_chat_template

    lines = read_batch(args.input_file)  # before the engine: a bad file costs no model load
    chat_template = read_chat_template(args.chat_template)
    out_dir = os.path.dirname(os.path.abspath(args.output_file))
    if args.output_file != "-" and not is_url(args.output_file) and not os.path.isdir(out_dir):
        raise ValueError(f"--output-file {args.output_file!r}: the folder {out_dir!r} does not exist")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = engine_config_from_args(args)
    names = args.served_model_name or [config.model_name]
    engine = AsyncLLM(config, model_name=names[0])
    try:
        app = build_app(engine, served_model_names=names, chat_template=chat_template,
                        response_role=args.response_role,
                        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                        # The batch file is the operator's own: its requests' templates are trusted
                        # (they still render under the render workers' limits).
                        trust_request_chat_template=True)
        rows = asyncio.run(_run(app, lines, args.max_concurrency, not args.disable_progress_bar))
    finally:
        engine.shutdown()
    _write_jsonl(args.output_file, rows)
    ok = sum(1 for r in rows if r["response"]["status_code"] == 200)
    logger.info("run-batch: %d requests, %d succeeded, %d failed; wrote %s", len(rows), ok, len(rows) - ok,
                args.output_file)
    return 0
