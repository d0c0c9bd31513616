"""tokenloom on a CUDA GPU, end to end: `LLM(device="cuda")` on tiny random-weight checkpoints
against transformers on the same GPU and weights, through the Triton attention backend it picks
there, chunked prefill, prefix-cache hits, preemption, an engine core in its own process and the
HTTP server. Skipped where torch sees no GPU (CI); `benchmarks/gpu_check.sh` runs it natively."""
from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import gguf
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from model_helpers import GEMMA3_WINDOW, byte_vocab, save_hf_dir, tiny_gemma3, tiny_gguf, tiny_hf_model  # noqa: E402

from tokenloom import LLM, SamplingParams  # noqa: E402

Q = gguf.GGMLQuantizationType
SEED = 11
MAX_TOKENS = 20
# 5 prompts of up to 300 tokens and their 20-token replies need 39 blocks of 16 together; 24
# hold any one of them but not all: running requests are preempted and recomputed. A 64-token
# budget splits the long prompts into chunks.
TIGHT = dict(num_kv_blocks=24, max_num_batched_tokens=64, enable_prefix_caching=False)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory):
    """(GGUF path in float32, the transformers model of the same weights on the GPU in float32).
    Qwen2 brings q/k/v biases and tied embeddings; Qwen3 q/k norms and head_dim != hidden/heads."""
    kind = request.param
    overrides = {"qwen3": dict(head_dim=32)}.get(kind, {})
    path = tiny_gguf(tmp_path_factory.mktemp(kind), kind, Q.F32, seed=SEED, **overrides)
    ref = tiny_hf_model(kind, vocab_size=len(byte_vocab()), seed=SEED, **overrides).to("cuda")
    return path, ref


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, len(byte_vocab()), (n,), generator=g).tolist() for n in (1, 9, 40, 130, 300)]


@torch.inference_mode()
def _hf_greedy(model, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy continuation (EOS not special, as ignore_eos) and each chosen token's
    logprob: a full forward per token, no cache, so nothing of its own cache or batching enters."""
    out = []
    for p in prompts:
        ids, lps = list(p), []
        for _ in range(n):
            logits = model(torch.tensor([ids], device="cuda")).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            ids.append(int(lp.argmax()))
            lps.append(float(lp[ids[-1]]))
        out.append((ids[len(p):], lps))
    return out


def _ours(llm: LLM, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rows = []
    for o in outs:
        c = o.outputs[0]
        rows.append((list(c.token_ids), [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]))
    return rows


def _assert_same(ours, ref, atol: float) -> None:
    for (tokens, lps), (ref_tokens, ref_lps) in zip(ours, ref):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < atol, (lps, ref_lps)


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.executor.driver_worker.model_runner


def test_float32_greedy_is_transformers_on_the_gpu(checkpoint):
    """Prefill chunks run eagerly, decode steps replay CUDA graphs (padded: 5 requests replay
    the graph of 8)."""
    path, ref = checkpoint
    prompts = _prompts()
    expected = _hf_greedy(ref, prompts, MAX_TOKENS)
    with LLM(path, device="cuda", dtype="float32", multiprocess=False, **TIGHT) as llm:
        info = llm.llm_engine.info
        assert info.attention_backend == "triton" and info.dtype == "float32", info
        assert info.num_kv_blocks == TIGHT["num_kv_blocks"]
        assert info.cuda_graphs == "decode batches of 1-64 requests (11 sizes)", info  # 64: the token budget
        _assert_same(_ours(llm, prompts, MAX_TOKENS), expected, atol=1e-3)
        state = llm.llm_engine.engine_core.call_utility("get_state")
        assert state["num_preemptions"] > 0, state
        assert state["num_free_blocks"] == state["num_total_blocks"]
        assert _runner(llm).graphs.num_replays >= MAX_TOKENS - 1


@pytest.mark.parametrize("max_model_len", [1024, 512])
def test_cuda_graphs_replay_what_eager_steps_compute(checkpoint, max_model_len):
    """Graphs captured for contexts up to max_model_len: at 1024 the small batches' graphs hold
    split-KV decode (two partitions: the 600-token prompt's replies use both), at 512 the
    unified kernel. Twelve requests replay the graph of 16 (four padding rows). The same tokens
    as enforce_eager's eager steps and as transformers'."""
    path, ref = checkpoint
    if ref.config.model_type != "llama":
        pytest.skip("one architecture is enough for the graph paths")
    g = torch.Generator().manual_seed(5)
    lens = (1, 3, 9, 17, 40, 64, 100, 130, 200, 300, 420, 600 if max_model_len == 1024 else 470)
    prompts = [torch.randint(0, len(byte_vocab()), (n,), generator=g).tolist() for n in lens]
    runs = {}
    for eager in (False, True):
        with LLM(path, device="cuda", dtype="float32", multiprocess=False, max_model_len=max_model_len,
                 kv_cache_memory_bytes=64 << 20, enforce_eager=eager) as llm:
            graphs = _runner(llm).graphs
            assert (graphs is None) == eager and (llm.llm_engine.info.cuda_graphs == "") == eager
            runs[eager] = _ours(llm, prompts, MAX_TOKENS)
            if not eager:
                assert graphs.num_replays >= MAX_TOKENS - 1 and 16 in graphs.graphs
    _assert_same(runs[False], runs[True], atol=1e-4)
    _assert_same(runs[False], _hf_greedy(ref, prompts, MAX_TOKENS), atol=1e-3)


def test_gemma3_sliding_windows_on_the_gpu(tmp_path):
    """Gemma 3: five layers in six see only the last 8 positions, one KV cache group (and one
    graph plan) per kind of layer; prompts shorter and far longer than the window. Greedy tokens
    as transformers' on the GPU, with graphs and with every step eager."""
    from tokenloom.model.loader import load_tokenizer

    tokenizer = load_tokenizer(tiny_gguf(tmp_path, "llama", Q.F32))  # a byte-level vocabulary
    ref = tiny_gemma3(len(tokenizer), seed=5)
    directory = save_hf_dir(ref, tokenizer, str(tmp_path / "gemma3"))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, len(tokenizer), (n,), generator=g).tolist() for n in (1, 5, 9, 40, 150)]
    assert max(len(p) for p in prompts) > 4 * GEMMA3_WINDOW
    expected = _hf_greedy(ref.to("cuda"), prompts, MAX_TOKENS)
    for eager in (False, True):
        with LLM(directory, device="cuda", dtype="float32", multiprocess=False, kv_cache_memory_bytes=64 << 20,
                 max_num_batched_tokens=64, enforce_eager=eager) as llm:
            assert (llm.llm_engine.info.cuda_graphs == "") == eager
            _assert_same(_ours(llm, prompts, MAX_TOKENS), expected, atol=1e-3)


def test_prefix_cache_hits_change_nothing_on_the_gpu(checkpoint):
    """The second pass reads the first's blocks from the prefix cache (prompts sharing a
    prefix): the same tokens, and logprobs within float32 rounding of the cold pass's."""
    path, _ = checkpoint
    base = _prompts()[4]
    prompts = [base[:200] + tail for tail in ([5, 6, 7], [8] * 40, base[200:])]
    with LLM(path, device="cuda", dtype="float32", multiprocess=False, kv_cache_memory_bytes=64 << 20,
             max_num_batched_tokens=128) as llm:
        cold = _ours(llm, prompts, MAX_TOKENS)
        before = llm.llm_engine.engine_core.call_utility("get_state")
        warm = _ours(llm, prompts, MAX_TOKENS)
        after = llm.llm_engine.engine_core.call_utility("get_state")
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= 3 * 192
    _assert_same(warm, cold, atol=1e-4)


def test_bfloat16_follows_transformers_in_bfloat16(checkpoint):
    """bfloat16 weights, activations and KV cache (dtype auto on CUDA): the first token of each
    prompt as transformers' in bfloat16, and its logprob within bf16 rounding. Later tokens may
    part at a near tie, so they are not compared."""
    path, ref = checkpoint
    prompts = _prompts()
    expected = _hf_greedy(copy.deepcopy(ref).to(torch.bfloat16), prompts, 1)
    with LLM(path, device="cuda", multiprocess=False, kv_cache_memory_bytes=64 << 20) as llm:
        assert llm.llm_engine.info.dtype == "bfloat16" and llm.llm_engine.info.kv_cache_dtype == "bfloat16"
        ours = _ours(llm, prompts, 1)
    agree = sum(t == r for (t, _), (r, _) in zip(ours, expected))
    assert agree >= 4, (ours, expected)
    for (t, lp), (r, ref_lp) in zip(ours, expected):
        if t == r:
            assert abs(lp[0] - ref_lp[0]) < 0.15, (lp, ref_lp)


def test_engine_core_process_and_seeded_sampling_on_the_gpu(checkpoint):
    """The engine core in its own process (CUDA initialized there, not here): greedy output as
    in-process, and seeded sampling (top-k, top-p, min-p, penalties on the GPU sampler) the same
    twice and not the same as greedy."""
    path, ref = checkpoint
    if ref.config.model_type != "llama":
        pytest.skip("one architecture is enough for the process and sampler paths")
    prompts = _prompts()[:3]
    sampled = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                             presence_penalty=0.2, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(path, device="cuda", dtype="float32", kv_cache_memory_bytes=64 << 20) as llm:
        assert llm.llm_engine.info.pid != os.getpid()
        greedy = _ours(llm, prompts, MAX_TOKENS)
        runs = [[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sampled,
                                                               use_tqdm=False)] for _ in range(2)]
    _assert_same(greedy, _hf_greedy(ref, prompts, MAX_TOKENS), atol=1e-3)
    assert runs[0] == runs[1]
    assert [list(t) for t in runs[0]] != [g for g, _ in greedy]


def test_openai_server_on_the_gpu(checkpoint, tmp_path):
    """`tokenloom serve --device cuda`: the official client's completion is the greedy reply."""
    path, ref = checkpoint
    if ref.config.model_type != "llama":
        pytest.skip("one architecture is enough for the server")
    from conftest import ServerProcess

    prompt = _prompts()[2]
    srv = ServerProcess(["--model", path, "--device", "cuda", "--dtype", "float32",
                         "--kv-cache-memory-bytes", str(64 << 20)], api_key=None)
    try:
        out = srv.client().completions.create(model=srv.client().models.list().data[0].id, prompt=prompt,
                                              max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
                                              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    finally:
        srv.stop()
    tokens = [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]
    assert tokens == _hf_greedy(ref, [prompt], MAX_TOKENS)[0][0]
