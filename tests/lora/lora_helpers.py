"""The LoRA tests' model and adapters: a tiny random Llama and two PEFT LoRA adapters saved as
PEFT saves them, and transformers + peft's greedy tokens as the reference."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from model_helpers import save_hf_dir, tiny_hf_model  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_model_and_adapters(directory, smollm2_path: str) -> tuple[str, dict[str, str], object]:
    """(the base model's directory, {name: adapter directory}, the tokenizer), under `directory`."""
    from peft import LoraConfig, get_peft_model

    from tokenloom.model.loader import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path)
    base_dir = save_hf_dir(tiny_hf_model("llama", vocab_size=len(tokenizer), seed=3), tokenizer,
                           str(Path(directory) / "base"))
    adapters = {}
    # Every projection at rank 8; q and v only at rank 4 with rsLoRA's scaling.
    for name, cfg, seed in (("all", dict(r=8, lora_alpha=16, target_modules=ALL), 1),
                            ("qv", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True), 2)):
        torch.manual_seed(seed)
        model = tiny_hf_model("llama", vocab_size=len(tokenizer), seed=3)
        peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **cfg))
        with torch.no_grad():  # PEFT's random B is small: make the adapter matter
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5)
        path = str(Path(directory) / name)
        peft_model.save_pretrained(path)
        adapters[name] = path
    return base_dir, adapters, tokenizer


def reference(base_dir: str, adapter: str | None, tokenizer, prompts=PROMPTS, max_tokens: int = 12) -> list[list[int]]:
    """transformers (+ peft) greedy tokens."""
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    out = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                               do_sample=False, min_new_tokens=max_tokens)
        out.append(y[0, len(ids):].tolist())
    return out
