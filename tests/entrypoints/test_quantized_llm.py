"""The embedded SmolLM2 Q4_1 GGUF on its default path (quantized weights as shipped) against the
dequantized float path, through `LLM.generate`: greedy chat answers agree (the issue's bar: at
least 14 of 16), and each engine says which path it runs and which KV cache dtype (bfloat16 on
the quantized path, as llama.cpp's 16-bit default; the float path's own dtype)."""
from __future__ import annotations

import pytest
from test_llm import QUESTIONS

from tokenloom import LLM, SamplingParams
from tokenloom.ops import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the CPU kernels")

MORE = ["What is the boiling point of water at sea level?", "Name a famous painting by Leonardo da Vinci.",
        "How many legs does a spider have?", "Write a short sentence about the moon."]


def _answers(tokenizer, **kwargs) -> tuple[tuple[str, str], list[list[int]]]:
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                              tokenize=False), add_special_tokens=False)
               for q in QUESTIONS + MORE]
    with LLM(num_kv_blocks=128, **kwargs) as llm:
        info = llm.llm_engine.info  # the public name the README gives
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    return (info.quantization, info.kv_cache_dtype), [o.outputs[0].token_ids for o in outs]


def test_quantized_greedy_answers_follow_the_float_path(hf_smollm2_tokenizer):
    tokenizer = hf_smollm2_tokenizer
    (path, kv_dtype), quantized = _answers(tokenizer)
    assert path.startswith("gguf Q4_1x210+Q8_0x1") and kv_dtype == "bfloat16"
    none, reference = _answers(tokenizer, dtype="float32", quantization=None)
    assert none == ("none", "float32") and len(reference) == 16
    same = sum(a == b for a, b in zip(quantized, reference))
    assert same >= 14, f"{same}/16 greedy answers identical"
