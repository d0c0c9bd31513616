"""Hub ids, against a local hub (hub_server.py; HF_ENDPOINT points to it, never the internet):
`LLM("org/name")` downloads only what the engine reads and generates as transformers does, then
loads again from the cache with HF_HUB_OFFLINE=1 and the server gone; `org/name-GGUF:TAG` picks
the GGUF by its quantization tag and pairs with another repo's tokenizer; a split GGUF is fetched
and loaded whole; each way a hub id can fail is one line; load_format="dummy" needs no weights."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hub_server import FakeHub, FakeRepo
from model_helpers import save_hf_dir, tiny_hf_model

from tokenloom import LLM, SamplingParams
from tokenloom.config import EngineConfig
from tokenloom.model.errors import ModelLoadError, ModelNotFoundError
from tokenloom.model.hub import fetch_model_files, parse_hub_id, pick_files
from tokenloom.model.loader import load_model

TOKEN = "hf_test_token"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [1, 450, 4321, 12, 99, 7]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    """(transformers' tiny Llama, its HF directory): SmolLM2's tokenizer, random weights."""
    from tokenloom.model.loader import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path)
    model = tiny_hf_model("llama", vocab_size=len(tokenizer), seed=3)
    directory = save_hf_dir(model, tokenizer, str(tmp_path_factory.mktemp("tiny")))
    return model, directory


@pytest.fixture(scope="module")
def repos(tiny, smollm2_path, tmp_path_factory) -> dict[str, FakeRepo]:
    _, directory = tiny
    files = {f: os.path.join(directory, f) for f in os.listdir(directory)}
    decoys = tmp_path_factory.mktemp("decoys")
    decoy = str(decoys / "decoy.bin")
    with open(decoy, "wb") as f:
        f.write(b"\0" * 1024)  # never fetched: a test fails if it is
    gguf_files = {"SmolLM2-135M-Instruct-Q4_1.gguf": smollm2_path, "SmolLM2-135M-Instruct-Q8_0.gguf": decoy,
                  "Q2_K/SmolLM2-135M-Instruct-Q2_K-00001-of-00002.gguf": decoy,
                  "Q2_K/SmolLM2-135M-Instruct-Q2_K-00002-of-00002.gguf": decoy, "README.md": decoy}
    return {
        "org/tiny-llama": FakeRepo({**files, "pytorch_model.bin": decoy, "original/consolidated.pth": decoy},
                                   branches={"v1": "1" * 40}),
        "org/gated-llama": FakeRepo(files, token=TOKEN),
        "org/only-bin": FakeRepo({"config.json": files["config.json"], "tokenizer.json": files["tokenizer.json"],
                                  "pytorch_model.bin": decoy}),
        "org/SmolLM2-GGUF": FakeRepo(gguf_files),
    }


@pytest.fixture
def hub(repos, tmp_path, monkeypatch):
    """A fresh local hub and an empty cache, for one test."""
    server = FakeHub(repos)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    for name in ("HF_HUB_OFFLINE", "HF_TOKEN", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))  # no token a developer saved
    yield server
    server.stop()


def _reference(model) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([PROMPT])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def _generate(llm: LLM) -> list[int]:
    return list(llm.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def test_hub_id_loads_then_loads_offline(hub, tiny, tmp_path, monkeypatch):
    """A vLLM script's keywords run unchanged; only config, tokenizer and safetensors are fetched
    (not the .bin beside them, nor a subfolder's weights); the engine core gets the snapshot
    folder; a second start finds everything in the cache with no hub to ask."""
    download_dir = str(tmp_path / "downloads")
    kwargs = dict(tokenizer=None, revision="main", tokenizer_mode="auto", download_dir=download_dir,
                  dtype="float32", max_model_len=128, multiprocess=False)
    llm = LLM("org/tiny-llama", **kwargs)
    expected = _reference(tiny[0])
    assert _generate(llm) == expected
    assert {p.removeprefix("org/tiny-llama/") for p in hub.fetched()} == {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "chat_template.jinja"}
    assert llm.llm_engine.config.model.startswith(download_dir)
    assert {m.labels.get("model_name") for m in llm.get_metrics()} == {"org/tiny-llama"}  # the id, not the folder
    llm.llm_engine.shutdown()
    del llm

    hub.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _generate(LLM("org/tiny-llama", **kwargs)) == expected


def test_gguf_repo_by_tag_with_another_repos_tokenizer(hub, smollm2_path):
    """`repo:Q4_1` fetches that GGUF alone (not the Q8_0 beside it); `tokenizer="org/..."`
    fetches only the tokenizer files of that repo and the engine uses them."""
    llm = LLM("org/SmolLM2-GGUF:Q4_1", tokenizer="org/tiny-llama", max_model_len=128, multiprocess=False)
    assert len(_generate(llm)) == GREEDY.max_tokens
    config = llm.llm_engine.config
    assert os.path.basename(config.model) == "SmolLM2-135M-Instruct-Q4_1.gguf"
    assert os.path.isfile(os.path.join(config.tokenizer, "tokenizer.json"))
    assert hub.fetched() == {"org/SmolLM2-GGUF/SmolLM2-135M-Instruct-Q4_1.gguf", "org/tiny-llama/config.json",
                             "org/tiny-llama/tokenizer.json", "org/tiny-llama/tokenizer_config.json",
                             "org/tiny-llama/chat_template.jinja"}
    llm.llm_engine.shutdown()


def test_split_gguf_is_fetched_whole(hub):
    config = EngineConfig(model="org/SmolLM2-GGUF:q2_k")
    fetch_model_files(config)
    assert config.model.endswith("Q2_K/SmolLM2-135M-Instruct-Q2_K-00001-of-00002.gguf")
    assert os.path.isfile(config.model.replace("00001-of", "00002-of"))
    named = EngineConfig(model="org/SmolLM2-GGUF/SmolLM2-135M-Instruct-Q8_0.gguf")
    fetch_model_files(named)
    assert named.model.endswith("SmolLM2-135M-Instruct-Q8_0.gguf")


@pytest.mark.parametrize("model, options, says", [
    ("org/no-such-model", {}, "no such model repository"),
    ("org/gated-llama", {}, "gated repository"),
    ("org/tiny-llama", {"revision": "v9"}, "revision 'v9' does not exist"),
    ("org/only-bin", {}, "only PyTorch .bin files"),
    ("org/SmolLM2-GGUF:Q5_K_M", {}, "no GGUF of quantization 'Q5_K_M'"),
])
def test_each_failure_is_one_line(hub, model, options, says):
    with pytest.raises(ModelNotFoundError) as error:
        fetch_model_files(EngineConfig(model=model, **options))
    assert says in str(error.value) and "\n" not in str(error.value) and model.split(":")[0] in str(error.value)


def test_token_and_revision_reach_the_hub(hub, monkeypatch):
    """The gated repo opens with hf_token (and with HF_TOKEN); a branch is a revision; the token
    stays in the caller (cleared from the config the engine core gets)."""
    config = EngineConfig(model="org/gated-llama", hf_token=TOKEN)
    fetch_model_files(config)
    assert os.path.isfile(os.path.join(config.model, "model.safetensors")) and config.hf_token is None
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    fetch_model_files(EngineConfig(model="org/gated-llama"))
    # vLLM's tokenizer_revision: the model's own tokenizer files, at that revision.
    tokenizer = EngineConfig(model="org/tiny-llama", tokenizer_revision="v1")
    fetch_model_files(tokenizer)
    assert os.path.basename(tokenizer.tokenizer) == "1" * 40 and os.path.basename(tokenizer.model) != "1" * 40
    assert not os.path.exists(os.path.join(tokenizer.tokenizer, "model.safetensors"))
    branch = EngineConfig(model="org/tiny-llama", revision="v1")
    fetch_model_files(branch)
    assert os.path.basename(branch.model) == "1" * 40


def test_hf_home_is_the_cache(hub, tmp_path, monkeypatch):
    """$HF_HOME/hub is the cache when HF_HUB_CACHE is unset, read when the model is resolved."""
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    config = EngineConfig(model="org/tiny-llama")
    fetch_model_files(config)
    assert config.model.startswith(str(tmp_path / "home" / "hub" / "models--org--tiny-llama"))


def test_serve_with_a_missing_repo_is_one_line(hub):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "tokenloom.entrypoints.cli", "serve", "org/no-such-model"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("tokenloom: error: org/no-such-model: no such model")
    assert "Traceback" not in done.stderr


def test_dummy_weights_from_a_config_directory(tiny, tmp_path, hub):
    """load_format="dummy": a directory with config.json and a tokenizer, no weights, runs; the
    weights are seeded (the same twice), in the model's dtype, small; a hub repo fetches no
    weights for it."""
    directory = tmp_path / "config-only"
    shutil.copytree(tiny[1], directory, ignore=shutil.ignore_patterns("*.safetensors"))
    llm = LLM(str(directory), load_format="dummy", max_model_len=64, multiprocess=False)
    first = _generate(llm)
    llm.llm_engine.shutdown()
    assert _generate(LLM(str(directory), load_format="dummy", max_model_len=64, multiprocess=False)) == first

    loaded = load_model(str(directory), dtype="bfloat16", load_format="dummy")
    weight = loaded.model.embed_tokens.weight
    assert weight.dtype == torch.bfloat16 and 0.015 < weight.float().std().item() < 0.025
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    norms = [p for n, p in loaded.model.named_parameters() if "norm" in n]
    assert norms and all(bool((p == 1).all()) for p in norms)

    config = EngineConfig(model="org/tiny-llama", load_format="dummy")
    fetch_model_files(config)
    assert not any(p.endswith(".safetensors") for p in hub.fetched())
    assert not os.path.exists(os.path.join(config.model, "model.safetensors"))


def test_what_is_a_hub_id_and_which_files(tmp_path, monkeypatch):
    assert parse_hub_id("org/name").repo == "org/name"
    assert parse_hub_id("org/name-GGUF:Q4_K_M").tag == "Q4_K_M"
    assert parse_hub_id("org/name-GGUF/sub/file.gguf").filename == "sub/file.gguf"
    local = tmp_path / "org" / "name"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_hub_id("org/name") is None  # an existing folder is a path, as in vLLM
    assert parse_hub_id("models/missing.gguf") is None  # a path that does not exist, said as such
    assert parse_hub_id("./org/x") is None and parse_hub_id("/abs/path") is None and parse_hub_id(None) is None
    files = ["config.json", "tokenizer.json", "model.safetensors", "consolidated.safetensors",
             "model-Q4_K_M.gguf", "model-Q4_K.gguf", "model-IQ4_XS.gguf", "generation_config.json"]
    picked, target = pick_files("x", parse_hub_id("o/r:q4_k"), files)
    assert picked == ["model-Q4_K.gguf"] and target == "model-Q4_K.gguf"
    picked, target = pick_files("x", parse_hub_id("o/r"), files)
    assert "model.safetensors" in picked and "consolidated.safetensors" not in picked and target == ""
    assert not any(p.endswith(".gguf") for p in picked)
    picked, _ = pick_files("x", parse_hub_id("o/r"), files, load_format="gguf")
    assert picked == ["model-Q4_K_M.gguf"]  # llama.cpp's default tag
    assert json.dumps(pick_files("x", parse_hub_id("o/r"), files, tokenizer_only=True)[0]) == \
        '["config.json", "tokenizer.json"]'


def test_split_gguf_loads_as_the_whole_file(tmp_path, monkeypatch):
    """A GGUF split by gguf-py's writer (llama.cpp's gguf-split layout) loads as the same file
    unsplit: metadata from the first part, tensors from every part, quantized or dequantized."""
    import functools

    import gguf
    from model_helpers import tiny_gguf

    whole = tiny_gguf(tmp_path, "llama", gguf.GGMLQuantizationType.Q8_0, seed=5)
    split_dir = tmp_path / "split"
    split_dir.mkdir()
    monkeypatch.setattr(gguf, "GGUFWriter", functools.partial(gguf.GGUFWriter, split_max_tensors=7))
    tiny_gguf(split_dir, "llama", gguf.GGMLQuantizationType.Q8_0, seed=5)
    parts = sorted(os.listdir(split_dir))
    assert len(parts) > 2 and parts[0].endswith("-00001-of-%05d.gguf" % len(parts))
    first = str(split_dir / parts[0])
    a = load_model(whole, dtype="float32", quantization=None).model.state_dict()
    b = load_model(first, dtype="float32", quantization=None).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    quantized = load_model(first, dtype="float32")
    assert quantized.quantization.startswith("gguf Q8_0")
    with pytest.raises(ModelLoadError, match="pass its first part"):
        load_model(str(split_dir / parts[1]))


@pytest.mark.slow  # a server of its own, and a download
def test_a_server_of_a_hub_id_names_the_model_as_given(hub, tmp_path):
    """`tokenloom serve org/name-GGUF:TAG`: /v1/models lists the model by the id as given, its
    `id` and its `root` (vLLM's: root is the model argument), never the cache folder it was
    downloaded to; the real server, the real download."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "tokenloom.entrypoints.cli", "serve", "org/SmolLM2-GGUF:Q4_1",
                             "--port", str(port), "--max-model-len", "128", "--kv-cache-memory-bytes",
                             str(16 * 1024**2)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        models = _when_ready(proc, f"http://127.0.0.1:{port}/v1/models", log)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert [(m["id"], m["root"]) for m in models["data"]] == [("org/SmolLM2-GGUF:Q4_1", "org/SmolLM2-GGUF:Q4_1")]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _when_ready(proc: subprocess.Popen, url: str, log) -> dict:
    import time

    import httpx

    deadline = time.monotonic() + 300  # a loaded 2-core machine takes minutes to start a server
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"tokenloom serve exited with {proc.returncode}:\n{log.read()[-3000:]}")
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("tokenloom serve was not ready in time")
