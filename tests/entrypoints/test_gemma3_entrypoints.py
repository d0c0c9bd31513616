"""Gemma 3 270M (a base model: plain completions, no chat template) as a user runs it: the
`tokenloom generate` command and `tokenloom serve` with the official `openai` client, on the
GGUF's quantized weights (the default). The two front ends give the same greedy text."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenloom.model.errors import ModelNotFoundError
from tokenloom.model.loader import gemma3_270m_path

try:
    GEMMA3 = gemma3_270m_path()
except ModelNotFoundError as e:
    pytest.skip(str(e), allow_module_level=True)

pytestmark = pytest.mark.slow

SERVER_ARGS = ["--model", GEMMA3, "--max-model-len", "1024", "--num-kv-blocks", "256",
               "--served-model-name", "gemma3"]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def cli_proc():
    """`tokenloom generate`, started before the server fixture so that the two processes load the
    model side by side (each spends most of its start-up on one core)."""
    proc = subprocess.Popen([sys.executable, "-m", "tokenloom.entrypoints.cli", "generate", "--model", GEMMA3,
                             "--json", "--max-tokens", "8", "--num-kv-blocks", "64", PROMPT],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def cli_text_of(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    [line] = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert line["prompt"] == PROMPT and len(line["token_ids"]) == 8 and line["finish_reason"] == "length"
    return line["text"]


def test_generate_then_serve_the_same_completion(cli_proc, server):
    cli_text = cli_text_of(cli_proc)
    assert "France" in cli_text or "Paris" in cli_text, cli_text  # on topic
    client = server.client()
    [model] = client.models.list().data
    assert model.id == "gemma3"
    assert model.model_extra["quantization"].startswith("gguf Q4_K")  # the file's own formats
    resp = client.completions.create(model="gemma3", prompt=PROMPT, max_tokens=8, temperature=0.0)
    assert resp.choices[0].text == cli_text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 8 and resp.usage.prompt_tokens == 6  # <bos> + 5
    # Streamed, the pieces add up to the same text.
    stream = client.completions.create(model="gemma3", prompt=PROMPT, max_tokens=8, temperature=0.0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == cli_text
