"""Hybrid KV cache management end to end: a tiny random Gemma 3 (sliding-window layers, window 16)
in the real engine core, blocks of 4 tokens. The sliding groups' block counts stay bounded by the
window while the full-attention group grows; the greedy tokens equal transformers' and do not
change with preemption or the prefix cache; every block comes back."""
from __future__ import annotations

import pytest
import torch

from tokenloom.config import EngineConfig
from tokenloom.messages import EngineCoreRequest, now
from tokenloom.sampling_params import SamplingParams

WINDOW, BS = 16, 4
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2  # 2 full + 4 sliding


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory, smollm2_path):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from tokenloom.model.loader import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
        sliding_window=WINDOW, layer_types=LAYER_TYPES, query_pre_attn_scalar=16,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})
    torch.manual_seed(3)
    model = Gemma3ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # larger than the default init: distinct logits, no near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    directory = str(tmp_path_factory.mktemp("gemma3"))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, directory


def _core(path: str, **kw):
    from tokenloom.core.engine_core import EngineCore

    cfg = dict(model=path, dtype="float32", block_size=BS, max_model_len=1024, max_num_batched_tokens=64,
               enable_ledger=False, quantization=None)
    cfg.update(kw)
    return EngineCore(EngineConfig(**cfg))


def _generate(core, prompts: dict[str, list[int]], max_tokens: int, on_step=None) -> dict[str, list[int]]:
    for req_id, prompt in prompts.items():
        core.add_request(EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt, eos_token_id=None,
                                           sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                          ignore_eos=True),
                                           arrival_time=now()))
    out: dict[str, list[int]] = {r: [] for r in prompts}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            out[o.request_id] += o.new_token_ids
        if on_step is not None:
            on_step(core)
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked"
    return out


def test_tiny_gemma3_long_generation_holds_a_window_per_sliding_group(tiny_gemma3):
    hf, path = tiny_gemma3
    core = _core(path, num_kv_blocks=512)
    kv = core.scheduler.kv_cache_manager
    assert [g.sliding_window for g in kv.kv_cache_groups] == [None, WINDOW, WINDOW]
    # Groups of two layers share two KV tensors: full (2, 5), sliding (0, 1) and (3, 4).
    caches = core.executor.driver_worker.model_runner.kv_caches
    assert caches[2] is caches[0] is caches[3] and caches[5] is caches[1] is caches[4]
    assert caches[0] is not caches[1]
    # The caller learns how long one request can be (every group takes blocks).
    assert 0 < core.info.kv_cache_capacity_tokens == core.scheduler.max_request_len < 512 * BS
    bound = WINDOW // BS + 2
    seen: list[list[int]] = []

    def check(core):
        for req_id in core.scheduler.requests:
            held = kv.num_held_blocks(req_id)
            n = core.scheduler.requests[req_id].num_computed_tokens
            assert held[0] == -(-n // BS) and max(held[1:]) <= bound, (n, held)
            seen.append(held)

    prompt = list(range(100, 140))
    got = _generate(core, {"a": prompt}, max_tokens=200, on_step=check)["a"]
    assert len(seen) >= 199 and seen[-1][0] > 55 and max(h[1] for h in seen) == bound
    # transformers, same weights, same window: the same greedy tokens.
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=200, do_sample=False)[0, len(prompt):].tolist()
    assert got == ref


def test_tiny_gemma3_preemption_and_prefix_cache_keep_outputs(tiny_gemma3):
    _, path = tiny_gemma3
    shared = list(range(300, 348))  # 48 shared tokens: three windows
    prompts = {f"r{i}": shared + [500 + i] * (3 + i) for i in range(4)}
    roomy = _generate(_core(path, num_kv_blocks=512, enable_prefix_caching=False), prompts, max_tokens=40)

    cached_core = _core(path, num_kv_blocks=512)
    cached = _generate(cached_core, prompts, max_tokens=40)
    assert cached == roomy
    assert cached_core.scheduler.kv_cache_manager.prefix_cache_hits >= 3 * 48

    tight_core = _core(path, num_kv_blocks=60, max_num_batched_tokens=32)
    tight = _generate(tight_core, prompts, max_tokens=40)
    assert tight_core.scheduler.num_preemptions > 0
    assert tight == roomy
