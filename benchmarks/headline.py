"""The README's headline figures and the results page's tables, printed from benchmarks/results.json.

    python benchmarks/headline.py            # the README's headline table
    python benchmarks/headline.py --results  # the per-machine tables of benchmarks/README.md
    python benchmarks/headline.py --write    # rewrite both blocks in place (between their markers)

benchmarks/results.json is the one place the current figures are written; tests/house/test_docs.py
checks that README.md and benchmarks/README.md hold what this script prints. Standard library only.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results.json"
# (file, marker name, renderer name): the block between `<!-- NAME:begin -->` and `<!-- NAME:end -->`.
BLOCKS = (("README.md", "headline"), ("benchmarks/README.md", "results"))


def load(path: Path = RESULTS) -> dict:
    return json.loads(path.read_text())


def headline(data: dict) -> str:
    """One table: each machine's headline rows, with the machine, the date and the commit."""
    lines = ["| machine | workload (prompts x in x out) | path | tokenloom | baseline, same run | ratio | measured |",
             "|---|---|---|---|---|---|---|"]
    for m in data["machines"]:
        for r in m["results"]:
            if r.get("headline"):
                lines.append(f"| {m['short']} | {r['workload']} | {r['path']} | {r['tokenloom']} | {r['baseline']} "
                             f"| **{r['ratio']}** | {r['date']}, `{r['commit']}` |")
    return "\n".join(lines) + "\n"


def results(data: dict) -> str:
    """One section per machine type: the machine, its table, the commands."""
    out = []
    for m in data["machines"]:
        out += [f"### {m['name']}", "",
                f"Machine: {m['cpu']}. Software: {m['software']}. Conditions: {m['load']}.", "",
                "| workload (prompts x in x out) | path | tokenloom | baseline, same run | ratio | date | commit |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {r['workload']} | {r['path']} | {r['tokenloom']} | {r['baseline']} | **{r['ratio']}** "
                f"| {r['date']} | `{r['commit']}` |" for r in m["results"]]
        out += ["", "Commands:", "", "```", *m["commands"], "```", ""]
    return "\n".join(out)


RENDER = {"headline": headline, "results": results}


def block_re(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- {name}:begin[^>]*-->\n)(.*?)(<!-- {name}:end -->)", re.S)


def current_block(text: str, name: str) -> str | None:
    m = block_re(name).search(text)
    return m.group(2) if m else None


def write(data: dict) -> None:
    for rel, name in BLOCKS:
        path = ROOT / rel
        text = path.read_text()
        if current_block(text, name) is None:
            raise SystemExit(f"{rel}: no <!-- {name}:begin --> ... <!-- {name}:end --> block")
        path.write_text(block_re(name).sub(lambda m: m.group(1) + RENDER[name](data) + m.group(3), text, count=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--results", action="store_true", help="print the results page's per-machine tables")
    g.add_argument("--write", action="store_true", help="rewrite the blocks in README.md and benchmarks/README.md")
    args = p.parse_args()
    data = load()
    if args.write:
        write(data)
    else:
        print(RENDER["results" if args.results else "headline"](data), end="")


if __name__ == "__main__":
    main()
