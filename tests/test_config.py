"""EngineConfig.validate: what the engine core could not use is refused in the caller, naming the
field (a wrong type used to end the core at start-up with only "exited with code 1")."""
from __future__ import annotations

from pathlib import Path

import pytest

from tokenloom.config import EngineConfig


@pytest.mark.parametrize("fields,message", [
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be of type bool, got 'no'"),
    ({"kv_cache_memory_bytes": 2e9}, "kv_cache_memory_bytes must be of type int or None, got 2000000000.0"),
    ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes must be a positive number of bytes"),
    ({"max_model_len": "8k"}, "max_model_len must be of type int or None, got '8k'"),
    ({"max_num_seqs": True}, "max_num_seqs must be of type int, got True"),
    ({"override_generation_config": [1]}, "override_generation_config must be of type dict or None"),
    ({"device": "tpu"}, "device must be 'cpu' or 'cuda'"),
    ({"scheduling_policy": "lifo"}, "scheduling_policy must be 'fcfs' or 'priority', got 'lifo'"),
    ({"generation_config": ""}, "generation_config must be 'auto', 'vllm' or a folder"),
    ({"seed": 1.5}, "seed must be of type int or None, got 1.5"),
])
def test_a_bad_field_is_a_value_error_naming_it(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**fields).validate()


def test_good_configs_pass_and_a_path_is_a_path():
    for fields in ({}, {"device": "cuda:1"}, {"kv_cache_memory_bytes": 1 << 26, "override_generation_config": {"top_k": 5}}):
        EngineConfig(**fields).validate()
    config = EngineConfig(model=Path("/models/x.gguf"), trace_path=Path("/tmp/t.json"))
    config.validate()
    assert (config.model, config.trace_path) == ("/models/x.gguf", "/tmp/t.json")


def test_llm_takes_a_pathlib_model_and_no_seed(smollm2_path):
    """`LLM(Path(...), seed=None)`, as older vLLM scripts write it: the engine starts (the Path
    failed to cross to the core, and seed=None ended the core at start-up)."""
    from tokenloom import LLM, SamplingParams

    with LLM(Path(smollm2_path), seed=None, kv_cache_memory_bytes=1 << 26, max_model_len=128,
             enable_ledger=False) as llm:
        assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
