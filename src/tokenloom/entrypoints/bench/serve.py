"""`tokenloom bench serve`: load an OpenAI-compatible server and measure it as a client sees it.

Requests are streamed completions (`/v1/completions`, `stream: true`, `ignore_eos: true`, greedy)
with random prompts of `--input-len` tokens, sent with Poisson arrivals at `--request-rate`
requests/s (`inf`: all at once). Per request the client records the time to the first token
(TTFT), the gaps between streamed chunks (ITL), the mean time per output token after the first
(TPOT) and the end-to-end latency; the report gives their mean, p50, p90 and p99 in ms, plus the
request and output-token throughputs over the whole run.
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

# Ordinary token ids for random prompts: above the special tokens most vocabularies put first,
# and below the size of even small vocabularies.
_TOKEN_ID_RANGE = (1000, 10000)
_WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line"
).split()


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load an OpenAI-compatible server with streamed completions")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--input-len", type=int, default=32, help="prompt length in tokens")
    p.add_argument("--output-len", type=int, default=16, help="max_tokens of every request (ignore_eos: it is reached)")
    p.add_argument("--prompt-kind", choices=["token-ids", "words"], default="token-ids", help="random token ids, or random common words (about one token each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=os.environ.get("TOKENLOOM_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.set_defaults(func=run)


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


async def _one_request(client: Any, url: str, body: dict[str, Any], timeout: float) -> RequestResult:
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
                if not chunk.get("choices"):
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


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    base = args.base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=args.timeout) as client:
        model = args.model
        if model is None:
            response = await client.get(f"{base}/v1/models")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        prompts = make_prompts(args.prompt_kind, args.num_prompts, args.input_len, args.seed)
        delays = arrival_delays(args.num_prompts, args.request_rate, args.seed)
        limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        url = f"{base}/v1/completions"

        async def limited(body: dict[str, Any]) -> RequestResult:
            if limit is None:
                return await _one_request(client, url, body, args.timeout)
            async with limit:
                return await _one_request(client, url, body, args.timeout)

        tasks = []
        start = time.perf_counter()
        for prompt, delay in zip(prompts, delays):
            if delay:
                await asyncio.sleep(delay)
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            tasks.append(asyncio.create_task(limited(body)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return report(results, duration, args, model)


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


def run(args: argparse.Namespace) -> int:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    result = asyncio.run(benchmark(args))
    if args.json:
        print(json.dumps(result, indent=None))
    else:
        _print_table(result)
    return 0 if result["completed"] else 1
