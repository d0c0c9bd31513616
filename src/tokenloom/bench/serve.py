"""`tokenloom bench serve`: load an OpenAI-compatible server and measure it as a client sees it.

Requests are streamed completions (`/v1/completions`) or chat completions
(`/v1/chat/completions`, `--backend openai-chat`), all `stream: true`, `ignore_eos: true`,
greedy, with random prompts of `--input-len` tokens, sent with Poisson arrivals at
`--request-rate` requests/s (`inf`: all at once). Per request the client records the time to the
first token (TTFT), the gaps between streamed chunks (ITL), the mean time per output token after
the first (TPOT) and the end-to-end latency; the report gives their mean, p50, p90 and p99 in
ms, plus the request and output-token throughputs over the whole run.

`vllm bench serve`'s spellings work: `--host/--port` (when there is no `--base-url`), `--endpoint`,
`--backend openai|vllm|openai-chat`, `--dataset-name random` with `--random-input-len` and
`--random-output-len`, `--ignore-eos`. Before the run one `GET /v1/models` checks that the server
answers and takes the key: a server that is not there, a bad URL or a refused key end the command
with one line and exit status 1.

Like the other bench commands, the report names the machine (the client's: the server's too when
it runs on the same host) and its load, shows a progress bar of the requests done while it runs
(tqdm, on stderr; `--disable-tqdm` as vLLM's), and ends with the ledger's verdict for the run:
the server's `GET /ledger` read after it, by the rule of `tokenloom explain --url`, over the
requests the ledger still holds (this run's, and any it still keeps from before).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tokenloom import envs
from tokenloom.bench.machine import format_machine, machine_info

# Ordinary token ids for random prompts: above the special tokens most vocabularies put first,
# and below the size of even small vocabularies.
_TOKEN_ID_RANGE = (1000, 10000)
_WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line"
).split()


# What each endpoint is asked for, and the `--backend` names (vLLM's) that speak to it.
_ENDPOINT_KINDS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_BACKEND_KINDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load an OpenAI-compatible server with streamed (chat) completions")
    p.add_argument("--base-url", default=None,
                   help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine); default: http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1",
                   help="the server's host when --base-url is not given (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000,
                   help="the server's port when --base-url is not given (default: 8000)")
    p.add_argument("--endpoint", default=None,
                   help="/v1/completions or /v1/chat/completions (default: the one --backend speaks to, else "
                        "/v1/completions)")
    p.add_argument("--backend", choices=sorted(_BACKEND_KINDS), default=None,
                   help="vllm bench serve's name for the request kind: openai or vllm (completions), openai-chat (chat "
                        "completions); default: the --endpoint's")
    p.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    p.add_argument("--dataset-name", default="random",
                   help="random, the only dataset: random prompts of --input-len tokens (vllm bench serve's default)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=32,
                   help="prompt length in tokens")
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=16,
                   help="max_tokens of every request (ignore_eos: it is reached)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="accepted for vllm bench serve's command lines: every request sets ignore_eos anyway")
    p.add_argument("--prompt-kind", choices=["token-ids", "words"], default=None,
                   help="random token ids, or random common words (about one token each); default: token-ids for "
                        "completions, words for chat (a chat message is text)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=envs.TOKENLOOM_API_KEY or os.environ.get("OPENAI_API_KEY"),
                   help="the server's API key (default: $TOKENLOOM_API_KEY, else $OPENAI_API_KEY)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar (vllm bench serve's flag)")
    p.add_argument("--output-json", metavar="FILE", default=None,
                   help="also write the results, as --json prints them, to FILE")
    p.set_defaults(func=run)


class ServerUnreachable(Exception):
    """The server cannot be benchmarked at all (not there, a bad URL, a refused key): the
    command ends with this one line, not with a table of failed requests or a traceback."""


@dataclass(frozen=True, slots=True)
class Target:
    base: str  # the server's root, without /v1
    endpoint: str  # /v1/completions or /v1/chat/completions
    kind: str  # "completions" or "chat"

    @property
    def url(self) -> str:
        return self.base + self.endpoint


def resolve_target(args: argparse.Namespace) -> Target:
    """Where to send what, from vllm bench serve's flags: `--base-url` if given, else
    http://HOST:PORT, plus `--endpoint`; `--backend` and `--endpoint` must agree (vLLM sends a
    chat request only with openai-chat, and only to a chat endpoint)."""
    endpoint = args.endpoint
    if endpoint is None:
        endpoint = "/v1/chat/completions" if _BACKEND_KINDS.get(args.backend) == "chat" else "/v1/completions"
    endpoint = "/" + endpoint.strip("/")
    kind = _ENDPOINT_KINDS.get(endpoint)
    if kind is None:
        raise ValueError(f"--endpoint must be one of {', '.join(_ENDPOINT_KINDS)}, got {args.endpoint!r}.")
    if args.backend is not None and _BACKEND_KINDS[args.backend] != kind:
        wanted = "openai-chat" if kind == "chat" else "openai"
        raise ValueError(f"--backend {args.backend} does not speak to --endpoint {endpoint}: use --backend {wanted} "
                         "(as vllm bench serve).")
    base = args.base_url if args.base_url is not None else f"http://{args.host}:{args.port}"
    base = base.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    return Target(base, endpoint, kind)


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)


def make_prompts(kind: str, num: int, input_len: int, seed: int) -> list[Any]:
    rng = random.Random(seed)
    if kind == "token-ids":
        return [[rng.randrange(*_TOKEN_ID_RANGE) for _ in range(input_len)] for _ in range(num)]
    return [" ".join(rng.choice(_WORDS) for _ in range(input_len)) for _ in range(num)]


def arrival_delays(num: int, rate: float, seed: int) -> list[float]:
    """Gaps before each request: exponential with mean 1/rate (a Poisson process); 0 at rate inf."""
    if math.isinf(rate):
        return [0.0] * num
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0 or inf, got {rate}.")
    rng = random.Random(seed + 1)
    return [rng.expovariate(rate) for _ in range(num)]


def _has_output(choice: dict[str, Any], kind: str) -> bool:
    """Whether a streamed choice carries generated output. A chat stream opens with a chunk that
    holds only the role: it is no token, and counting it would make the TTFT look instant."""
    if kind == "chat":
        delta = choice.get("delta") or {}
        return bool(delta.get("content") or delta.get("reasoning_content"))
    return True


async def _one_request(client: Any, url: str, body: dict[str, Any], timeout: float,
                       kind: str = "completions") -> RequestResult:
    result = RequestResult()
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                    result.output_tokens = chunk["usage"].get("completion_tokens", 0)
                choices = chunk.get("choices")
                if not choices or not _has_output(choices[0], kind):
                    continue
                t = time.perf_counter()
                if chunks == 0:
                    result.ttft_s = t - start
                else:
                    result.itl_s.append(t - last)
                last = t
                chunks += 1
        result.e2e_s = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = chunks > 0
        if not result.ok:
            result.error = "the stream ended without output"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        result.error = f"{type(e).__name__}: {e}"
    return result


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _summary(name: str, values_s: list[float]) -> dict[str, float]:
    values = sorted(v * 1000.0 for v in values_s)
    return {
        f"mean_{name}_ms": sum(values) / len(values) if values else 0.0,
        f"median_{name}_ms": _percentile(values, 50),
        f"p90_{name}_ms": _percentile(values, 90),
        f"p99_{name}_ms": _percentile(values, 99),
    }


async def list_models(client: Any, base: str, has_key: bool) -> list[str]:
    """The server's model names (`GET /v1/models`); raises ServerUnreachable, in words, when the
    server cannot be benchmarked at all."""
    import httpx

    url = f"{base}/v1/models"
    try:
        response = await client.get(url)
    except (httpx.UnsupportedProtocol, httpx.InvalidURL) as e:
        raise ServerUnreachable(f"{base!r} is not a server URL ({e}): give --base-url as http://HOST:PORT, "
                                "or --host and --port.") from None
    except httpx.ConnectError as e:
        raise ServerUnreachable(f"cannot connect to {base} ({e}): is the server running there? (--host/--port or "
                                "--base-url)") from None
    except httpx.TimeoutException:
        raise ServerUnreachable(f"{url} did not answer within {client.timeout.read}s.") from None
    except httpx.HTTPError as e:
        raise ServerUnreachable(f"GET {url} failed: {type(e).__name__}: {e}") from None
    if response.status_code in (401, 403):
        given = "the key given was refused" if has_key else "no API key was given"
        raise ServerUnreachable(f"{url} answered HTTP {response.status_code}: {given}; pass the server's key with "
                                "--api-key (or $TOKENLOOM_API_KEY / $OPENAI_API_KEY).")
    if response.status_code != 200:
        raise ServerUnreachable(f"{url} answered HTTP {response.status_code}: {response.text[:200]!r}; is {base} an "
                                "OpenAI-compatible server?")
    try:
        return [m["id"] for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise ServerUnreachable(f"{url} did not list models as an OpenAI-compatible server does: "
                                f"{response.text[:200]!r}") from None


def request_body(target: Target, model: str, prompt: Any, output_len: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def benchmark(args: argparse.Namespace, machine_line: str | None = None) -> dict[str, Any]:
    """The run; `machine_line` is printed on stderr once the server answered (before the run's
    progress, so a refused run still ends with its one line)."""
    import httpx

    target = resolve_target(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=args.timeout) as client:
        models = await list_models(client, target.base, bool(args.api_key))
        if machine_line:
            print(machine_line, file=sys.stderr, flush=True)
        model = args.model
        if model is None:
            if not models:
                raise ServerUnreachable(f"{target.base}/v1/models lists no model; name one with --model.")
            model = models[0]
        prompts = make_prompts(args.prompt_kind, args.num_prompts, args.input_len, args.seed)
        delays = arrival_delays(args.num_prompts, args.request_rate, args.seed)
        limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        bar = _progress_bar(args)

        async def limited(body: dict[str, Any]) -> RequestResult:
            try:
                if limit is None:
                    return await _one_request(client, target.url, body, args.timeout, target.kind)
                async with limit:
                    return await _one_request(client, target.url, body, args.timeout, target.kind)
            finally:
                if bar is not None:
                    bar.update(1)

        tasks = []
        start = time.perf_counter()
        for prompt, delay in zip(prompts, delays):
            if delay:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(request_body(target, model, prompt, args.output_len))))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
        ledger = await ledger_verdict(client, target.base)
    return report(results, duration, args, model) | {"endpoint": target.endpoint, "base_url": target.base,
                                                      "ledger": ledger}


def _progress_bar(args: argparse.Namespace) -> Any:
    """The requests done, as vllm bench serve draws them (tqdm on stderr); None when disabled."""
    if args.disable_tqdm:
        return None
    from tqdm import tqdm

    return tqdm(total=args.num_prompts, desc="requests", unit="req", file=sys.stderr)


async def ledger_verdict(client: Any, base: str) -> dict[str, Any]:
    """The ledger's verdict over the server's recent requests, by `tokenloom explain`'s rule (the
    verdict group holding the most request seconds, timeline.group_seconds) on its `GET /ledger`:
    verdict, headline and shares; or `error` when the server keeps no ledger that can be read."""
    from tokenloom.metrics.contention import verdict_of
    from tokenloom.metrics.timeline import VERDICT_HEADLINES
    from tokenloom.metrics.trace import trace_requests

    try:
        resp = await client.get(base + "/ledger", params={"format": "trace"})
        resp.raise_for_status()
        requests = trace_requests(resp.json())
    except Exception as e:  # noqa: BLE001 - the run's figures stand without it
        return {"error": f"could not read {base}/ledger: {e!r}"}
    verdict, _, shares = verdict_of(requests)
    if verdict == "unknown":
        return {"error": "the server's ledger holds no finished request"}
    return {"verdict": verdict, "headline": VERDICT_HEADLINES[verdict], "num_requests": len(requests),
            "group_shares": shares}


def report(results: list[RequestResult], duration: float, args: argparse.Namespace, model: str) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    total_out = sum(r.output_tokens for r in done)
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    out: dict[str, Any] = {
        "model": model,
        "num_prompts": len(results),
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "completed": len(done),
        "failed": len(failed),
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        **_summary("ttft", [r.ttft_s for r in done]),
        **_summary("tpot", tpots),
        **_summary("itl", [g for r in done for g in r.itl_s]),
        **_summary("e2el", [r.e2e_s for r in done]),
    }
    if failed:
        out["errors"] = sorted({r.error for r in failed})[:10]
    return out


def _print_table(result: dict[str, Any]) -> None:
    print(f"{' tokenloom bench serve ':=^60}")
    rows = [
        ("Model", result["model"]),
        ("Endpoint", result.get("endpoint", "")),
        ("Successful requests", result["completed"]),
        ("Failed requests", result["failed"]),
        ("Benchmark duration (s)", f"{result['duration_s']:.2f}"),
        ("Total input tokens", result["total_input_tokens"]),
        ("Total generated tokens", result["total_output_tokens"]),
        ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}"),
    ]
    for label, value in rows:
        print(f"{label:<40}{value:>20}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"), ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print(f"{' ' + title + ' ':-^60}")
        for stat in ("mean", "median", "p90", "p99"):
            key = f"{stat}_{name}_ms"
            print(f"{stat.upper() if stat.startswith('p') else stat.capitalize()} {name.upper()} (ms):".ljust(40) + f"{result[key]:>20.2f}")
    for error in result.get("errors", ()):
        print(f"error: {error}", file=sys.stderr)
    print("=" * 60)
    print(format_machine(result["machine"]))
    print(format_verdict({"base_url": result.get("base_url")} | (result.get("ledger") or {})))


def format_verdict(ledger: dict[str, Any]) -> str:
    """The ledger's verdict as `tokenloom explain` prints it, in two or three lines."""
    if "verdict" not in ledger:
        return f"ledger: no verdict ({ledger.get('error', 'not read')})"
    shares = ", ".join(f"{g} {s:.0%}" for g, s in sorted(ledger["group_shares"].items(), key=lambda kv: -kv[1]) if s)
    lines = [f"ledger verdict ({ledger['num_requests']} requests the server's ledger holds): "
             f"{ledger['verdict']}: {ledger['headline']}", f"  share of their time: {shares or '-'}"]
    lines.append(f"  what to change, and the slowest requests: tokenloom explain --url {ledger.get('base_url', 'URL')}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from tokenloom.bench.common import check_output_json, emit, positive

    for name in ("num_prompts", "input_len", "output_len"):
        positive(name, getattr(args, name))
    if args.dataset_name != "random":
        raise ValueError(f"--dataset-name {args.dataset_name} is not available: tokenloom bench serve sends random "
                         "prompts only (--dataset-name random, sized by --random-input-len / --random-output-len).")
    kind = resolve_target(args).kind
    if args.prompt_kind is None:
        args.prompt_kind = "words" if kind == "chat" else "token-ids"
    elif kind == "chat" and args.prompt_kind == "token-ids":
        raise ValueError("--prompt-kind token-ids needs /v1/completions: a chat message is text (use words).")
    check_output_json(args.output_json)
    machine = machine_info()
    try:
        result = asyncio.run(benchmark(args, None if args.json else format_machine(machine)))
    except ServerUnreachable as e:
        print(f"tokenloom: error: {e}", file=sys.stderr)
        return 1
    result["machine"] = machine
    emit(result, args.json, _print_table, args.output_json)
    return 0 if result["completed"] else 1
