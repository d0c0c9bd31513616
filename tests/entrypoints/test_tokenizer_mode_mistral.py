"""tokenizer_mode="mistral": mistral_common's own tokenizers, on the real files its wheel ships
(a tekken.json and SentencePiece models v1 and v7): text and chat encode as mistral_common encodes
them (the chat by its request encoding, control tokens as ids), the engine's incremental
detokenizer reads what a whole decode reads, grammars see the vocabulary, and an engine runs a
Mistral model with it, offline chat and a regex included."""
from __future__ import annotations

import os

import pytest

mistral_common = pytest.importorskip("mistral_common")

from mistral_common.protocol.instruct.request import ChatCompletionRequest  # noqa: E402
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer as Reference  # noqa: E402

from tokenloom import LLM, SamplingParams  # noqa: E402
from tokenloom.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from tokenloom.model.errors import ModelLoadError  # noqa: E402
from tokenloom.model.loader import load_tokenizer  # noqa: E402
from tokenloom.model.mistral_tokenizer import MistralTokenizer  # noqa: E402

from conftest import ServerProcess  # noqa: E402 - tests/entrypoints/conftest.py, bound at collection as the other server tests do

DATA = os.path.join(os.path.dirname(mistral_common.__file__), "data")
# The shipped files, under the names Mistral's hub repos give them.
FILES = {"tekken_240911.json": "tekken.json", "mistral_instruct_tokenizer_241114.model.v7": "tokenizer.model.v7",
         "tokenizer.model.v1": "tokenizer.model.v1"}
TEXT = "Hello, world! ünïcode 日本語 🙂\n\n    def f(x): return x  # done"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": [{"type": "text", "text": "Bye"}]}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module", params=sorted(FILES))
def files(request, tmp_path_factory) -> tuple[str, MistralTokenizer, Reference]:
    """A repo folder holding one of the shipped tokenizer files, our tokenizer of it, and the
    mistral_common tokenizer it wraps (the reference: loading tekken.json takes seconds)."""
    folder = tmp_path_factory.mktemp("mistral")
    os.symlink(os.path.join(DATA, request.param), folder / FILES[request.param])
    tok = load_tokenizer(str(folder), "mistral")
    assert isinstance(tok.mistral, Reference)
    return str(folder), tok, tok.mistral


def test_text_encodes_and_decodes_as_mistral_common(files):
    _, tok, ref = files
    inner = ref.instruct_tokenizer.tokenizer
    ids = tok.encode(TEXT)
    assert ids == inner.encode(TEXT, bos=True, eos=False) and ids[0] == tok.bos_token_id
    assert tok.encode(TEXT, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + TEXT
    assert tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(ids)) == ids
    assert len(tok) == inner.n_words and tok.eos_token_id == inner.eos_id


def test_the_detokenizer_streams_what_a_whole_decode_reads(files):
    """Token by token (multi-byte characters split over byte tokens), the engine's incremental
    detokenizer joins to the whole output's decode."""
    _, tok, _ = files
    prompt, output = tok.encode("Say it:"), tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, SamplingParams(), prompt)
    chunks = []
    for token_id in output:
        detok.update([token_id])
        chunks.append(detok.get_next_output_text(finished=False, delta=True))
    detok.update([], finished=True)
    chunks.append(detok.get_next_output_text(finished=True, delta=True))
    assert "".join(chunks) == tok.decode(prompt + output)[len(tok.decode(prompt)):]


def test_chat_is_mistral_commons_request_encoding(files):
    _, tok, ref = files
    for messages, tools in ((CHAT, None), (CHAT[1:2], TOOLS)):
        ids, text = tok.encode_chat(messages, tools)
        plain = [{**m, "content": "Bye"} if isinstance(m["content"], list) else m for m in messages]
        expected = ref.encode_chat_completion(ChatCompletionRequest.from_openai(messages=plain, tools=tools)).tokens
        assert ids == expected
        assert text.startswith("<s>") and ("Bye" in text if tools is None else "Hi" in text)
    if "v1" not in tok.path:  # the first tokenizer has no tool tokens: mistral_common leaves tools out there
        assert "[AVAILABLE_TOOLS]" in tok.encode_chat(CHAT[1:2], TOOLS)[1]
    with pytest.raises(ValueError, match="tokenizer_mode='mistral'"):
        tok.encode_chat([{"role": "assistant", "content": "first"}])


def test_a_folder_without_a_mistral_tokenizer_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="tekken.json or tokenizer.model"):
        MistralTokenizer(str(tmp_path))


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory) -> str:
    """A tiny MistralForCausalLM config (random weights: load_format='dummy') with the v7 tokenizer."""
    from transformers import MistralConfig

    folder = tmp_path_factory.mktemp("tiny-mistral")
    MistralConfig(vocab_size=32768, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                  architectures=["MistralForCausalLM"]).save_pretrained(folder)
    os.symlink(os.path.join(DATA, "mistral_instruct_tokenizer_241114.model.v7"), folder / "tokenizer.model.v7")
    return str(folder)


def test_an_engine_chats_and_follows_a_grammar_with_it(mistral_dir):
    from tokenloom import StructuredOutputsParams

    ref = Reference.from_file(os.path.join(mistral_dir, "tokenizer.model.v7"))
    with LLM(mistral_dir, tokenizer_mode="mistral", load_format="dummy", dtype="float32", max_model_len=128,
             kv_cache_memory_bytes=8 * 1024**2, multiprocess=False, seed=0) as llm:
        tok = llm.get_tokenizer()
        out = llm.chat(CHAT[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
        assert out.prompt_token_ids == ref.encode_chat_completion(
            ChatCompletionRequest.from_openai(messages=CHAT[:2])).tokens
        assert out.prompt.startswith("<s>[SYSTEM_PROMPT]") and out.prompt.endswith("[/INST]")
        assert len(out.outputs[0].token_ids) == 8
        # The text the output adds to the prompt's (a piece's leading space kept, as a continuation).
        whole = tok.decode(out.prompt_token_ids + list(out.outputs[0].token_ids))
        assert out.outputs[0].text == whole[len(tok.decode(out.prompt_token_ids)):]
        params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="(yes|no)"))
        answer = llm.generate("Answer:", params, use_tqdm=False)[0].outputs[0]
        assert answer.text in ("yes", "no", " yes", " no"), answer.text


@pytest.mark.slow  # a server of its own
def test_served_chat_is_encoded_by_mistral_common(mistral_dir):
    """`tokenloom serve DIR --tokenizer-mode mistral`: a chat completion's prompt is mistral_common's
    request encoding (its usage counts those tokens), a completion's text is encoded as text, and a
    route that would take a conversation as text says it cannot."""
    import httpx

    ref = Reference.from_file(os.path.join(mistral_dir, "tokenizer.model.v7"))
    server = ServerProcess([mistral_dir, "--tokenizer-mode", "mistral", "--load-format", "dummy", "--max-model-len",
                            "128", "--kv-cache-memory-bytes", str(8 * 1024**2), "--served-model-name", "tiny"], None)
    try:
        client = server.client()
        chat = client.chat.completions.create(model="tiny", messages=CHAT[:2], max_tokens=4, temperature=0)
        assert chat.usage.prompt_tokens == len(ref.encode_chat_completion(
            ChatCompletionRequest.from_openai(messages=CHAT[:2])).tokens)
        text = client.completions.create(model="tiny", prompt=TEXT, max_tokens=1, temperature=0)
        assert text.usage.prompt_tokens == len(ref.instruct_tokenizer.tokenizer.encode(TEXT, bos=True, eos=False))
        r = httpx.post(server.url("/tokenize"), json={"model": "tiny", "messages": CHAT[:2]}, timeout=60)
        assert r.status_code == 400 and "tokenizer_mode='mistral'" in r.json()["error"]["message"], r.text
    finally:
        server.stop()
