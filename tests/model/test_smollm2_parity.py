"""Our SmolLM2-135M (from the embedded Q4_1 GGUF) against transformers' LlamaForCausalLM
dequantized from the same file, float32, through the real paged KV cache and torch attention
backend."""
from __future__ import annotations

import contextlib

import pytest
import torch
from model_helpers import hf_last_logits, run_flat_batch

# Measured on this CPU: max |ours - transformers| over the 7 prompts is ~6e-5 (logits of
# magnitude ~20); 1e-3 leaves room for other BLAS builds without hiding a real bug (a wrong rope
# pairing or a missed norm moves logits by whole units).
PARITY_ATOL = 1e-3
# Chunked runs reorder the same float32 sums: measured ~5e-5; scattered blocks alone: exactly 0.
CHUNK_ATOL = 2e-4

_PARAGRAPH = ("The history of computing is a story of abstraction layered on abstraction: "
              "from relays to vacuum tubes, from transistors to integrated circuits, each step hid "
              "the one below it and let programmers think in larger units. ")


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    tok = smollm2.tokenizer
    one = tok("Hello").input_ids
    assert len(one) == 1
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    texts = [
        chat,
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
        "Sixteen tokens or so, to sit right at a block boundary here.",
        _PARAGRAPH * 3,
        _PARAGRAPH * 8 + "Summarize the above in one line:",
        _PARAGRAPH * 17 + "In short,",
    ]
    out = [one] + [tok(t).input_ids for t in texts]
    lengths = [len(p) for p in out]
    assert lengths[0] == 1 and max(lengths) > 600 and len(set(lengths)) == len(lengths), lengths
    return out


@pytest.fixture(scope="module")
def hf_logits(hf_smollm2, prompts) -> torch.Tensor:
    return hf_last_logits(hf_smollm2, prompts)


@pytest.fixture(scope="module")
def one_shot_logits(smollm2, prompts) -> torch.Tensor:
    return run_flat_batch(smollm2, prompts)


def test_config_and_tokenizer(smollm2):
    cfg = smollm2.config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim) == ("llama", 30, 576, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0
    assert cfg.eos_token_ids == [2] and cfg.bos_token_id == 1
    assert smollm2.dtype == torch.float32 and smollm2.tokenizer.eos_token_id == 2
    # The parity tests compare transformers with the dequantized float path, not the Q4_1 kernels.
    assert smollm2.quantization == "none"


def test_flat_batch_matches_transformers(prompts, hf_logits, one_shot_logits):
    """Seven prompts of 1 to 600+ tokens in ONE flat batch."""
    diff = (one_shot_logits - hf_logits).abs().max().item()
    print(f"max abs logits diff vs transformers: {diff:.3g} over lengths {[len(p) for p in prompts]}")
    assert diff <= PARITY_ATOL
    assert torch.equal(one_shot_logits.argmax(-1), hf_logits.argmax(-1))


def test_chunked_prefill_and_scattered_blocks(smollm2, prompts, one_shot_logits):
    """The same requests prefilled in one step with blocks handed out in shuffled order, in chunks
    (context read back from the paged cache), and both at once with a different block size, give
    the logits of the one-shot contiguous prefill."""
    picked = [0, 1, 2, 3, 4]  # 1 token, the chat prompt, code, ~15 and ~120 tokens
    sub = [prompts[i] for i in picked]
    expected = one_shot_logits[picked]
    # At most 5 steps each; a chunk that leaves one token (37 = 3 * 12 + 1, 15 = 14 + 1) makes
    # the last step a decode over cached context.
    for kwargs in ({"scatter": True},
                   {"chunk_sizes": [5, 12, 7, 4, 50]},
                   {"chunk_sizes": [1, 9, 6, 14, 33], "scatter": True, "block_size": 4, "seed": 3}):
        got = run_flat_batch(smollm2, sub, **kwargs)
        diff = (got - expected).abs().max().item()
        print(f"max abs logits diff vs one-shot prefill, {kwargs}: {diff:.3g}")
        assert diff <= CHUNK_ATOL, (kwargs, diff)
        assert torch.equal(got.argmax(-1), expected.argmax(-1)), kwargs


@pytest.mark.parametrize("cpu_kernels_on", [False, True])
def test_cpu_fast_path_matches_transformers(smollm2, prompts, hf_logits, cpu_kernels_on,
                                           monkeypatch):
    """The CPU model runner's fast path: oneDNN-packed float32 weights (packed_linear), alone and
    with the C norms, RoPE and SiLU-and-mul (ops/cpu_kernels), gives transformers' logits, with
    chunks (decodes over cached context, small matmuls on the packed weights) and in one step of
    1000+ tokens (plain F.linear, the kernels' threaded rows)."""
    from tokenloom.model.packed_linear import pack_linear_weights
    from tokenloom.ops import cpu_kernels
    from tokenloom.ops.elementwise import torch_ops_only

    calls = {"add_rms_norm": 0, "rope_": 0, "silu_and_mul": 0}
    for name in calls:  # count the C kernels' calls (they still run)
        real = getattr(cpu_kernels, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(cpu_kernels, name, counted)
    model = smollm2.model
    assert pack_linear_weights(model) == 4 * smollm2.config.num_hidden_layers
    try:
        assert model.packed_lm_head is not None
        if cpu_kernels_on and cpu_kernels.load() is None:
            pytest.skip("no C compiler here")
        with contextlib.nullcontext() if cpu_kernels_on else torch_ops_only():
            chunked = run_flat_batch(smollm2, prompts[:5], chunk_sizes=[1, 9, 6, 14, 33])
            one_shot = run_flat_batch(smollm2, prompts)
    finally:  # the model is shared by the session: leave it as it was
        model.packed_lm_head = None
        for m in model.modules():
            if hasattr(m, "packed_weight"):
                m.packed_weight = None
    layers = smollm2.config.num_hidden_layers
    if cpu_kernels_on:  # every norm, RoPE and MLP of every step went through C
        assert calls["add_rms_norm"] >= 6 * (2 * layers + 1) and calls["rope_"] >= 6 * layers
        assert calls["silu_and_mul"] >= 6 * layers
    else:
        assert not any(calls.values())
    for name, got, ref in (("chunked", chunked, hf_logits[:5]), ("one step", one_shot, hf_logits)):
        diff = (got - ref).abs().max().item()
        print(f"fast path (C kernels {cpu_kernels_on}), {name}: max abs logits diff vs "
              f"transformers {diff:.3g}")
        assert diff <= PARITY_ATOL
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
