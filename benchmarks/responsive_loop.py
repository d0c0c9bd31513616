"""Issue 21's responsiveness figures: /health latency and a concurrent stream's gaps while 20 MB
prompts are posted back to back, against the same server with nothing big in flight.

    PYTHONPATH=src python benchmarks/responsive_loop.py [--tree OTHER_SRC_DIR]

`--tree` also runs the server of another source tree (e.g. the code before the fix) the same way,
side by side. The probe is tests/reliability/reliability_helpers.probe_while_in_flight: 20 GET
/health at 10 Hz once the stream's first chunk is in.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "reliability"))

from fuzz_sampling_params import cpu_model  # noqa: E402
from reliability_helpers import SMALL_SERVER_ARGS, probe_while_in_flight, running_server  # noqa: E402

BIG = json.dumps({"prompt": "hello " * (20_000_000 // 6), "max_tokens": 4}).encode()


def summary(result: dict) -> dict:
    lat = [x * 1e3 for x in result["health_latencies"]]
    gaps = [x * 1e3 for x in result["stream_gaps"]]
    return {
        "health_ms_max": round(max(lat), 1),
        "health_ms_median": round(statistics.median(lat), 1),
        "health_over_100ms": sum(x > 100 for x in lat),
        "health_statuses": sorted(set(result["health_statuses"])),
        "stream_gap_ms_max": round(max(gaps), 0) if gaps else None,
        "stream_gap_ms_median": round(statistics.median(gaps), 0) if gaps else None,
        "big_requests": len(result["big"]),
        "big_statuses": sorted({s for s, _ in result["big"]}),
    }


def run_tree(src: str, extra: list[str]) -> dict:
    os.environ["PYTHONPATH"] = src
    with running_server([*SMALL_SERVER_ARGS, *extra]) as srv:
        base = probe_while_in_flight(srv, None, stream_tokens=100)
        loaded = probe_while_in_flight(srv, BIG, stream_tokens=100)
    return {"baseline": summary(base), "20MB_in_flight": summary(loaded)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=None, help="another src/ directory to run the same way")
    args = ap.parse_args()
    results = {"cpu": cpu_model(), "this tree": run_tree(str(ROOT / "src"), ["--max-request-body-bytes", "25000000"])}
    if args.tree:
        results[args.tree] = run_tree(args.tree, [])
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
