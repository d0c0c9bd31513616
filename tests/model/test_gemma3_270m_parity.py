"""Gemma 3 270M (the base model's Q4_K_M GGUF: Q5_0, Q4_K, Q6_K, Q8_0 and F32 tensors) against
transformers' Gemma3ForCausalLM dequantized from the same file, both float32: logits on a short
prompt and on one of 1,500 tokens that crosses the 512-token window (prefilled in chunks through
the paged cache), and greedy continuations of 16 plain-text prompts through the engine, then of
the long prompt, chunked and again from the prefix cache. Few and costly (transformers parses the
262k-token vocabulary of the file for a minute or more): the transformers model is a session
fixture, its logits a module fixture. The one-shot and many-chunk variants run on the tiny
random Gemma 3 (test_gemma3.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_helpers import hf_last_logits, run_flat_batch

pytestmark = pytest.mark.slow

# Measured on this CPU: max |ours - transformers| ~2e-5 (logits of magnitude ~25).
PARITY_ATOL = 1e-3
GREEDY_TOKENS = 10
PROMPTS_16 = [
    "The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
    "The three primary colors are", "Water boils at a temperature of", "In 1969, astronauts",
    "The quick brown fox", "To make a cup of tea, first", "The largest planet in our solar system",
    "Photosynthesis is the process by which", "import numpy as np\n", "Dear Sir or Madam,",
    "The theory of relativity was developed by", "My favourite recipe for pancakes",
    "A prime number is", "The history of the Roman Empire",
]


@pytest.fixture(scope="module")
def prompts(gemma3) -> list[list[int]]:
    tok = gemma3.tokenizer
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    short = tok("The quick brown fox jumps over the lazy dog.").input_ids
    long = tok(readme).input_ids[:1500]
    assert len(short) <= 12 and len(long) == 1500 and long[0] == tok.bos_token_id
    return [short, long]


@pytest.fixture(scope="module")
def hf_logits(hf_gemma3, prompts) -> torch.Tensor:
    return hf_last_logits(hf_gemma3, prompts)


def test_config(gemma3):
    cfg = gemma3.config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.vocab_size, cfg.sliding_window) == ("gemma3", 18, 4, 1, 256, 262144, 512)
    assert cfg.layer_types.count("full_attention") == 3 and cfg.layer_types[5] == "full_attention"
    assert gemma3.model.kv_cache_group_of_layer.count(0) == 3


def test_logits_match_transformers_across_the_window(gemma3, prompts, hf_logits):
    # Chunks of 400 over scattered blocks: later chunks read their window back from the cache.
    got = run_flat_batch(gemma3, prompts, chunk_sizes=400, scatter=True)
    err = (got - hf_logits).abs().amax(-1)
    print(f"gemma3 270M: max abs logits diff per prompt {err.tolist()}")
    assert err.max().item() <= PARITY_ATOL
    assert torch.equal(got.argmax(-1), hf_logits.argmax(-1))


def test_greedy_continuations_match_transformers(gemma3_path, hf_gemma3, prompts):
    """16 plain-text prompts, then the 1,500-token prompt twice: prefilled in chunks of 512
    (across the window), the second time mostly from the prefix cache."""
    from tokenloom import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    long = {"prompt_token_ids": prompts[1]}
    with LLM(gemma3_path, dtype="float32", quantization=None, multiprocess=False,
             num_kv_blocks=512, max_num_batched_tokens=512) as llm:
        tokenizer = llm.get_tokenizer()
        tok_ids = [tokenizer(p).input_ids for p in PROMPTS_16]
        outs = llm.generate(PROMPTS_16, params)
        long_cold = llm.generate([long], params)[0]
        long_hit = llm.generate([long], params)[0]
    ours = [o.outputs[0].token_ids for o in outs]
    assert [o.prompt_token_ids for o in outs] == tok_ids
    with torch.inference_mode():
        ref = [hf_gemma3.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                  min_new_tokens=GREEDY_TOKENS)[0, len(ids):].tolist()
               for ids in tok_ids + [prompts[1]]]
    same = sum(a == b for a, b in zip(ours, ref))
    print(f"gemma3 270M greedy: {same}/16 continuations identical")
    assert same >= 15, [(p, tokenizer.decode(a), tokenizer.decode(b))
                        for p, a, b in zip(PROMPTS_16, ours, ref) if a != b]
    assert long_hit.num_cached_tokens >= 1488  # whole blocks of 16 short of the last token
    assert long_cold.outputs[0].token_ids == long_hit.outputs[0].token_ids == ref[-1]
