"""docs/configuration.md is generated from EngineArgs: regenerating it must change nothing, so a
field added or changed without rerunning `python -m tokenloom.entrypoints.engine_args` fails here."""
from __future__ import annotations

import dataclasses

from tokenloom.config import EngineConfig
from tokenloom.entrypoints.engine_args import REFERENCE_PATH, AsyncEngineArgs, EngineArgs, config_reference_markdown


def test_configuration_reference_is_current():
    assert REFERENCE_PATH.read_text() == config_reference_markdown(), (
        "docs/configuration.md is stale: run `python -m tokenloom.entrypoints.engine_args`")


def test_every_argument_has_help_and_a_row():
    text = config_reference_markdown()
    for field in dataclasses.fields(AsyncEngineArgs):
        assert field.metadata.get("help"), f"{field.name} has no help text"
        assert f"| `{field.name}` |" in text


def test_engine_args_defaults_are_engine_configs():
    # One set of defaults: EngineArgs() describes EngineConfig() exactly (both resolved).
    from tokenloom.model.resolve import resolve_engine_config

    config = EngineConfig()
    resolve_engine_config(config)
    assert EngineArgs().create_engine_config() == config
