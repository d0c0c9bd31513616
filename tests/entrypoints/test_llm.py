"""The offline API end to end on the real model: greedy parity with transformers, and greedy
outputs that do not depend on how the engine batched, chunked, cached or preempted them."""
from __future__ import annotations

import os
import time

import pytest
import torch

from tokenloom import LLM, LoRARequest, SamplingParams
from tokenloom.ops import cpu_kernels

MAX_TOKENS = 24

QUESTIONS = [
    "What is the capital of France?",
    "Hi",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Translate to French: the cat sits on the mat.",
    "List three fruits.",
    "Explain in one paragraph why the sky is blue, mentioning Rayleigh scattering and the "
    "wavelengths of visible light, and say why sunsets look red.",
    "2+2=",
    "Who wrote Hamlet?",
    "Describe a rainbow to someone who has never seen one. " * 6,
    "Give me a haiku about autumn leaves.",
    "¿Cuál es la capital de España?",
    "日本の首都はどこですか？",
]


@pytest.fixture(scope="module")
def prompt_ids(llm_tokenizer) -> list[list[int]]:
    texts = [
        llm_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    return [llm_tokenizer.encode(t, add_special_tokens=False) for t in texts]


@pytest.fixture(scope="module")
def llm_tokenizer():
    from tokenloom.model.loader import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="module")
def reference(hf_smollm2, prompt_ids) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding to blur the comparison)."""
    outs = []
    for ids in prompt_ids:
        inp = torch.tensor([ids])
        with torch.inference_mode():
            gen = hf_smollm2.generate(
                inp, attention_mask=torch.ones_like(inp), max_new_tokens=MAX_TOKENS, do_sample=False,
                eos_token_id=2, pad_token_id=2,
            )
        outs.append(gen[0, len(ids):].tolist())
    return outs


def _greedy(llm: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def default_llm(float_llm):
    # float32, unquantized: the parity below is exact-greedy against transformers in float32
    # ("auto" picks bfloat16 on CPUs with native bf16, tested below; the embedded GGUF would
    # otherwise run quantized, tests/model/test_quant_*). Shared with test_sampling_e2e.
    return float_llm


def test_greedy_matches_transformers(default_llm, prompt_ids, reference):
    assert len(prompt_ids) >= 12 and len({len(p) for p in prompt_ids}) >= 8
    ours = _greedy(default_llm, prompt_ids)
    for i, (a, b) in enumerate(zip(ours, reference)):
        # transformers stops at EOS and includes it; so do we (EOS is the last output token).
        assert a == b, f"prompt {i} ({QUESTIONS[i][:30]!r}): ours {a} != transformers {b}"


def test_outputs_in_input_order_with_text(default_llm):
    outs = default_llm.generate(["The capital of France is", "1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [o.prompt for o in outs] == ["The capital of France is", "1, 2, 3, 4,"]
    assert "Paris" in outs[0].outputs[0].text
    assert all(o.finished and o.outputs[0].finish_reason in ("stop", "length") for o in outs)


@pytest.mark.parametrize(
    "kwargs, counter, every",
    [
        (dict(enable_chunked_prefill=True, max_num_batched_tokens=32), None, 1),
        # Whole prefills and no prefix cache, in one engine: each path differs from the default
        # engine's (test_greedy_matches_transformers), and neither hides the other's error.
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=1024, enable_prefix_caching=False), None, 1),
        # One sequence at a time: a third of the prompts (short to long) shows it as well.
        pytest.param(dict(max_num_seqs=1), None, 3, marks=pytest.mark.slow),
        # (A core in its own process batching every prompt is `default_llm`'s, whose greedy
        # parity test_greedy_matches_transformers checks.)
        # 16 blocks of 16 tokens cannot hold 12 prompts of 30-130 tokens and their outputs at
        # once: running requests are preempted and recomputed.
        (dict(num_kv_blocks=16, max_num_batched_tokens=128), "num_preemptions", 1),
    ],
    ids=["chunked-32", "no-chunking-no-prefix-cache", "max-seqs-1", "preemption"],
)
def test_greedy_identical_across_configs(kwargs, counter, every, prompt_ids, reference):
    """Scheduling configurations are the engine core's: it runs in this process (as with
    multiprocess=False); `default_llm` runs in its own process."""
    with LLM(**{"dtype": "float32", "kv_cache_memory_bytes": 128 * 1024**2, "quantization": None,
                "multiprocess": False, **kwargs}) as llm:
        assert _greedy(llm, prompt_ids[::every]) == reference[::every]
        if counter:
            state = llm.llm_engine.engine_core.call_utility("get_state")
            assert state[counter] > 0, state


def test_prefix_cache_hits_with_shared_prefix(default_llm):
    system = "You are a careful assistant who answers in one short sentence. " * 8
    prompts = [system + q for q in ("Name a color.", "Name a planet.", "Name a river.")]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    core = default_llm.llm_engine.engine_core
    first = default_llm.generate(prompts[:1], params, use_tqdm=False)
    before = core.call_utility("get_state")
    rest = default_llm.generate(prompts, params, use_tqdm=False)
    after = core.call_utility("get_state")
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= 3 * 64
    assert rest[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    # Finished requests hold no blocks: every block is free again (cached ones included).
    assert after["num_requests"] == 0 and after["num_runner_requests"] == 0
    assert after["num_free_blocks"] == after["num_total_blocks"]


@pytest.mark.slow
def test_bfloat16_kv_cache(prompt_ids, reference):
    """kv_cache_dtype="bfloat16" under the float32 model (the C decode kernel widens K/V as it
    reads them): twice the blocks in the same memory, and greedy outputs that still follow
    transformers'. Rounding K/V to bfloat16 moves logits by ~1e-2, so a near-tie may flip late
    in a reply; every reply must agree on its first 8 tokens and most replies entirely."""
    budget = 128 * 1024**2
    with LLM(dtype="float32", kv_cache_memory_bytes=budget, kv_cache_dtype="bfloat16",
             quantization=None) as llm:
        info = llm.llm_engine.engine_core.info
        ours = _greedy(llm, prompt_ids)
    assert (info.dtype, info.kv_cache_dtype) == ("float32", "bfloat16")
    # SmolLM2: 30 layers x (K, V) x 16 tokens x 3 KV heads x 64 dims, 2 bytes each (4 in float32).
    assert info.num_kv_blocks == budget // (30 * 2 * 16 * 3 * 64 * 2)
    for i, (a, b) in enumerate(zip(ours, reference)):
        assert a[:8] == b[:8], f"prompt {i}: {a} != {b}"
    assert sum(a == b for a, b in zip(ours, reference)) >= len(reference) - 2


def test_kv_cache_dtype_checked():
    from tokenloom.config import EngineConfig
    from tokenloom.worker.model_runner import resolve_kv_cache_dtype

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8").validate()
    with pytest.raises(ValueError, match="CPU only"):
        resolve_kv_cache_dtype("bfloat16", torch.float32, torch.device("cuda"))
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    # "auto" on the quantized CPU path (float32 activations): bfloat16 K/V where the C decode
    # kernel reads them; the float path keeps its own dtype, and a named dtype is what it says.
    cpu = torch.device("cpu")
    quantized_auto = torch.bfloat16 if cpu_kernels.load() is not None else torch.float32
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu, quantized=True) == quantized_auto
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu) == torch.float32
    assert resolve_kv_cache_dtype("float32", torch.float32, cpu, quantized=True) == torch.float32


def test_reset_prefix_cache_forgets_cached_blocks(default_llm):
    """`LLM.reset_prefix_cache()` (vLLM's): the same prompt again then hits nothing."""
    prompt = ["A long shared preamble for the reset test. " * 8]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    core = default_llm.llm_engine.engine_core
    default_llm.generate(prompt, params, use_tqdm=False)
    assert core.call_utility("get_state")["num_cached_free_blocks"] > 0
    assert default_llm.reset_prefix_cache() is True
    state = core.call_utility("get_state")
    assert state["num_cached_free_blocks"] == 0
    default_llm.generate(prompt, params, use_tqdm=False)
    assert core.call_utility("get_state")["prefix_cache_hits"] == state["prefix_cache_hits"]


def test_torch_profiler_traces_the_engine_cores_steps(default_llm, tmp_path, monkeypatch):
    """vLLM's LLM.start_profile / stop_profile with its VLLM_TORCH_PROFILER_DIR: a Chrome trace of
    what the engine core ran between the two (its process, not this one)."""
    import gzip
    import json

    monkeypatch.delenv("TOKENLOOM_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(RuntimeError, match="set TOKENLOOM_TORCH_PROFILER_DIR .or vLLM's VLLM_TORCH_PROFILER_DIR"):
        default_llm.start_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    default_llm.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        default_llm.start_profile()
    default_llm.generate(["The profiler sees this prompt"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    (path,) = default_llm.stop_profile()
    assert path.startswith(str(tmp_path / "traces")) and path.endswith(".pt.trace.json.gz")
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    assert {e.get("pid") for e in events if e.get("ph") == "X"} - {os.getpid()}  # the core's process
    assert any(str(e.get("name", "")).startswith("aten::") for e in events)  # the steps' torch ops
    with pytest.raises(RuntimeError, match="not running"):
        default_llm.stop_profile()


# Four more chat prompts for the bfloat16 parity count (16 in all).
MORE_QUESTIONS = [
    "What is 12 times 12?",
    "Name the largest planet in the solar system.",
    "Write one sentence about the history of Rome.",
    "What does a CPU do?",
]


@pytest.mark.slow
def test_bfloat16_follows_transformers_in_bfloat16(hf_smollm2, llm_tokenizer):
    """dtype="bfloat16" (what "auto" picks on CPUs with native bf16: packed bf16 matmuls and the
    C kernels' bf16 variants) against transformers run in bfloat16 on the same weights, greedy.

    Our bf16 path rounds to bfloat16 where transformers' does (each linear's output, the residual
    adds, the norm before its weight, RoPE's products and sum, SiLU before the product, and in
    attention the probabilities before P.V, as torch's fused SDPA kernel does), and sums where
    it sums in the same order: the matmuls' K in oneDNN's chunks for prefill-sized calls
    (ops/amx), the norm's squares in torch's order, SiLU's exp with torch's own expf, and the
    decode attention as torch's flash kernel computes it (its fexp_u20 softmax, MKL's bf16 gemm
    sums: bit for bit, tests/attention/test_cpu_kernels.py). Measured on the Sapphire
    Rapids-class Xeon: 14 of 16 replies identical with our AMX matmul and with oneDNN's
    (TOKENLOOM_AMX_BF16=0); 12 before the decode attention followed torch's, 10 and 12 before
    the prefill fixes, 8 before the rounding fixes (benchmarks/README.md, "bf16 parity"). The
    two left are prefill matmul orders: prompt 1 (31 tokens) is prefilled with the other 15 in
    one 680-row matmul, which sums K in oneDNN's chunks where transformers' 31-row matmul sums
    it in one go (alone, its prefill and decode steps are transformers' bit for bit), and
    prompt 6 (34 tokens) differs in one element of layer 0's down_proj. MKL's order was read on
    AVX512-BF16 CPUs and on AVX2-only ones (on a Zen 3, where torch's own bf16 GEMM sums each
    row as transformers' does whatever the row count: 15 of 16, 8 before the decode attention
    followed MKL's AVX2 order and the weights stayed row-major); elsewhere the decode attention
    agrees to rounding only, so there the bound stays the one before (12). On a Zen 4, where MKL
    runs its AVX2 order beside torch's AVX-512 softmax and oneDNN sums K in chunks of 512/1024
    (ops/amx): 14 of 16 (11 before the decode attention and the matmuls followed those, 13 while
    a padded prefill batch gave a prompt's attention its neighbours' padding).

    Prefix caching is off here: a prompt whose first blocks another prompt of the step already
    holds (the chat template's system prompt) attends its remaining tokens over cached keys with
    an explicit mask, another SDPA path than transformers' one causal prefill (13 of 16 with it
    on, the same prompt differing)."""
    import copy

    from tokenloom.model.loader import resolve_dtype
    from tokenloom.ops.cpu_features import detect

    native = detect().native_bf16 and torch.backends.mkldnn.is_available()
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
    texts = [llm_tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                               add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS + MORE_QUESTIONS]
    prompts = [llm_tokenizer.encode(t, add_special_tokens=False) for t in texts]
    hf_bf16 = copy.deepcopy(hf_smollm2).to(torch.bfloat16)
    # `.to()` also rounds the float32 RoPE inverse frequencies (a buffer) to bfloat16, which
    # transformers' own bfloat16 loading (`from_pretrained(dtype=torch.bfloat16)`, the same
    # weights otherwise) keeps in float32: put them back, or the reference is that quirk's.
    hf_bf16.model.rotary_emb.inv_freq = hf_smollm2.model.rotary_emb.inv_freq.clone()
    ref = []
    for ids in prompts:
        inp = torch.tensor([ids])
        with torch.inference_mode():
            gen = hf_bf16.generate(inp, attention_mask=torch.ones_like(inp),
                                   max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=2,
                                   pad_token_id=2)
        ref.append(gen[0, len(ids):].tolist())
    # In-process, so that every prompt is queued before the first step: the multiprocess core
    # starts stepping as soon as the first request arrives, and under load (a test beside it on
    # the other xdist worker) a first step with fewer prompts sums the bf16 prefill matmuls over
    # other row counts (12 of 16 once, in a fresh clone's suite).
    with LLM(dtype="bfloat16", kv_cache_memory_bytes=128 * 1024**2, quantization=None, multiprocess=False,
             enable_prefix_caching=False) as llm:
        info = llm.llm_engine.engine_core.info
        ours = _greedy(llm, prompts)
    assert (info.dtype, info.kv_cache_dtype) == ("bfloat16", "bfloat16")
    same = [i for i, (a, b) in enumerate(zip(ours, ref)) if a == b]
    need = 14 if cpu_kernels.bf16_decode_follows_torch() else 12
    assert len(same) >= need, [(i, a, b) for i, (a, b) in enumerate(zip(ours, ref)) if i not in same]


def test_bfloat16_prompt_logprobs_do_not_depend_on_its_batch(llm_tokenizer):
    """A bfloat16 model's prefill gives a prompt the same next-token log probabilities alone and
    beside a prompt of another length in the same step: SDPA's bf16 kernel would sum a padded
    batch's rows in chunks that depend on the padding (so a greedy reply flipped with its
    neighbours), so such prompts' attention runs per request."""
    texts = [llm_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=False) for q in (QUESTIONS[6], QUESTIONS[0])]
    a, b = (llm_tokenizer.encode(t, add_special_tokens=False) for t in texts)
    assert len(a) != len(b)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    with LLM(dtype="bfloat16", kv_cache_memory_bytes=64 * 1024**2, quantization=None, multiprocess=False,
             enable_prefix_caching=False) as llm:
        alone = llm.generate([{"prompt_token_ids": a}], params, use_tqdm=False)[0].outputs[0].logprobs[0]
        pair = llm.generate([{"prompt_token_ids": a}, {"prompt_token_ids": b}], params,
                            use_tqdm=False)[0].outputs[0].logprobs[0]
    assert {t: v.logprob for t, v in pair.items()} == {t: v.logprob for t, v in alone.items()}


@pytest.mark.slow
def test_beam_search_is_transformers_beam_search(default_llm, hf_smollm2, prompt_ids):
    """Where no sequence ends (ignore_eos here, no EOS there), vLLM's beam search and
    transformers' are the same search: the beam_width best sequences by cumulative log
    probability, each step's candidates the beams' 2 * beam_width most likely tokens. On the
    float path they find the same sequences, in the same order, with the same scores
    (transformers divides by the generated length; length_penalty 1)."""
    from tokenloom.sampling_params import BeamSearchParams

    width, steps = 3, 8
    prompts = prompt_ids[:3]
    ours = default_llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                                   BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True))
    for ids, out in zip(prompts, ours):
        inp = torch.tensor([ids])
        with torch.inference_mode():
            ref = hf_smollm2.generate(inp, attention_mask=torch.ones_like(inp), num_beams=width,
                                      num_return_sequences=width, max_new_tokens=steps, do_sample=False,
                                      early_stopping=False, length_penalty=1.0, eos_token_id=None, pad_token_id=2,
                                      output_scores=True, return_dict_in_generate=True)
        assert [s.tokens[len(ids):] for s in out.sequences] == [r[len(ids):].tolist() for r in ref.sequences]
        assert [s.cum_logprob for s in out.sequences] == pytest.approx((ref.sequences_scores * steps).tolist(), abs=2e-3)


def test_generate_returns_whole_outputs_whatever_the_output_kind(default_llm):
    # vLLM's LLM returns whole outputs; a DELTA request must not come back as its last piece.
    from tokenloom.sampling_params import RequestOutputKind

    base = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    final = default_llm.generate("Count: 1, 2,", SamplingParams(**base), use_tqdm=False)[0].outputs[0]
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        out = default_llm.generate("Count: 1, 2,", SamplingParams(**base, output_kind=kind), use_tqdm=False)[0]
        assert out.finished and out.outputs[0].token_ids == final.token_ids and out.outputs[0].text == final.text
    assert len(final.token_ids) == 12


def test_chat_takes_text_parts_a_prefill_tools_and_a_template(default_llm):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    joined = default_llm.chat([{"role": "user", "content": "Name a color.\nOne word."}], params, use_tqdm=False)[0]
    parts = default_llm.chat([{"role": "user", "content": [{"type": "text", "text": "Name a color."},
                                                           {"type": "text", "text": "One word."}]}],
                             params, use_tqdm=False)[0]
    assert parts.prompt_token_ids == joined.prompt_token_ids and parts.outputs[0].token_ids == joined.outputs[0].token_ids
    # continue_final_message: the model goes on from the assistant's own words.
    prefill = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1, 2, 3,"}]
    out = default_llm.chat(prefill, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.endswith("<|im_start|>assistant\n1, 2, 3,")
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        default_llm.chat(prefill, params, use_tqdm=False, continue_final_message=True)
    # tools and the template's own variables reach the template.
    template = ("{% for t in tools %}tool:{{ t.function.name }}\n{% endfor %}"
                "{% for m in messages %}{{ greeting }} {{ m.content }}\n{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = default_llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False, add_generation_prompt=False,
                           chat_template=template, chat_template_kwargs={"greeting": "Hello"}, tools=tools)[0]
    assert out.prompt == "tool:get_weather\nHello Hi\n"


def test_chat_tools_need_a_template_that_shows_them(default_llm, caplog):
    """SmolLM2's own template drops `tools`: LLM.chat warns once (not per call); a shipped
    tool-aware template, named as `--chat-template` names it, shows them; an unknown name is refused."""
    caplog.set_level("WARNING", logger="tokenloom.engine.processor")
    params = SamplingParams(temperature=0.0, max_tokens=1)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    for _ in range(2):
        out = default_llm.chat(ask, params, use_tqdm=False, tools=tools)[0]
        assert "get_weather" not in out.prompt
    dropped = [r for r in caplog.records if "drops the request's tools" in r.getMessage()]
    assert len(dropped) == 1 and "chat_template=" in dropped[0].getMessage()
    caplog.clear()
    out = default_llm.chat(ask, params, use_tqdm=False, tools=tools, chat_template="hermes")[0]
    assert "<tools>" in out.prompt and "get_weather" in out.prompt and out.prompt.endswith("<|im_start|>assistant\n")
    assert not [r for r in caplog.records if "drops the request's tools" in r.getMessage()]
    with pytest.raises(ValueError, match="chat_template 'hermess' is neither a file, a shipped chat template"):
        default_llm.chat(ask, params, use_tqdm=False, tools=tools, chat_template="hermess")


def test_vllm_idioms_default_params_lora_none_and_use_after_shutdown():
    """vLLM's offline idioms: `get_default_sampling_params()` changed and passed back, a
    `lora_request=None` passed through (an adapter without enable_lora refused by name), and a call after
    shutdown refused as a dead engine's rather than with a closed socket's ZMQError; shutdown leaves
    no engine-core process."""
    from tokenloom.engine.core_client import EngineDeadError

    llm = LLM(kv_cache_memory_bytes=64 * 1024**2, max_model_len=256)
    pid = llm.llm_engine.engine_core.info.pid
    try:
        params = llm.get_default_sampling_params()
        assert params == SamplingParams()
        params.max_tokens, params.temperature = 3, 0.0
        out = llm.generate("Hi", params, False, None)[0]  # vLLM's positional order: use_tqdm, lora_request
        assert len(out.outputs[0].token_ids) <= 3
        with pytest.raises(TypeError, match="lora_request must be a tokenloom.LoRARequest"):
            llm.generate("Hi", params, use_tqdm=False, lora_request=object())
        with pytest.raises(ValueError, match="enable_lora=True"):
            llm.generate("Hi", params, use_tqdm=False, lora_request=LoRARequest("a", 1, "/nowhere"))
    finally:
        llm.shutdown()
    with pytest.raises(EngineDeadError, match="the engine was shut down"):
        llm.generate("Hi", params, use_tqdm=False)
    # shutdown() leaves no engine-core process behind.
    deadline = time.monotonic() + 5
    while _alive(pid):
        assert time.monotonic() < deadline, f"engine core {pid} outlived shutdown()"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_vllm_only_keywords_are_taken_with_a_warning(caplog):
    """`LLM(model, dtype="float", gpu_memory_utilization=0.9, enforce_eager=True,
    trust_remote_code=True)`, as vLLM scripts write it, runs (a warning names each no-effect one;
    enforce_eager is a setting of its own, CUDA graphs off; "float" is vLLM's name of float32); a
    keyword neither engine knows stays an error. Without kv_cache_memory_bytes the KV cache is room
    for max_num_seqs sequences of max_model_len tokens (below the 768 MiB and 24,576-token caps),
    whatever the dtype; the engine reports what it chose for this CPU."""
    with pytest.raises(TypeError, match="'gpu_memory_utilisation'"):
        LLM(gpu_memory_utilisation=0.9)
    with caplog.at_level("WARNING", logger="tokenloom.entrypoints.llm"):
        llm = LLM(max_model_len=256, max_num_seqs=4, gpu_memory_utilization=0.9,
                  enforce_eager=True, trust_remote_code=True, dtype="float", quantization=None)
    try:
        info = llm.llm_engine.engine_core.info
        assert info.dtype == "float32"
        assert info.num_kv_blocks == 4 * 256 // 16
        assert info.cpu_kernels_isa in ("avx512", "avx2", "scalar", "off")
        assert "cores" in info.cpu and info.dtype in info.cpu
        assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    for name in ("gpu_memory_utilization", "trust_remote_code"):
        assert f"LLM({name}=...) is vLLM's and has no effect" in caplog.text
    assert "enforce_eager" not in caplog.text
