"""Every `TOKENLOOM_*` variable (and the `VLLM_*` fallbacks tokenloom honours) is read in one
module, `tokenloom/envs.py`, each with its doc line, as vLLM reads its own in `vllm/envs.py`.

Read from the source with `ast`: a read is `os.environ.get("TOKENLOOM_...")`,
`os.getenv("TOKENLOOM_...")` or `os.environ["TOKENLOOM_..."]` outside an assignment. Setting a
variable for child processes (`os.environ[...] = ...`, `setdefault`) is not a read.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import tokenloom
from tokenloom import envs

PACKAGE_DIR = Path(tokenloom.__file__).parent
_OWN = re.compile(r"^(TOKENLOOM_|VLLM_)")


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ"
            and isinstance(node.value, ast.Name) and node.value.id == "os")


def _key(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def env_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, variable) of each read of a TOKENLOOM_/VLLM_ variable in `tree`."""
    reads = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "get" and _is_environ(f.value):
                key = _key(node.args[0])
            elif (isinstance(f, ast.Attribute) and f.attr == "getenv" and isinstance(f.value, ast.Name)
                  and f.value.id == "os"):
                key = _key(node.args[0])
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            key = _key(node.slice)
        if key and _OWN.match(key):
            reads.append((node.lineno, key))
    return reads


def test_only_envs_reads_tokenloom_variables():
    offenders = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if path == PACKAGE_DIR / "envs.py":
            continue
        for line, key in env_reads(ast.parse(path.read_text(), str(path))):
            offenders.append(f"{path.relative_to(PACKAGE_DIR)}:{line} reads {key}")
    assert not offenders, "read these through tokenloom.envs:\n" + "\n".join(offenders)


def test_the_checker_sees_reads_and_not_writes():
    src = ('import os\nos.environ.get("TOKENLOOM_X")\nos.getenv("VLLM_Y", "1")\nos.environ["TOKENLOOM_Z"]\n'
           'os.environ["TOKENLOOM_W"] = "1"\nos.environ.setdefault("TOKENLOOM_V", "1")\nos.environ.get("CC")\n')
    assert env_reads(ast.parse(src)) == [(2, "TOKENLOOM_X"), (3, "VLLM_Y"), (4, "TOKENLOOM_Z")]


def test_every_variable_named_in_the_sources_is_declared_with_a_doc_line():
    """A `TOKENLOOM_*` name in a string of the package is a variable envs.py declares (or one
    of the few non-variable prefixes the bench scripts print)."""
    declared = set(envs.environment_variables)
    assert all(doc.strip() for _, doc in envs.environment_variables.values())
    not_variables = {"TOKENLOOM_LLAMACPP", "TOKENLOOM_VLLM_RESULT"}
    named = set()
    for path in PACKAGE_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                named.update(re.findall(r"\bTOKENLOOM_[A-Z0-9_]*[A-Z0-9]\b", node.value))
    assert named - declared - not_variables == set()


def test_reads_happen_at_call_time(monkeypatch):
    monkeypatch.setenv("TOKENLOOM_F32_PANEL", "0")
    assert envs.TOKENLOOM_F32_PANEL is False
    monkeypatch.delenv("TOKENLOOM_F32_PANEL")
    assert envs.TOKENLOOM_F32_PANEL is True
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", "/tmp/x")
    monkeypatch.delenv("TOKENLOOM_TORCH_PROFILER_DIR", raising=False)
    assert envs.torch_profiler_dir() == "/tmp/x"
