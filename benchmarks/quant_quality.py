"""Quality of the quantized paths against the float path on the embedded SmolLM2-135M Q4_1 GGUF.

- Perplexity of a fixed text (this repository's README.md, first `--tokens` tokens), one prefill
  per path through the real paged KV cache and torch attention backend.
- Greedy answers (24 tokens, chat template) to 16 chat prompts: the 12 of
  tests/entrypoints/test_llm.py and 4 more, through `LLM.generate`.

Paths: "none" (dequantized float32, the transformers-parity path), "gguf" (Q4_1 / Q8_0 blocks as
shipped), "int8" (the float weights re-quantized to int8 with a scale per 32 weights).

    PYTHONPATH=src python benchmarks/quant_quality.py
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

# The chat-prompt set the tests use (tests/entrypoints: 12 in test_llm.py, 4 more in
# test_quantized_llm.py), read from there so the figures and the tests judge the same prompts.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "entrypoints"))
from test_llm import QUESTIONS as _TEST_QUESTIONS  # noqa: E402
from test_quantized_llm import MORE as _MORE  # noqa: E402

QUESTIONS = _TEST_QUESTIONS + _MORE


@torch.inference_mode()
def perplexity(loaded, ids: list[int]) -> float:
    from tokenloom.attention.metadata import AttentionMetadata
    from tokenloom.attention.torch_backend import TorchAttentionBackend

    model, cfg = loaded.model, loaded.config
    bs, T = 16, len(ids)
    nblocks = -(-T // bs)
    caches = [torch.zeros(2, nblocks, bs, cfg.num_key_value_heads, cfg.head_dim) for _ in range(cfg.num_hidden_layers)]
    backend = TorchAttentionBackend()
    qsl = torch.tensor([0, T], dtype=torch.int32)
    seq = torch.tensor([T], dtype=torch.int32)
    meta = AttentionMetadata(num_actual_tokens=T, num_reqs=1, max_query_len=T, max_seq_len=T,
                             query_start_loc=qsl, seq_lens=seq, block_table=torch.arange(nblocks, dtype=torch.int32)[None],
                             slot_mapping=torch.arange(T, dtype=torch.int64), block_size=bs,
                             query_start_loc_cpu=qsl, seq_lens_cpu=seq)
    hidden = model(torch.tensor(ids), torch.arange(T), caches, backend, [backend.prepare(meta)])
    logp = torch.log_softmax(model.compute_logits(hidden[:-1]).double(), -1)
    nll = -logp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    return math.exp(nll)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    from tokenloom import LLM, SamplingParams
    from tokenloom.model.loader import load_model, load_tokenizer

    tok = load_tokenizer(None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md")) as f:
        text_ids = tok(f.read()).input_ids[: args.tokens]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False) for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    result: dict = {"text_tokens": len(text_ids), "prompts": len(prompts)}
    answers = {}
    for method in ("none", "gguf", "int8"):
        # float32 pinned: "auto" is bfloat16 on CPUs that multiply it natively (AMX, AVX-512 BF16),
        # and the reference is the float32 path (as in tests/entrypoints/test_quantized_llm.py).
        loaded = load_model(None, dtype="float32", quantization=method)
        result[method] = {"quantization": loaded.quantization, "perplexity": perplexity(loaded, text_ids)}
        del loaded
        with LLM(quantization=method, dtype="float32", num_kv_blocks=256) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        answers[method] = [o.outputs[0].token_ids for o in outs]
    for method in ("gguf", "int8"):
        r = result[method]
        r["perplexity_vs_float_pct"] = 100 * (r["perplexity"] / result["none"]["perplexity"] - 1)
        r["greedy_identical"] = sum(a == b for a, b in zip(answers[method], answers["none"]))
        r["greedy_differs_at"] = [i for i, (a, b) in enumerate(zip(answers[method], answers["none"])) if a != b]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
