"""The families that run on Llama's decoder with a difference (and OLMo 2's layer), and the RoPE
scalings and biases they bring: each a tiny random transformers model saved as an HF directory,
run through `LLM(dir, dtype="float32")`; greedy tokens must be transformers' own (float32), 3
prompts x 32 tokens. One module-scoped fixture per family: a few seconds each."""
from __future__ import annotations

import pytest
import torch
from model_helpers import randomize_, save_hf_dir

from tokenloom import LLM, SamplingParams
from tokenloom.model.hf_config import hf_model_config

N_TOKENS = 32
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)

# case -> (transformers class prefix, config overrides, what our config must say)
CASES = {
    "mistral_sliding": ("Mistral", dict(head_dim=16, sliding_window=8),
                        dict(sliding_window=8, layer_types=("sliding_attention",) * 2)),
    "qwen2_sliding": ("Qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
                      dict(sliding_window=8, layer_types=("full_attention", "sliding_attention"), attention_bias=True)),
    "granite": ("Granite", dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
                                logits_scaling=4.0, attention_bias=True, mlp_bias=True),
                dict(embedding_multiplier=3.0, logits_scaling=4.0, o_proj_bias=True, mlp_bias=True)),
    "olmo2": ("Olmo2", dict(), dict(architecture="olmo2")),
    "smollm3": ("SmolLM3", dict(num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0]), dict(nope_layers=(1, 3))),
    "stablelm": ("StableLm", dict(partial_rotary_factor=0.25, use_qkv_bias=True, layer_norm_eps=1e-5),
                 dict(layer_norm=True, rotary_dim=4, attention_bias=True, o_proj_bias=False)),
    "llama_yarn": ("Llama", dict(max_position_embeddings=128, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}),
        dict(max_position_embeddings=128)),
    # Decoding runs past the original 48 positions, where dynamic NTK grows the base each token.
    "llama_dynamic": ("Llama", dict(max_position_embeddings=48, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), dict(max_position_embeddings=96)),
    "llama_biases": ("Llama", dict(attention_bias=True, mlp_bias=True),
                     dict(attention_bias=True, o_proj_bias=True, mlp_bias=True)),
}


def _byte_tokenizer():
    """A byte-level tokenizer of 259 tokens (3 specials, then the 256 bytes): the engine needs
    one in the directory; the prompts are token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {c: i + 3 for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizer():
    return _byte_tokenizer()


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, tokenizer, tmp_path_factory):
    """(case, directory, prompts, transformers' greedy tokens)."""
    import transformers

    prefix, overrides, _ = CASES[request.param]
    kwargs = COMMON | dict(vocab_size=len(tokenizer)) | overrides
    torch.manual_seed(0)
    ref = getattr(transformers, f"{prefix}ForCausalLM")(getattr(transformers, f"{prefix}Config")(**kwargs))
    ref = ref.to(torch.float32).eval()
    randomize_(ref, seed=sum(map(ord, request.param)))
    directory = save_hf_dir(ref, tokenizer, str(tmp_path_factory.mktemp(request.param)))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, len(tokenizer), (n,), generator=g).tolist() for n in (5, 17, 40)]
    expected = []
    with torch.inference_mode():
        for p in prompts:
            out = ref.generate(torch.tensor([p]), max_new_tokens=N_TOKENS, min_new_tokens=N_TOKENS,
                               do_sample=False, pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    return request.param, directory, prompts, expected


def test_config_translation(family):
    case, directory, _, _ = family
    cfg = hf_model_config(directory)
    for field, value in CASES[case][2].items():
        assert getattr(cfg, field) == value, field


def test_greedy_tokens_match_transformers(family):
    case, directory, prompts, expected = family
    params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
    with LLM(directory, dtype="float32", multiprocess=False, num_kv_blocks=64, block_size=4,
             max_num_batched_tokens=32) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == expected, case
