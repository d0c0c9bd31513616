"""The README is the front door and the figures live in one place (issue 48):

- README.md stays under 200 lines;
- its headline table, and the results page's per-machine tables, are what benchmarks/headline.py
  prints from benchmarks/results.json (regenerate with `python benchmarks/headline.py --write`);
- every page under docs/ is in mkdocs.yml's navigation, and every page the navigation names exists
  (`make docs` checks links and anchors in strict mode; this catches the nav without mkdocs).
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _headline():
    spec = importlib.util.spec_from_file_location("headline", ROOT / "benchmarks" / "headline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines; the details belong in docs/"
    assert not [i for i, line in enumerate(lines, 1) if len(line) > 300], "a README line over 300 characters"


@pytest.mark.parametrize("rel,name", [("README.md", "headline"), ("benchmarks/README.md", "results")])
def test_generated_tables_are_current(rel, name):
    h = _headline()
    block = h.current_block((ROOT / rel).read_text(), name)
    assert block is not None, f"{rel} lost its <!-- {name}:begin --> ... <!-- {name}:end --> markers"
    assert block == h.RENDER[name](h.load()), f"{rel} is stale: run python benchmarks/headline.py --write"


def test_headline_names_each_row_machine_date_and_commit():
    h = _headline()
    data = h.load()
    rows = [r for m in data["machines"] for r in m["results"]]
    assert any(r.get("headline") for r in rows)
    for m in data["machines"]:
        assert m["cpu"] and m["commands"], m["id"]
        for r in m["results"]:
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"]) and re.fullmatch(r"[0-9a-f]{7,40}", r["commit"]), r
    table = h.headline(data)
    assert len(table.splitlines()) == 2 + sum(bool(r.get("headline")) for r in rows)


def _nav_pages() -> set[str]:
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1]
    return set(re.findall(r":\s+([\w./-]+\.md)\s*$", nav, re.M))


def test_every_docs_page_is_in_the_nav_and_exists():
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    nav = _nav_pages()
    assert pages - nav == set(), "pages missing from mkdocs.yml's nav"
    assert nav - pages == set(), "nav entries without a page"


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert missing == []
