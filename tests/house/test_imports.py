"""The package's imports run one way: from the request path's entry down to the kernels, with the
shared vocabulary at the bottom (DESIGN.md, "Dependencies flow one way").

Read from the source with `ast`, so it holds for every import, also those inside functions and
under `TYPE_CHECKING`: a type-only import upward is still a dependency a reader must follow. A
string import (`importlib.import_module(name)`, `__import__(name)`) counts too: its name is read
from the literal, or from the module-level constant (a string, a list or a dict of them) or the
loop over one that it comes from; one whose name cannot be read that way fails the test.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tokenloom

PACKAGE_DIR = Path(tokenloom.__file__).parent

# The allowed direction, written once: a module may import modules of its own layer or of a
# lower one (a smaller number), never a higher one. Top-level modules not named here are the
# shared vocabulary (messages, outputs, sampling_params, config, the scheduler-to-runner
# contract) and sit at the bottom.
LAYERS: dict[str, int] = {
    # The `tokenloom` command: each subcommand's wiring, over everything it runs. Listed before
    # `tokenloom.entrypoints` (the first matching prefix names a module's layer).
    "tokenloom.entrypoints.cli": 11,
    # Tools beside the engine, which only the command imports (test_only_the_command_imports_tools):
    # the benchmarks drive the engine through the entry points and their baselines; the ledger's
    # offline analysis reads a trace the ledger wrote.
    "tokenloom.bench": 10,
    "tokenloom.analysis": 10,
    "tokenloom.entrypoints": 9,
    "tokenloom.engine": 8,
    "tokenloom.core": 7,
    # Grammars and matchers of structured outputs: the scheduler's (core) helpers, and what the
    # caller's input processor (engine) validates a request with; below them, above the runner.
    "tokenloom.structured_output": 6,
    "tokenloom.executor": 6,
    "tokenloom.worker": 5,
    "tokenloom.model": 4,
    "tokenloom.attention": 3,
    "tokenloom.sample": 3,
    "tokenloom.spec_decode": 3,  # the n-gram proposer the model runner calls (numpy only)
    "tokenloom.ops": 2,
    "tokenloom.metrics": 1,
}
VOCABULARY = 0
# `tokenloom/__init__.py` is the public facade (`from tokenloom import LLM`): it sits above
# everything and imports the entry points lazily.
FACADE = "tokenloom"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def layer_of(module: str) -> int:
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return VOCABULARY


def _is_string_import(call: ast.Call) -> bool:
    """`importlib.import_module(...)`, `import_module(...)` (imported from importlib) or
    `__import__(...)`."""
    f = call.func
    if isinstance(f, ast.Attribute):
        return f.attr == "import_module" and isinstance(f.value, ast.Name) and f.value.id == "importlib"
    return isinstance(f, ast.Name) and f.id in ("import_module", "__import__")


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _string_import_names(tree: ast.Module, arg: ast.expr) -> set[str] | None:
    """The module names a string import's argument can hold; None when they cannot be read from
    the source (the caller reports it)."""
    # Module-level constants, and what each loop variable iterates over (anywhere in the module).
    constants: dict[str, ast.expr] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                if isinstance(t, ast.Name):
                    constants[t.id] = stmt.value
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            constants[stmt.target.id] = stmt.value
    loops = {n.target.id: n.iter for n in ast.walk(tree)
             if isinstance(n, (ast.For, ast.comprehension)) and isinstance(n.target, ast.Name)}

    def names(e: ast.expr, depth: int = 0) -> set[str] | None:
        if depth > 4:
            return None
        if isinstance(e, ast.Constant) and isinstance(e.value, str):
            return {e.value}
        if isinstance(e, ast.Name):
            source = constants.get(e.id) or loops.get(e.id)
            if source is None:
                return None
            if isinstance(source, ast.Name):
                return names(source, depth + 1)
            return _strings(source) or None
        if isinstance(e, ast.Subscript) and isinstance(e.value, ast.Name):  # CONST[key]: its values
            source = constants.get(e.value.id)
            if isinstance(source, ast.Dict):
                return set().union(*(_strings(v) for v in source.values)) or None
            return (_strings(source) or None) if source is not None else None
        return None

    return names(arg)


def package_imports(unresolved: list[str] | None = None) -> dict[str, set[str]]:
    """module -> the tokenloom modules it imports (a `from pkg import name` counts as importing
    `pkg.name` when that is a module, else `pkg`; a string import counts as importing the module
    it names). String imports whose names cannot be read are appended to `unresolved`."""
    modules = {module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _is_string_import(node):
                targets = _string_import_names(tree, node.args[0]) if node.args else None
                if targets is None:
                    if unresolved is not None:
                        unresolved.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{node.lineno}")
                    continue
                deps.update(t for t in targets if t == "tokenloom" or t.startswith("tokenloom."))
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("tokenloom"))
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("tokenloom"):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    deps.add(sub if sub in modules else target)
        deps.discard(name)
        graph[name] = {d for d in deps if d in modules}
    return graph


def test_no_import_runs_upward() -> None:
    upward = [
        f"{mod} (layer {layer_of(mod)}) imports {dep} (layer {layer_of(dep)})"
        for mod, deps in sorted(package_imports().items()) if mod != FACADE
        for dep in sorted(deps) if layer_of(dep) > layer_of(mod)
    ]
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_string_imports_are_read() -> None:
    """Every `importlib.import_module` / `__import__` names its module where this test can read
    it (a literal, or a module-level constant), so the layering check above sees it."""
    unresolved: list[str] = []
    graph = package_imports(unresolved)
    assert not unresolved, "string imports whose module this test cannot read:\n" + "\n".join(unresolved)
    # They are seen: the lazy facade of tokenloom.model and the bench subcommands' registry.
    assert "tokenloom.model.loader" in graph["tokenloom.model"]
    assert "tokenloom.bench.serve" in graph["tokenloom.bench"]


def test_no_import_cycle() -> None:
    graph = package_imports()
    # A package's __init__ re-exporting its own modules is not a cycle a reader has to follow.
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# Packages the engine never runs: the command line reaches them, nothing on the serving path does.
TOOLS = ("tokenloom.bench", "tokenloom.analysis")
COMMAND = "tokenloom.entrypoints.cli"


def test_only_the_command_imports_tools() -> None:
    def tool_of(module: str) -> str | None:
        return next((t for t in TOOLS if module == t or module.startswith(t + ".")), None)

    reached = [
        f"{mod} imports {dep}"
        for mod, deps in sorted(package_imports().items()) if mod != COMMAND
        for dep in sorted(deps) if tool_of(dep) is not None and tool_of(dep) != tool_of(mod)
    ]
    assert not reached, "imports of bench/analysis outside the command line:\n" + "\n".join(reached)


@pytest.mark.parametrize("module", ["tokenloom.messages", "tokenloom.outputs",
                                    "tokenloom.sampling_params", "tokenloom.config",
                                    "tokenloom.kv_cache_spec"])
def test_vocabulary_exists_and_is_at_the_bottom(module: str) -> None:
    graph = package_imports()
    assert module in graph
    assert all(layer_of(d) == VOCABULARY for d in graph[module]), graph[module]
