"""`tokenloom bench <kind>`: benchmarks, one subcommand each.

To add one, write a module with `add_parser(sub)` that registers its subparser and sets
`func`, and list its module name in `_BENCH_MODULES`. Modules are imported when the parser is
built, so keep their top level light (argparse only; import engines and clients inside `func`).
"""
from __future__ import annotations

import argparse
import importlib

_BENCH_MODULES = [
    "tokenloom.bench.serve",
    "tokenloom.bench.throughput",
    "tokenloom.bench.latency",
]


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmark a server or the engine")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="KIND")
    for name in _BENCH_MODULES:
        importlib.import_module(name).add_parser(kinds)
