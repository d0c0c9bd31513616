"""LoRA adapters (enable_lora) against PEFT itself: a tiny random Llama with PEFT adapters saved as
PEFT saves them, run by transformers + peft as the reference, and by tokenloom on the float path
and the int8 path, alone and mixed in one batch with the base model and another adapter. The
engines run in float32, the reference's dtype ("auto" is bfloat16 on CPUs that multiply it
natively, where the tiny model's nearly flat logits flip greedy tokens)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tokenloom import LLM, LoRARequest, SamplingParams
from tokenloom.config import EngineConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_helpers import PROMPTS  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def requests(adapters: dict[str, str]) -> dict[str, LoRARequest | None]:
    return {"base": None, "all": LoRARequest("all", 1, adapters["all"]), "qv": LoRARequest("qv", 2, adapters["qv"])}


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_adapters_alone_and_mixed_match_peft(tiny, references, quantization):
    base_dir, adapters, _ = tiny
    loras = requests(adapters)
    llm = LLM(base_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, quantization=quantization,
              num_kv_blocks=128, max_model_len=256)
    try:
        for name, lora in loras.items():
            got = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora))
            if quantization == "none":
                assert got == references[name], name
            else:  # int8: the first tokens follow the float reference (the tiny random model's
                # logits are nearly flat, ~0.01 apart, so int8's rounding flips later ones)
                assert [t[:2] for t in got] == [t[:2] for t in references[name]], name
        # One batch: every prompt with each of base, "all" and "qv", interleaved.
        names = [n for _ in PROMPTS for n in loras]
        prompts = [p for p in PROMPTS for _ in loras]
        mixed = tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[loras[n] for n in names]))
        alone = {n: tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras[n])) for n in loras}
        expected = [alone[n][i // len(loras)] for i, n in enumerate(names)]
        if quantization == "none":
            assert mixed == expected
        else:  # the quantized kernels follow a step's row count: near ties may flip later on
            assert [t[:2] for t in mixed] == [t[:2] for t in expected]
    finally:
        llm.shutdown()
    assert references["all"] != references["base"] and references["qv"] != references["base"]


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_decode_steps_with_adapters_run_fused_as_the_eager_layers(tiny, quantization):
    """A decode step with adapters in it stays on the one C call (csrc/lora_decode.c adds their
    products between the step's kernels), and gives the eager layers' tokens, with logprobs
    equal to rounding: base, "all" and "qv" requests interleaved, of different lengths, so rows
    join and leave and each step maps its tokens to its adapters anew."""
    from tokenloom.ops import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("no C compiler for the CPU kernels")
    base_dir, adapters, _ = tiny
    loras = list(requests(adapters).values())
    llm = LLM(base_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, quantization=quantization,
              num_kv_blocks=128, max_model_len=256, multiprocess=False, enable_prefix_caching=False)
    try:
        model = llm.llm_engine.engine_core.engine_core.executor.driver_worker.model_runner.model
        step = model.fused_decode
        if step is None or step.step.dtype != torch.float32:
            pytest.skip("no float32 fused decode step on this CPU (its float32 weights are oneDNN's packed copies)")
        order = [loras[i % 3] for i in (1, 0, 2, 2, 1, 0, 1, 2, 0)]
        params = [SamplingParams(max_tokens=4 + 2 * i, temperature=0.0, ignore_eos=True, logprobs=1)
                  for i in range(len(order))]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(order))]
        runs = {}
        for fused in (False, True):
            model.fused_decode = step if fused else None
            before = step.steps
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=order)
            runs[fused] = [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in
                                                          zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                           for o in outs]
        assert step.steps - before >= max(p.max_tokens for p in params) - 1  # every decode step fused
    finally:
        llm.shutdown()
    for (eager_ids, eager_lp), (fused_ids, fused_lp) in zip(runs[False], runs[True]):
        assert fused_ids == eager_ids
        assert fused_lp == pytest.approx(eager_lp, abs=1e-3 if quantization == "int8" else 2e-5)


def test_prefix_cache_is_kept_apart_per_adapter(tiny, references):
    base_dir, adapters, _ = tiny
    loras = requests(adapters)
    long_prompt = PROMPTS[0] + " and " * 20  # two full blocks of 16
    llm = LLM(base_dir, dtype="float32", enable_lora=True, max_loras=1, num_kv_blocks=128, max_model_len=256)
    try:
        runs = []
        for name in ("all", "qv", "base", "all"):
            out = llm.generate([long_prompt], GREEDY, use_tqdm=False, lora_request=loras[name])[0]
            runs.append((name, list(out.outputs[0].token_ids), out.num_cached_tokens))
    finally:
        llm.shutdown()
    # Only the second "all" found its prompt cached: the others hash from their own adapter's root.
    assert [cached > 0 for _, _, cached in runs] == [False, False, False, True]
    assert runs[0][1] == runs[3][1]
    assert len({tuple(t) for _, t, _ in runs[:3]}) == 3


def test_loaded_adapters_are_bounded_by_max_cpu_loras(tiny, references):
    base_dir, adapters, _ = tiny
    loras = requests(adapters)
    llm = LLM(base_dir, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1, num_kv_blocks=128, max_model_len=256)
    try:
        for name in ("all", "qv", "all", "qv"):  # each load drops the other
            assert tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=loras[name])) == \
                references[name][:1]
        # Both in one batch: an adapter a running request uses is never dropped, even past the bound.
        both = llm.generate(PROMPTS[:2] + PROMPTS[:1], GREEDY, use_tqdm=False,
                            lora_request=[loras["all"], loras["all"], loras["qv"]])
        assert tokens(both) == references["all"][:2] + references["qv"][:1]
    finally:
        llm.shutdown()


def test_an_adapter_that_cannot_load_fails_its_request_alone(tiny, tmp_path, references):
    base_dir, adapters, _ = tiny
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(Path(adapters["all"], "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    llm = LLM(base_dir, dtype="float32", enable_lora=True, num_kv_blocks=128, max_model_len=256)
    try:
        outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[LoRARequest("broken", 7, str(broken)), None])
        assert outs[0].outputs[0].finish_reason == "error" and "LoRA adapter" in outs[0].error
        assert tokens(outs[1:]) == references["base"][1:2]
    finally:
        llm.shutdown()


def test_bad_adapters_and_settings_are_refused_by_name(tiny, tmp_path):
    base_dir, adapters, _ = tiny
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineConfig(enable_lora=True, max_lora_rank=0).validate()
    with pytest.raises(ValueError, match="enable_lora is not supported with tensor_parallel_size=2"):
        EngineConfig(enable_lora=True, tensor_parallel_size=2, distributed_executor_backend="mp").validate()
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=1).validate()
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, adapters["all"])
    dora = tmp_path / "dora"
    dora.mkdir()
    cfg = json.loads(Path(adapters["all"], "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    llm = LLM(base_dir, dtype="float32", enable_lora=True, max_lora_rank=4, num_kv_blocks=64, max_model_len=256)
    try:
        with pytest.raises(ValueError, match="rank is 8, above max_lora_rank=4"):
            llm.generate("Hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("all", 1, adapters["all"]))
        with pytest.raises(ValueError, match="no adapter_config.json"):
            llm.generate("Hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("none", 3, str(tmp_path)))
        with pytest.raises(ValueError, match="use_dora"):
            llm.generate("Hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("dora", 4, str(dora)))
        assert os.path.exists(adapters["all"])
    finally:
        llm.shutdown()


def test_embeddings_with_adapters(tiny):
    """runner="pooling" with LoRA adapters: each prompt's last hidden state is transformers +
    peft's with that adapter, in one batch mixing the base model and both adapters."""
    import torch
    import torch.nn.functional as F
    import transformers
    from peft import PeftModel

    base_dir, adapters, _ = tiny
    loras = requests(adapters)
    with LLM(base_dir, runner="pooling", enable_lora=True, max_lora_rank=8, dtype="float32", max_model_len=256) as llm:
        ids = llm.llm_engine.input_processor.encode_prompt(PROMPTS[1])
        outs = llm.embed([PROMPTS[1]] * 3, lora_request=list(loras.values()), use_tqdm=False)
    for (name, lora), out in zip(loras.items(), outs):
        model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        if lora is not None:
            model = PeftModel.from_pretrained(model, adapters[name]).eval().base_model.model
        with torch.no_grad():
            want = F.normalize(model.model(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=2e-5, rtol=1e-4, msg=name)
