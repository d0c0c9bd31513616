"""No function in `src/tokenloom` runs over `MAX_LINES` lines without its reason written beside it:
a one-line `# long because: ...` comment directly above it (above its first decorator, or above
the `def`). A long function is split along its seams into helpers whose names say what they do;
what is kept long (a step's hot path, a table) says why.

Read from the source with `ast`: every function and method counts, nested ones too, from its
first decorator (or its `def`) to its last line.
"""
from __future__ import annotations

import ast
from pathlib import Path

import tokenloom

PACKAGE_DIR = Path(tokenloom.__file__).parent
MAX_LINES = 80
REASON = "# long because:"


def first_line(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The function's first line: its first decorator's, else the `def`'s."""
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def has_reason(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether the line directly above the first decorator, or above the `def`, gives a reason."""
    for line_no in {first_line(node), node.lineno}:
        above = lines[line_no - 2].strip() if line_no >= 2 else ""
        if above.startswith(REASON) and above[len(REASON):].strip():
            return True
    return False


def long_functions(path: Path) -> list[tuple[str, int, int]]:
    """(name, first line, length) of each function in `path` over MAX_LINES without a reason."""
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - first_line(node) + 1  # type: ignore[operator]
            if length > MAX_LINES and not has_reason(lines, node):
                found.append((node.name, first_line(node), length))
    return found


def test_no_long_function_without_a_reason() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE_DIR.parent)}:{line} {name} ({length} lines)"
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        for name, line, length in long_functions(path)
    ]
    assert not offenders, (
        f"functions over {MAX_LINES} lines: split them along their seams, or write "
        f"'{REASON} ...' on the line above (its first decorator or its def):\n" + "\n".join(offenders))


def test_the_check_sees_decorators_and_reasons(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "a.py").write_text(f"@staticmethod\ndef f():\n{body}\n")  # 82 lines with its decorator
    (tmp_path / "b.py").write_text(f"{REASON} a table\n@staticmethod\ndef f():\n{body}\n")
    (tmp_path / "c.py").write_text(f"def f():\n{body}\n")  # 81 lines
    (tmp_path / "d.py").write_text(f"def f():\n{body[: body.rindex(chr(10))]}\n")  # 80 lines: fine
    (tmp_path / "e.py").write_text(f"{REASON}\ndef f():\n{body}\n")  # no reason given
    assert [len(long_functions(tmp_path / f"{n}.py")) for n in "abcde"] == [1, 0, 1, 0, 1]
