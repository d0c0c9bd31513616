"""The OpenAI-compatible HTTP server (`tokenloom serve`).

This module stays light (argparse only): the CLI builds every subcommand's parser at start-up,
and the server's heavy imports (FastAPI, the engine) happen only when `serve` runs.
"""
from __future__ import annotations

import argparse
import json
import os

from tokenloom import envs


def _json_or_plain_list(text: str) -> list[str]:
    """One value of --allowed-origins and its kin: vLLM's JSON list ('["http://a", "http://b"]')
    or a plain value (several may follow the flag)."""
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
        return value
    return [text]


def _lora_module(text: str) -> list[tuple[str, str]]:
    """One value of --lora-modules: vLLM's `name=path`, or its JSON `{"name": ..., "path": ...}`."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON object: {e}") from None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(value.get("path"), str):
            raise argparse.ArgumentTypeError(f'expected {{"name": ..., "path": ...}}, got {text!r}')
        return [(value["name"], value["path"])]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return [(name, path)]


class _Flatten(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[no-untyped-def]
        setattr(namespace, self.dest, [v for group in values for v in group])


def _env_api_keys() -> list[str] | None:
    # vLLM's variable too: a deployment moved from vLLM must not come up without its key.
    key = envs.server_api_key()
    return [key] if key else None


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from tokenloom.entrypoints.engine_args import add_engine_args

    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_endpoint_args(p)
    _add_admission_args(p)
    _add_chat_args(p)
    _add_http_args(p)
    _add_api_args(p)
    _add_logging_args(p)
    add_engine_args(p)
    p.set_defaults(func=_run_serve)


def _add_endpoint_args(p: argparse.ArgumentParser) -> None:
    """What is served, where, to whom: the model, address, API keys, model names."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        nargs="+",
        default=_env_api_keys(),
        help="require 'Authorization: Bearer KEY' on the API routes, any of the keys given (default: "
        "$TOKENLOOM_API_KEY, else $VLLM_API_KEY); /health, /ping, /version and /metrics stay open",
    )
    p.add_argument("--served-model-name", nargs="+", default=None, help="model name(s) clients use (default: the model path)")


def _add_admission_args(p: argparse.ArgumentParser) -> None:
    """What the server refuses (the waiting queue, bodies, prompts per request) and when it calls
    itself unhealthy."""
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 when admitting a request would leave more than N requests waiting "
        "(counted on the caller side as unfinished requests beyond --max-num-seqs); default: no limit",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=16 * 1024 * 1024,
        help="answer 413 to a request body larger than this (default: 16 MiB, far above any prompt a context "
        "window holds)",
    )
    p.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=2048,
        help="answer 400 to a request that asks for more sequences than this: its prompts (a completions "
        "prompt list, embeddings inputs, score/rerank documents) times n (default: 2048). Within it, a "
        "request's prompts past --max-num-seqs are queued as earlier ones finish, so other clients' "
        "requests are not held behind them",
    )
    p.add_argument(
        "--keep-alive-on-engine-death",
        action="store_true",
        help="when the engine core dies, stay up answering 503 on every route (/health, /version, /metrics "
        "and /v1/models included) instead of exiting "
        "with status 1 (the default, as vLLM: let the supervisor restart the server)",
    )
    p.add_argument(
        "--health-heartbeat-timeout",
        type=float,
        default=3.0,
        help="/health answers 503 (engine_unresponsive) once the engine core has sent nothing for this many "
        "seconds; it sends a heartbeat every 0.5 s when it has nothing else to send, from a thread that runs "
        "during a step, so only a stopped or hung core goes silent (default: 3.0). With data parallelism a "
        "silent replica is left out of replicas_alive and gets no new requests",
    )
    p.add_argument(
        "--health-tokenizer-pool-limit",
        type=float,
        default=10.0,
        help="/health answers 503 (tokenizer_pool_saturated) once every thread that parses, tokenizes and "
        "renders requests has been on the same job for more than this many seconds (default: 10.0)",
    )


def _add_chat_args(p: argparse.ArgumentParser) -> None:
    """How chat requests are rendered and their replies read (tools, reasoning, templates) and
    what a reply shows."""
    p.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=["hermes", "json", "llama3_json", "pythonic", "openai"],
        help="how replies to tool_choice='auto' are read as tool calls: 'hermes' (<tool_call>{...}</tool_call>, "
        "ChatML tool templates), 'json' (alias 'llama3_json': the whole reply is a call object or a list of "
        "them), 'pythonic' (Llama 3.2/4: [get_weather(city=\"Paris\")]) or 'openai' (gpt-oss's harmony "
        "messages to functions.NAME); default: hermes",
    )
    p.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3", "openai_gptoss", "gpt_oss"],
                   help="a thinking model's <think>...</think> part of a chat reply (gpt-oss, 'openai_gptoss' or "
                        "'gpt_oss': its harmony analysis channel) becomes the message's reasoning_content (and "
                        "reasoning), the rest its content (default: none, the reply is all content)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted as vLLM's: tool_choice='auto' is always on here, read by --tool-call-parser")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, the path of a file holding one, or the name of a shipped tool-aware "
                   "template ('hermes', 'llama3_json'), used where a request names none (default: the tokenizer's)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a request's own chat_template (refused by default, as vLLM does: a template is a "
                   "program, and a request's is its sender's)")
    p.add_argument("--chat-template-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a chat-template render that runs longer is stopped (its worker process killed) and its "
                   "request gets a 400 (default: 10 s)")
    p.add_argument("--chat-template-max-memory", type=int, default=256 * 1024**2, metavar="BYTES",
                   help="the memory a chat-template render may take beyond its worker's own; past it the request "
                   "gets a 400 (default: 256 MiB)")
    p.add_argument("--chat-template-workers", type=int, default=2, metavar="N",
                   help="worker processes that render chat templates, each one render at a time (default: 2)")
    p.add_argument("--response-role", default="assistant", help="the role of the server's chat replies (default: assistant)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage gets prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache served")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens as 'token_id:<id>' (a request's return_tokens_as_token_ids overrides it)")


def _add_http_args(p: argparse.ArgumentParser) -> None:
    """HTTP around the API: CORS, the proxy's root path, TLS."""
    p.add_argument("--allowed-origins", nargs="+", type=_json_or_plain_list, action=_Flatten, default=["*"],
                   help="CORS: origins that may call the API from a browser (values or vLLM's JSON list; default: *)")
    p.add_argument("--allowed-methods", nargs="+", type=_json_or_plain_list, action=_Flatten, default=["*"],
                   help="CORS: allowed methods (default: *)")
    p.add_argument("--allowed-headers", nargs="+", type=_json_or_plain_list, action=_Flatten, default=["*"],
                   help="CORS: allowed headers (default: *)")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (default: no)")
    p.add_argument("--root-path", default="", help="the path prefix a proxy serves this server under (ASGI root_path)")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the private key file (PEM), with --ssl-certfile")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate (chain) file (PEM)")
    p.add_argument("--ssl-ca-certs", default=None, help="CA certificates that client certificates are checked against")
    p.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                   help="whether a client certificate is required: 0 no (default), 1 optional, 2 required "
                        "(Python's ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED, as vLLM's)")


def _add_api_args(p: argparse.ArgumentParser) -> None:
    """What the API serves besides the model (LoRA adapters, stored responses, usage chunks, docs)
    and how much of a prompt a request log line shows."""
    p.add_argument("--lora-modules", nargs="+", type=_lora_module, action=_Flatten, default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served as models of their own name: name=path or vLLM's JSON "
                   "'{\"name\": ..., \"path\": ...}' (needs --enable-lora)")
    p.add_argument("--responses-store-size", type=int, default=1000,
                   help="/v1/responses keeps this many responses created with store=true (OpenAI's default) in "
                   "memory, for previous_response_id, GET /v1/responses/{id} and background responses; the oldest "
                   "go first (default: 1000; 0: none are kept)")
    p.add_argument("--max-log-len", type=int, default=200,
                   help="with --enable-log-requests, the most characters of a prompt each log line shows (default 200)")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every streamed completion ends with a usage chunk, as if its stream_options asked for it")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /docs, /redoc or /openapi.json (served by default, without the API key, as vLLM does)")


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    """What the server logs and how /metrics names its series."""
    p.add_argument("--enable-log-requests", action="store_true", dest="log_requests",
                   help="log one INFO line per accepted request (its id, prompt and sampling parameters)")
    p.add_argument("--disable-log-requests", action="store_false", dest="log_requests",
                   help="accepted as vLLM's: requests are not logged unless --enable-log-requests")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="accepted as vLLM's: this server logs no periodic stats (see /metrics)")
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access log line per HTTP request (they are logged at INFO: see --uvicorn-log-level)")
    p.add_argument(
        "--metrics-prefix",
        default="tokenloom",
        choices=["tokenloom", "vllm"],
        help="vllm: /metrics names the metrics vLLM also has as vLLM does (vllm:...), so dashboards and alerts "
        "written for vLLM's current metrics find their series; the ledger's own metrics keep tokenloom: "
        "(default: tokenloom)",
    )
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="the server's and the engine core's log level ($TOKENLOOM_LOG_LEVEL, if set, wins for the "
                   "core); info shows the engine's start-up line (CPU path) and access logs")
    p.add_argument("--uvicorn-log-level", default=None, choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log level (default: --log-level)")


def _run_serve(args: argparse.Namespace) -> int:
    import logging
    import sys

    from tokenloom.entrypoints.openai.serve import run_serve

    code = run_serve(args)
    # The engine core is reaped and its socket directory gone: exit now rather than through the
    # interpreter's teardown, which a tokenizer thread stuck in a job (a daemon) can only slow.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def add_run_batch_parser(sub: argparse._SubParsersAction) -> None:
    from tokenloom.entrypoints.engine_args import add_engine_args

    p = sub.add_parser("run-batch", help="run a file of OpenAI Batch API requests offline (vLLM's run-batch)")
    p.add_argument("-i", "--input-file", required=True,
                   help="JSONL, one request per line: {\"custom_id\", \"method\": \"POST\", \"url\", \"body\"} "
                   "(- for standard input; an http(s) URL is read with GET, as vLLM's)")
    p.add_argument("-o", "--output-file", required=True,
                   help="JSONL, one response per request in input order (- for standard output; an http(s) "
                   "URL gets the whole file with one PUT, as vLLM's)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the requests' `model` may give (default: the model path)")
    p.add_argument("--max-concurrency", type=int, default=1024,
                   help="requests in flight at once (default 1024; the engine batches them continuously)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or the path of a file holding one (default: the tokenizer's)")
    p.add_argument("--response-role", default="assistant", help="the role of chat replies (default: assistant)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage gets prompt_tokens_details.cached_tokens")
    p.add_argument("--disable-progress-bar", action="store_true", help="no progress bar on standard error")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)
    p.set_defaults(func=_run_batch)


def _run_batch(args: argparse.Namespace) -> int:
    from tokenloom.entrypoints.openai.run_batch import run_batch

    return run_batch(args)
