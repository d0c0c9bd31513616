"""vLLM's way of building engines, run on tokenloom: EngineArgs / AsyncEngineArgs,
LLMEngine.from_engine_args / AsyncLLMEngine.from_engine_args and the add_cli_args/from_cli_args
round trip, on the real embedded model (one LLM for the reference, one LLMEngine, one AsyncLLM)."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging

import pytest

from tokenloom import (LLM, AsyncEngineArgs, AsyncLLMEngine, EngineArgs, LLMEngine, RequestOutputKind,
                       SamplingParams)
from tokenloom.config import EngineConfig
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.engine_args import VLLM_ONLY_ARGS
from tokenloom.model.resolve import resolve_engine_config

KV_BYTES = 64 * 1024**2
# Small enough to start fast; each differs from EngineConfig's default, so a field lost on the way
# to the engine shows in `engine.config`.
SETTINGS = dict(max_model_len=256, kv_cache_memory_bytes=KV_BYTES, max_num_seqs=4, seed=7)
PROMPTS = ["The capital of France is", "Hello, my name is"]
GREEDY = dict(max_tokens=8, temperature=0, ignore_eos=True)


def resolved(**kwargs) -> EngineConfig:
    """The EngineConfig of these fields as create_engine_config() returns it: resolved."""
    config = EngineConfig(**kwargs)
    resolve_engine_config(config)
    return config


def _warnings(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


@pytest.fixture(scope="module")
def reference_ids(smollm2_path: str) -> list[list[int]]:
    """What the offline API generates greedily with the same settings."""
    with LLM(smollm2_path, dtype="float32", **SETTINGS) as llm:
        return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, SamplingParams(**GREEDY))]


def test_vllm_engine_loop_matches_llm_generate(smollm2_path, reference_ids):
    # vLLM's examples/offline_inference/llm_engine_example.py, with tokenloom's imports.
    engine = LLMEngine.from_engine_args(EngineArgs(model=smollm2_path, dtype="float", **SETTINGS))
    try:
        assert engine.config == resolved(model=smollm2_path, dtype="float32", **SETTINGS)
        assert engine.max_model_len == 256
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, SamplingParams(**GREEDY))
        finished: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = list(out.outputs[0].token_ids)
    finally:
        engine.shutdown()
    assert [finished[str(i)] for i in range(len(PROMPTS))] == reference_ids


def test_async_engine_args_generate_streams_and_finishes(smollm2_path, reference_ids, caplog):
    assert AsyncLLMEngine is AsyncLLM  # as vLLM V1 aliases it

    async def run() -> tuple[EngineConfig, list]:
        # vLLM's enable_log_requests: an INFO line as each request is added and aborted.
        engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=smollm2_path, dtype="float", **SETTINGS,
                                                                 enable_log_requests=True),
                                                 start_engine_loop=True)
        try:
            params = SamplingParams(output_kind=RequestOutputKind.DELTA, **GREEDY)
            outs = [out async for out in engine.generate(PROMPTS[0], params, "a")]
            gen = engine.generate(PROMPTS[0], params, "b")
            await gen.__anext__()
            await gen.aclose()  # closing it early aborts the request
            return engine.config, outs
        finally:
            engine.shutdown()
            await asyncio.sleep(0)

    with caplog.at_level(logging.INFO, logger="tokenloom.engine.async_llm"):
        config, outs = asyncio.run(run())
    logged = [r.getMessage() for r in caplog.records if r.name == "tokenloom.engine.async_llm"]
    assert logged == ["Added request a.", "Added request b.", "Aborted request(s) b."]
    assert config == resolved(model=smollm2_path, dtype="float32", **SETTINGS)
    assert len(outs) > 1, "the tokens were not streamed"
    assert [out.finished for out in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].outputs[0].finish_reason == "length"
    assert [t for out in outs for t in out.outputs[0].token_ids] == reference_ids[0]


def test_from_engine_args_refuses_stat_loggers():
    # Refused before anything starts: tokenloom has its own metrics, not vLLM's logger classes.
    args = EngineArgs(**SETTINGS)
    with pytest.raises(ValueError, match="stat_loggers"):
        LLMEngine.from_engine_args(args, stat_loggers=[object()])
    with pytest.raises(ValueError, match="stat_loggers"):
        AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**SETTINGS), stat_loggers=[object()])


def test_cli_args_take_vllm_flags(caplog, smollm2_path):
    parser = argparse.ArgumentParser()
    assert EngineArgs.add_cli_args(parser) is parser
    args = parser.parse_args([
        "--model", smollm2_path, "--max-model-len", "1k", "--dtype", "float", "--enforce-eager",
        "--max-num-seqs", "8", "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(KV_BYTES),
        "--seed", "3", "--override-generation-config", '{"temperature": 0.5}',
    ])
    engine_args = EngineArgs.from_cli_args(args)
    assert type(engine_args) is EngineArgs
    with caplog.at_level(logging.WARNING, logger="tokenloom"):
        config = engine_args.create_engine_config()
    # --enforce-eager is a field of its own (CUDA graphs off), not one of vLLM's no-effect flags.
    assert config == resolved(model=smollm2_path, max_model_len=1000, dtype="float32", max_num_seqs=8,
                                  enable_prefix_caching=False, kv_cache_memory_bytes=KV_BYTES, seed=3,
                                  override_generation_config={"temperature": 0.5}, enforce_eager=True)
    warned = _warnings(caplog)
    assert "enforce-eager" not in warned and "gpu-memory-utilization" not in warned

    # AsyncEngineArgs: the same options, and vLLM's --swap-space / --disable-log-stats parse too.
    parser = AsyncEngineArgs.add_cli_args(argparse.ArgumentParser())
    async_args = AsyncEngineArgs.from_cli_args(parser.parse_args(["--swap-space", "4", "--disable-log-stats"]))
    assert type(async_args) is AsyncEngineArgs and not async_args.enable_log_requests
    assert AsyncEngineArgs.from_cli_args(parser.parse_args(["--enable-log-requests"])).enable_log_requests
    assert not AsyncEngineArgs(disable_log_requests=True, enable_log_requests=True).enable_log_requests
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tokenloom"):
        assert async_args.create_engine_config() == resolved()
    assert "swap-space" in _warnings(caplog) and "disable-log-stats" in _warnings(caplog)


def test_keywords_as_vllm_takes_them(caplog, smollm2_path):
    vllm_only = dict(gpu_memory_utilization=0.9, trust_remote_code=True, swap_space=4, disable_log_stats=True)
    assert set(vllm_only) == set(VLLM_ONLY_ARGS)
    engine_args = EngineArgs(smollm2_path, max_model_len=512, **vllm_only)
    assert "max_model_len=512" in repr(engine_args)
    with caplog.at_level(logging.WARNING, logger="tokenloom"):
        config = dataclasses.replace(engine_args, dtype="half").create_engine_config()
    assert config == resolved(model=smollm2_path, max_model_len=512, dtype="float16")
    warned = _warnings(caplog)
    assert all(name.replace("_", "-") in warned for name in vllm_only), warned


def test_threads_flag_fixes_the_engine_cores_thread_count():
    """`-t N` / `--threads N` (llama.cpp's spelling): the engine core computes on N threads, fixed
    (no adaptation), as its CPU line says; 0 is refused by name."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for argv in (["-t", "1"], ["--threads", "1"]):
        assert EngineArgs.from_cli_args(parser.parse_args(argv)).create_engine_config().num_threads == 1
    with pytest.raises(ValueError, match=r"num_threads \(--threads\) must be a positive integer"):
        EngineArgs(num_threads=0).create_engine_config()
    with LLM(num_threads=1, kv_cache_memory_bytes=32 * 1024**2, max_model_len=256) as llm:
        assert "threads 1 of" in llm.llm_engine.info.cpu and "fixed" in llm.llm_engine.info.cpu
        out = llm.generate("Hi", SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_unknown_keyword_and_bad_value_are_named():
    with pytest.raises(TypeError, match="tokenizer_pool_size"):
        EngineArgs(model="/models/m.gguf", tokenizer_pool_size=2)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineArgs(max_num_seqs=0).create_engine_config()
    with pytest.raises(ValueError, match="^dtype"):
        EngineArgs(dtype="fp8").create_engine_config()


def test_vllm_loading_arguments_under_vllm_names(smollm2_path):
    """vLLM's tokenizer and load arguments parse as its flags and keywords, and reach the config;
    a bad value names its field before anything starts."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", "org/name-GGUF:Q4_K_M", "--tokenizer", "org/base", "--tokenizer-mode", "slow",
                              "--revision", "v1", "--tokenizer-revision", "v2", "--hf-token", "t",
                              "--download-dir", "/data/hub", "--load-format", "gguf", "--max-logprobs", "5"])
    # The arguments as parsed (create_engine_config would download the hub ids: tests/model/test_hub.py).
    assert EngineArgs.from_cli_args(args) == EngineArgs(
        model="org/name-GGUF:Q4_K_M", tokenizer="org/base", tokenizer_mode="slow", revision="v1",
        tokenizer_revision="v2", hf_token="t", download_dir="/data/hub", load_format="gguf", max_logprobs=5)
    with pytest.raises(ValueError, match="^load_format must be one of auto, safetensors, gguf, dummy"):
        EngineArgs(load_format="pt").create_engine_config()
    with pytest.raises(ValueError, match=r"^max_logprobs must be an integer in \[0, 20\]"):
        EngineArgs(max_logprobs=21).create_engine_config()
    with pytest.raises(ValueError, match="^load_format='safetensors'|load_format='safetensors'"):
        LLM(smollm2_path, load_format="safetensors", max_model_len=64, multiprocess=False)
    try:
        import mistral_common  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"^tokenizer_mode='mistral' needs mistral_common.*tokenloom\[mistral\]"):
            LLM(smollm2_path, tokenizer_mode="mistral")


def test_max_logprobs_limits_requests(smollm2_path):
    """A request asking for more logprobs than the engine's max_logprobs is refused, naming the
    field and the limit; at the limit it runs."""
    with LLM(smollm2_path, max_logprobs=2, multiprocess=False, **SETTINGS) as llm:
        for field in ("logprobs", "prompt_logprobs"):
            with pytest.raises(ValueError, match=rf"^{field}=3 is more than this engine's max_logprobs \(2\)"):
                llm.generate(PROMPTS[0], SamplingParams(**{field: 3}, **GREEDY), use_tqdm=False)
        out = llm.generate(PROMPTS[0], SamplingParams(logprobs=2, **GREEDY), use_tqdm=False)[0].outputs[0]
        assert all(len(step) >= 2 for step in out.logprobs)


def test_create_engine_config_resolves_the_model_once(smollm2_path, tmp_path):
    """vLLM's create_engine_config: the model's files decide the context length (a GGUF's
    context_length, an HF config.json's max_position_embeddings), the local paths, the runner and
    the model's name as given; a max_model_len above the model's is one error naming the field and
    the limit, before any engine starts. A config resolves once: the core takes it as it is."""
    from transformers import LlamaConfig

    config = EngineArgs().create_engine_config()
    assert (config.model, config.tokenizer, config.max_model_len) == (smollm2_path, smollm2_path, 8192)
    assert (config.runner, config.model_name) == ("generate", "SmolLM2-135M-Instruct")
    assert EngineArgs(smollm2_path, max_model_len=512).create_engine_config().max_model_len == 512
    with pytest.raises(ValueError, match=r"^max_model_len=8193 is larger than the model's context length \(8192, "
                                         r"the GGUF's context_length\): pass max_model_len <= 8192"):
        EngineArgs(smollm2_path, max_model_len=8193).create_engine_config()
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    assert EngineArgs(str(tmp_path), load_format="dummy").create_engine_config().max_model_len == 128
    with pytest.raises(ValueError, match=r"^max_model_len=129 is larger than the model's context length \(128, "
                                         r"max_position_embeddings in its config.json\)"):
        EngineArgs(str(tmp_path), max_model_len=129, load_format="dummy").create_engine_config()
    with pytest.raises(ValueError, match="resolved already"):
        resolve_engine_config(config)
