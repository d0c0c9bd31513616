"""The OpenAI-compatible HTTP server (`tokenloom serve`).

This module stays light (argparse only): the CLI builds every subcommand's parser at start-up,
and the server's heavy imports (FastAPI, the engine) happen only when `serve` runs.
"""
from __future__ import annotations

import argparse
import os


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from tokenloom.entrypoints.engine_args import add_engine_args

    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("TOKENLOOM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on the API routes (default: $TOKENLOOM_API_KEY); "
        "/health, /version and /metrics stay open",
    )
    p.add_argument("--served-model-name", nargs="+", default=None, help="model name(s) clients use (default: the model path)")
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
        "--keep-alive-on-engine-death",
        action="store_true",
        help="when the engine core dies, stay up answering 503 on every route (/health, /version, /metrics "
        "and /v1/models included) instead of exiting "
        "with status 1 (the default, as vLLM: let the supervisor restart the server)",
    )
    p.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=["hermes", "json", "llama3_json"],
        help="how replies to tool_choice='auto' are read as tool calls: 'hermes' (<tool_call>{...}</tool_call>, "
        "ChatML tool templates) or 'json' (the whole reply is a call object or a list of them); default: hermes",
    )
    p.add_argument(
        "--metrics-prefix",
        default="tokenloom",
        choices=["tokenloom", "vllm"],
        help="vllm: /metrics names the metrics vLLM also has as vLLM does (vllm:...), so dashboards and alerts "
        "written for vLLM work unchanged; the ledger's own metrics keep tokenloom: (default: tokenloom)",
    )
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from tokenloom.entrypoints.openai.api_server import run_serve

    return run_serve(args)
