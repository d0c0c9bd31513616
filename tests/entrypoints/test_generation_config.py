"""A model's generation_config.json as the default sampling parameters (vLLM's
`--generation-config auto|vllm|DIR` and `--override-generation-config`), offline and served.

The tiny random model's generation config asks for greedy decoding and 6 new tokens, which is
visible from outside: a request that sets neither gets 6 tokens, the same ones an explicitly
greedy request gets, where tokenloom's own defaults would sample 16 (offline) or run to the
context's end (chat).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import ServerProcess  # tests/entrypoints/conftest.py
from tokenloom.entrypoints.cli import main
from tokenloom.model.generation_config import default_sampling_params, max_tokens_cap
from tokenloom.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))  # tiny_hf_model, save_hf_dir

GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False, "temperature": 0.0,
                     "max_new_tokens": 6, "transformers_version": "5.0.0"}


def _write(directory: Path, name: str, value: dict) -> None:
    (directory / name).write_text(json.dumps(value))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_path) -> str:
    """A 2-layer random Llama with SmolLM2's tokenizer and the generation config above."""
    from model_helpers import save_hf_dir, tiny_hf_model

    from tokenloom.model.loader import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path)
    directory = tmp_path_factory.mktemp("tiny-llama-genconfig")
    save_hf_dir(tiny_hf_model("llama", vocab_size=len(tokenizer), seed=3), tokenizer, str(directory))
    _write(directory, "generation_config.json", GENERATION_CONFIG)
    return str(directory)


def test_defaults_come_from_the_model_folder_or_another_and_merge_an_override(tmp_path, smollm2_path):
    model = tmp_path / "model"
    model.mkdir()
    _write(model, "config.json", {"model_type": "llama"})
    _write(model, "generation_config.json", {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 64,
                                             "min_p": None, "max_new_tokens": 32, "eos_token_id": [1, 106]})
    assert default_sampling_params(str(model)) == {"temperature": 0.6, "top_k": 64, "top_p": 0.95, "max_tokens": 32}
    assert default_sampling_params(str(model), "vllm") == {}
    assert default_sampling_params(str(model), "vllm", {"temperature": 0.2}) == {"temperature": 0.2}
    assert default_sampling_params(str(model), "auto", {"top_p": 0.5, "repetition_penalty": 1.1}) == {
        "repetition_penalty": 1.1, "temperature": 0.6, "top_k": 64, "top_p": 0.5, "max_tokens": 32}
    other = tmp_path / "other"
    other.mkdir()
    _write(other, "generation_config.json", {"temperature": 0.3, "max_new_tokens": 8})
    assert default_sampling_params(str(model), str(other)) == {"temperature": 0.3, "max_tokens": 8}
    # Without a generation_config.json, transformers (and vLLM) take the config.json's fields.
    _write(other, "config.json", {"model_type": "llama", "temperature": 0.9})
    os.unlink(other / "generation_config.json")
    assert default_sampling_params(str(other), "auto") == {"temperature": 0.9}
    # A GGUF carries no generation config.
    assert default_sampling_params(smollm2_path) == default_sampling_params(None) == {}
    # Only a folder named by --generation-config (or an override) caps max_tokens; the model's own
    # max_new_tokens is a default, as vLLM's server has it.
    assert max_tokens_cap("auto", {"max_tokens": 32}) is None
    assert max_tokens_cap(str(other), {"max_tokens": 8}) == 8
    assert max_tokens_cap("auto", {"max_tokens": 4}, {"max_new_tokens": 4}) == 4


def test_unusable_defaults_are_refused_naming_the_field(tmp_path):
    _write(tmp_path, "config.json", {"model_type": "llama"})
    _write(tmp_path, "generation_config.json", {"temperature": "warm"})
    with pytest.raises(ValueError, match=r"generation_config \(auto\).*temperature"):
        default_sampling_params(str(tmp_path))
    with pytest.raises(ValueError, match="override_generation_config.*top_p"):
        default_sampling_params(str(tmp_path), "vllm", {"top_p": 3})
    with pytest.raises(Exception, match="neither 'auto', 'vllm' nor a folder"):
        default_sampling_params(str(tmp_path), str(tmp_path / "missing"))


def test_serve_refuses_a_bad_override_in_one_line(capsys, model_dir):
    """Said before the engine starts (no engine core), as one line naming the field."""
    rc = main(["serve", model_dir, "--port", "0", "--override-generation-config", '{"top_k": -5}'])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and "override_generation_config" in err[-1] and "top_k" in err[-1], err
    with pytest.raises(SystemExit):
        main(["serve", model_dir, "--override-generation-config", "temperature=0.5"])
    assert "expected a JSON object" in capsys.readouterr().err


def test_generate_without_sampling_params_follows_the_generation_config(model_dir, caplog):
    from tokenloom import LLM

    prompt = "The capital of France is"
    with caplog.at_level("WARNING", logger="tokenloom.entrypoints.llm"):
        llm = LLM(model_dir, kv_cache_memory_bytes=16 * 1024**2, max_model_len=128, enable_ledger=False)
    # Said, as vLLM warns: outputs that differ from SamplingParams' defaults have their reason.
    assert "Default sampling parameters {'temperature': 0.0, 'max_tokens': 6} from the model's" in caplog.text
    with llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens) == (0.0, 6)
        [out] = llm.generate(prompt, use_tqdm=False)
        [greedy] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
        [own] = llm.generate(prompt, SamplingParams(seed=1), use_tqdm=False)  # given: no model defaults
    assert len(out.outputs[0].token_ids) == 6 or out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids == greedy.outputs[0].token_ids
    assert len(own.outputs[0].token_ids) == 16 or own.outputs[0].finish_reason == "stop"


def test_served_defaults_and_cap_from_a_generation_config_folder(model_dir):
    """`--generation-config DIR`: the folder's fields are every request's defaults and its
    max_new_tokens (here the override's, which wins over the folder's) caps every request, as
    vLLM's server does."""
    srv = ServerProcess([model_dir, "--generation-config", model_dir, "--max-model-len", "128",
                         "--kv-cache-memory-bytes", str(16 * 1024**2), "--override-generation-config",
                         '{"max_new_tokens": 5}'], None)
    try:
        client = srv.client()
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Name a colour."}]

        def chat(**kw):
            r = client.chat.completions.create(model=model, messages=messages,
                                               extra_body={"ignore_eos": True}, **kw)
            return r.choices[0].message.content, r.usage.completion_tokens

        default_text, default_n = chat()
        assert default_n == 5  # the override's max_new_tokens over the folder's 6
        assert chat(temperature=0.0, max_tokens=5) == (default_text, 5)  # the folder's temperature 0
        assert chat(temperature=1.0, seed=7)[0] != default_text  # the request's own wins
        assert chat(max_tokens=20)[1] == 5  # capped
        assert chat(max_tokens=3)[1] == 3
        completion = client.completions.create(model=model, prompt="Once upon a time", extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 5  # OpenAI's 16, capped
        # Said at start-up, at the default log level: a reply that samples otherwise than
        # tokenloom's defaults has its reason in the log.
        assert ("default sampling parameters {'temperature': 0.0, 'max_tokens': 5} from " + model_dir) in srv.log_text()
    finally:
        srv.stop()
