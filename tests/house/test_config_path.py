"""One config path (docs/design.md, "The config path"): an engine's settings travel entry -> args
-> config (resolved once) -> engine -> core -> runner, and never back.

Two checks. The run: `LLM(...)` is started in this process under a profiler that records every
tokenloom function called with an `EngineArgs` or `EngineConfig` among its locals; the modules so
visited that touch a traced field (the token budget, the model path, the context length) must
each be visited in one stretch (no return to a module), and the stages they belong to must come
in the path's order. The source: no module of the core or the runner assigns a traced field or
imports the resolution, so a later stage cannot decide a setting again (the worker once resolved
`max_model_len` itself).
"""
from __future__ import annotations

import ast
import functools
import sys
import threading
from pathlib import Path

import pytest

import tokenloom
from test_imports import module_name, package_imports

PACKAGE_DIR = Path(tokenloom.__file__).parent
TRACED_FIELDS = ("max_num_batched_tokens", "model", "max_model_len")

# The path's stages, in order; a module's stage is that of the first matching prefix.
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("args", ("tokenloom.entrypoints.engine_args", "tokenloom.entrypoints.arg_fields")),
    ("entry", ("tokenloom.entrypoints", "tokenloom.bench")),
    ("config", ("tokenloom.config", "tokenloom.model.resolve", "tokenloom.model.hub",
                "tokenloom.model.pooling_config")),
    ("engine", ("tokenloom.engine",)),
    ("core", ("tokenloom.core", "tokenloom.executor")),
    ("runner", ("tokenloom.worker", "tokenloom.model", "tokenloom.attention", "tokenloom.sample",
                "tokenloom.spec_decode", "tokenloom.ops")),
]
ORDER = ["entry", "args", "config", "engine", "core", "runner"]
# The resolution: the config stage's modules that decide fields (tokenloom.config only declares them).
RESOLUTION = ("tokenloom.model.resolve", "tokenloom.model.hub", "tokenloom.model.pooling_config")


def stage_of(module: str) -> str | None:
    for stage, prefixes in STAGES:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return stage
    return None


@functools.cache
def _sources() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in PACKAGE_DIR.rglob("*.py")}


def touches(tree: ast.Module, field: str) -> bool:
    """The module reads, sets or declares `field`: an attribute `.field`, a keyword `field=`, or
    an annotated field of that name (EngineArgs' declaration)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == field:
            return True
        if isinstance(node, ast.keyword) and node.arg == field:
            return True
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == field:
            return True
    return False


def assigns(tree: ast.Module, field: str) -> list[int]:
    """Lines where the module assigns `<something config-like>.field`."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr == field and isinstance(node.ctx, ast.Store)
            and "config" in ast.unparse(node.value)]


# A tiny Llama with random weights (load_format="dummy") and SmolLM2's tokenizer: the engine's
# whole start-up path, without a real model's load.
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 49152, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}


@pytest.fixture(scope="module")
def visits(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The tokenloom modules that receive the engine's arguments or config, in the order of the
    calls, while `LLM(...)` starts in this process (a repeat in a row collapsed)."""
    import json

    from tokenloom import LLM
    from tokenloom.config import EngineConfig
    from tokenloom.entrypoints.engine_args import EngineArgs

    model = tmp_path_factory.mktemp("tiny-llama")
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    root = str(PACKAGE_DIR)
    seen: list[str] = []

    def profile(frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
        if event != "call" or not frame.f_code.co_filename.startswith(root):
            return
        if any(isinstance(v, (EngineArgs, EngineConfig)) for v in frame.f_locals.values()):
            module = frame.f_globals["__name__"]
            if not seen or seen[-1] != module:
                seen.append(module)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        llm = LLM(str(model), tokenizer=smollm2_path, load_format="dummy", max_model_len=64,
                  max_num_batched_tokens=64, kv_cache_memory_bytes=4 * 1024**2, multiprocess=False, enable_ledger=False)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    llm.shutdown()
    return seen


def _monotone(modules: list[str]) -> bool:
    """The stages come in the path's order; the core and the runner alternate freely (the core
    drives the runner step after step), but nothing after them goes back to an earlier stage."""
    ranks = [min(ORDER.index(stage_of(m)), ORDER.index("core")) for m in modules]  # type: ignore[arg-type]
    return ranks == sorted(ranks)


def test_the_config_travels_entry_args_config_engine_core_runner(visits: list[str]) -> None:
    route = [m for m in visits if m != "tokenloom.config"]  # the config's own methods: any stage calls them
    assert None not in [stage_of(m) for m in route], route
    first = list(dict.fromkeys(stage_of(m) for m in route))
    assert first == ORDER, " -> ".join(route)
    assert _monotone(route), " -> ".join(route)


@pytest.mark.parametrize("field", TRACED_FIELDS)
def test_a_setting_travels_without_returning_to_a_module(visits: list[str], field: str) -> None:
    """The modules of the config's route that touch `field`: each reached once (a module that
    decided or read it and gets it back later is the round trip this rule removes)."""
    sources = _sources()
    # tokenloom.config holds the config's own methods (validate, properties), which every stage
    # calls on it: reading the config, not a stop on its path.
    touching = [m for m in visits if m != "tokenloom.config" and touches(sources[m], field)]
    path = [m for i, m in enumerate(touching) if i == 0 or touching[i - 1] != m]
    returns = sorted({m for m in path if path.count(m) > 1})
    assert not returns, f"{field}: the path returns to {returns}: {' -> '.join(path)}"
    assert _monotone(path), f"{field}: {' -> '.join(path)}"
    assert {"args", "runner"} <= {stage_of(m) for m in path}, f"{field}: {' -> '.join(path)}"


def test_only_the_resolution_assigns_a_setting() -> None:
    """After the config stage, a traced field is only read: the core and the runner never assign
    one (assigning in a later stage is deciding it again)."""
    late = [f"{module}:{line} assigns .{field}"
            for module, tree in _sources().items() if stage_of(module) in ("engine", "core", "runner")
            and module not in RESOLUTION
            for field in TRACED_FIELDS for line in assigns(tree, field)]
    assert not late, "\n".join(late)


def test_core_and_runner_do_not_import_the_resolution() -> None:
    graph = package_imports()
    back = [f"{module} imports {dep}" for module, deps in sorted(graph.items())
            if stage_of(module) in ("core", "runner") and module not in RESOLUTION
            for dep in sorted(deps) if dep in RESOLUTION]
    assert not back, "the core and the runner take a resolved config:\n" + "\n".join(back)
