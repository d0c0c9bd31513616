"""The `tokenloom` command: `tokenloom generate | serve | run-batch | bench | explain | env ...`."""
from __future__ import annotations

import argparse
import json
import sys

from tokenloom.bench import add_bench_parser
from tokenloom.entrypoints.collect_env import add_env_parser
from tokenloom.entrypoints.engine_args import EngineArgs, add_engine_args
from tokenloom.entrypoints.openai import add_run_batch_parser, add_serve_parser
from tokenloom.analysis.explain import add_explain_parser


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts given on the command line")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from tokenloom.entrypoints.llm import LLM
    from tokenloom.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    try:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False)
        else:
            outputs = llm.generate(args.prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(args.prompts, outputs):
        c = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}))
        else:
            print(f"### {prompt}\n{c.text}\n")
    return 0


# Each entry adds one subcommand; modules are imported only when listed here.
_SUBCOMMANDS = [
    _add_generate,
    add_serve_parser,  # tokenloom.entrypoints.openai
    add_run_batch_parser,  # tokenloom.entrypoints.openai.run_batch
    add_bench_parser,  # tokenloom.bench (a group: bench serve | ...)
    add_explain_parser,  # tokenloom.analysis.explain
    add_env_parser,  # tokenloom.entrypoints.collect_env (versions, CPU, the kernel plan)
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenloom", description="tokenloom: LLM inference with a ledger")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def normalize_flags(argv: list[str]) -> list[str]:
    """`--max_model_len 4096` as `--max-model-len 4096`: vLLM's parser takes underscores in option
    names, so its launch scripts may use them. Only option names change, never values."""
    out = []
    for arg in argv:
        if arg == "--":  # everything after it is positional
            out.extend(argv[len(out):])
            break
        if arg.startswith("--") and "_" in arg.partition("=")[0]:
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(normalize_flags(sys.argv[1:] if argv is None else list(argv)))
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"tokenloom: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the engine starts or a command runs: no traceback
        print("tokenloom: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from tokenloom.engine.core_client import EngineDeadError  # imported already if that is what it is

        if not isinstance(e, EngineDeadError):
            raise
        # The core said why (its log above has the details): one line, not three tracebacks.
        print(f"tokenloom: error: {str(e).splitlines()[0] if str(e) else 'the engine core died'}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
