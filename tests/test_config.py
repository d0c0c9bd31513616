"""EngineConfig.validate: what the engine core could not use is refused in the caller, naming the
field (a wrong type used to end the core at start-up with only "exited with code 1")."""
from __future__ import annotations

from pathlib import Path

import pytest

from tokenloom.config import EngineConfig, SpeculativeConfig


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


@pytest.mark.parametrize("spec,message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method must be one of ngram"),
    ({"model": "/models/draft", "num_speculative_tokens": 2}, "speculative_config.model='/models/draft': draft models"),
    ({"method": "ngram"}, r"speculative_config.num_speculative_tokens must be in \[1, 16\], got 0"),
    ({"method": "ngram", "num_speculative_tokens": 99}, r"num_speculative_tokens must be in \[1, 16\], got 99"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_min \(4\) must not exceed prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": "2"}, "speculative_config: Expected `int`, got `str`"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "speculative_config: Object contains unknown field `draft_tensor_parallel_size`"),
    ("ngram", "speculative_config must be a dict"),
    (SpeculativeConfig(num_speculative_tokens="2"), "speculative_config: Expected `int`, got `str`"),  # type: ignore[arg-type]
])
def test_a_bad_speculative_config_names_its_field(spec, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=spec).validate()  # type: ignore[arg-type]


def test_speculative_config_takes_vllms_spellings_and_defaults():
    for spec in ({"method": "ngram", "num_speculative_tokens": 3},
                 {"model": "[ngram]", "num_speculative_tokens": 3},
                 {"method": "[ngram]", "num_speculative_tokens": 3}):
        config = EngineConfig(speculative_config=spec)  # type: ignore[arg-type]
        config.validate()
        s = config.speculative_config
        assert (s.method, s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max) == ("ngram", 3, 5, 5)
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3,  # type: ignore[arg-type]
                                              "prompt_lookup_max": 4})
    config.validate()
    assert (config.speculative_config.prompt_lookup_min, config.speculative_config.prompt_lookup_max) == (4, 4)
