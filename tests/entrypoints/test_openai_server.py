"""`tokenloom serve` end to end: a real server subprocess, the official `openai` client (sync and
async), streamed and not, and every error status a client can cause."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

TOKENLOOM = Path(sys.executable).with_name("tokenloom")

SERVER_API_KEY = "test-key-123"
# --trust-request-chat-template: one test renders a request's own template.
SERVER_ARGS = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(128 * 1024**2), "--served-model-name", "tiny", "alias",
               "--trust-request-chat-template"]
MODEL = "tiny"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server):
    return server.client()


# ---- basics -------------------------------------------------------------------------------------


def test_models_health_version(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny", "alias"]
    # root: the model as given (vLLM's), here none: the embedded model's name, not its file's path.
    assert [m.model_extra["root"] for m in models] == ["SmolLM2-135M-Instruct"] * 2
    # The embedded GGUF is served from its quantized weights by default, and says so.
    assert models[0].model_extra["quantization"].startswith("gguf Q4_1x210+Q8_0x1")
    assert httpx.get(server.url("/health")).status_code == 200  # open without the key
    assert httpx.get(server.url("/version")).json()["version"]
    # SageMaker's /invocations (vLLM's too): the body says which API it is for.
    chat = httpx.post(server.url("/invocations"), headers=server.headers, timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).json()
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] <= 2
    text = httpx.post(server.url("/invocations"), headers=server.headers, timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 2}).json()
    assert text["object"] == "text_completion"
    for body, param in [({"what": 1}, None), ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens")]:
        r = httpx.post(server.url("/invocations"), headers=server.headers, timeout=60, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(server.url("/invocations"), headers=server.headers, content=b'{"prompt": ', timeout=60)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert httpx.post(server.url("/invocations"), json={"prompt": PROMPT}).status_code == 401  # behind the key
    # vLLM's profiling routes exist only with a trace folder set (none here).
    assert httpx.post(server.url("/start_profile"), headers=server.headers).status_code == 404
    # vLLM's API documentation, open like /health: the OpenAPI document and its two viewers.
    assert "/v1/chat/completions" in httpx.get(server.url("/openapi.json")).json()["paths"]
    for path in ("/docs", "/redoc"):
        r = httpx.get(server.url(path))
        assert r.status_code == 200 and "openapi.json" in r.text


def test_embeddings_need_a_pooling_server(client):
    with pytest.raises(openai.BadRequestError, match="--runner pooling") as e:
        client.embeddings.create(model=MODEL, input="Hello")
    assert e.value.body["param"] == "model"


def test_completion(server):
    async def run():
        async with server.async_client() as aclient:

            async def streamed_batch():
                stream = await aclient.completions.create(model=MODEL, prompt=["A", "B", "C"], max_tokens=2, n=2, stream=True)
                return [chunk async for chunk in stream]

            return await asyncio.gather(
                aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0),
                # Token ids are a prompt too, and the alias names the same model.
                aclient.completions.create(model="alias", prompt=[504, 3458, 282], max_tokens=2, temperature=0),
                # No max_tokens: OpenAI's default of 16.
                aclient.completions.create(model=MODEL, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}),
                # A batch of prompts: choice index = prompt index * n + completion index.
                aclient.completions.create(model=MODEL, prompt=["One", "Two"], max_tokens=2, n=2, extra_body={"ignore_eos": True}),
                streamed_batch(),
            )

    r, r_ids, r_default, r_batch, batch_chunks = asyncio.run(run())
    assert sorted(c.index for c in r_batch.choices) == [0, 1, 2, 3] and r_batch.usage.completion_tokens == 8
    finished = sorted(c.index for chunk in batch_chunks for c in chunk.choices if c.finish_reason)
    assert finished == [0, 1, 2, 3, 4, 5]
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL and r.created > 0
    (choice,) = r.choices
    assert choice.index == 0 and choice.text and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 4
    assert r_ids.choices[0].text and r_ids.model == "alias" and r_ids.usage.prompt_tokens == 3
    assert r_default.usage.completion_tokens == 16


def test_no_model_means_the_first_served_name(server):
    r = httpx.post(server.url("/v1/completions"), headers=server.headers, json={"prompt": PROMPT, "max_tokens": 1}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL


def test_streamed_completion_equals_non_streamed(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=1234)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) >= 2
    assert "".join(texts) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.id == chunks[0].id and c.id.startswith("cmpl-") for c in chunks)
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 6 and usage.total_tokens == usage.prompt_tokens + 6


def test_chat_completion_sync_and_async_stream(server, client):
    messages = [{"role": "user", "content": "Say hello."}]
    # Both compared requests find the prompt's whole blocks in the prefix cache, so both compute
    # the same rows: how many rows a matmul has picks its kernel (on AMX-BF16 CPUs the quantized
    # weights go on the bf16 tiles from 16 rows), and the kernels differ in the last bits.
    client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=1)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5, temperature=1.0, seed=7)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.choices[0].finish_reason in ("stop", "length") and 0 < r.usage.completion_tokens <= 5

    async def streamed() -> tuple[list, str]:
        async with server.async_client() as aclient:
            stream = await aclient.chat.completions.create(
                model=MODEL, messages=messages, max_completion_tokens=5, temperature=1.0, seed=7, stream=True
            )
            chunks = [c async for c in stream]
        return chunks, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    chunks, text = asyncio.run(streamed())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert text == msg.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_n2(server, client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=3, n=2, seed=3, temperature=1.0)
    r = client.completions.create(**kwargs)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 6
    # Streamed, the same seed gives the same two texts.
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {c.index: c.text for c in r.choices}

    async def chat():
        chat_kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, n=2, seed=3)
        async with server.async_client() as aclient:

            async def chunks():
                return [c async for c in await aclient.chat.completions.create(stream=True, **chat_kwargs)]

            return await asyncio.gather(aclient.chat.completions.create(**chat_kwargs), chunks())

    full, chunks = asyncio.run(chat())
    assert sorted(c.index for c in full.choices) == [0, 1] and all(c.message.content for c in full.choices)
    streamed = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert all(streamed.values())
    assert {c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason} <= {"stop", "length"}


def test_stop_string(client):
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    words = free.split()
    assert len(words) >= 3, free
    stop = words[2]
    cut = free.index(stop)  # the first occurrence ends the text
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free[:cut]


def test_seed_reproducibility(server, client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=1.0)
    first = client.completions.create(seed=11, **kwargs).choices[0].text
    assert client.completions.create(seed=11, **kwargs).choices[0].text == first

    async def others():
        async with server.async_client() as aclient:
            return await asyncio.gather(*(aclient.completions.create(seed=seed, **kwargs) for seed in (12, 13, 14)))

    assert any(r.choices[0].text != first for r in asyncio.run(others()))


def test_completion_logprobs_shape(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    choice = r.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == choice.text
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs)
    assert all(len(top) == 2 for top in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(logprob) and logprob == pytest.approx(max(top.values()))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    assert "".join(e.token for e in content) == r.choices[0].message.content
    # logprobs=False: none.
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert r.choices[0].logprobs is None


# ---- echo and prompt logprobs (lm-evaluation-harness's loglikelihood requests) -----------------


def test_echo_text_is_prompt_then_completion(client):
    from tokenloom.model.source import load_tokenizer

    ids = [504, 3458, 282]
    for prompt, prompt_text in ((PROMPT, PROMPT), (ids, load_tokenizer().decode(ids))):
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=3, n=2, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
        plain = client.completions.create(**kwargs)
        echoed = client.completions.create(echo=True, **kwargs)
        assert sorted(c.index for c in echoed.choices) == [0, 1]
        completions = {c.index: c.text for c in plain.choices}
        assert all(completions.values())
        # A token-id prompt is echoed decoded.
        assert {c.index: c.text for c in echoed.choices} == {i: prompt_text + t for i, t in completions.items()}
        # The echoed prompt is not counted as completion tokens.
        assert echoed.usage.completion_tokens == 6 and echoed.usage.prompt_tokens == plain.usage.prompt_tokens
        assert all(c.logprobs is None for c in echoed.choices)


def test_echo_max_tokens_0_scores_the_prompt(client):
    def score():
        return client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, extra_body={"prompt_logprobs": 1}
        )

    r = score()
    (choice,) = r.choices
    # Nothing generated: the prompt alone, counted as prompt tokens only.
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.total_tokens == r.usage.prompt_tokens
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == r.usage.prompt_tokens
    assert "".join(lp.tokens) == PROMPT
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]
    # Nothing precedes the first prompt token to score it.
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) and x < 0 for x in lp.token_logprobs[1:])
    # The same numbers as vLLM's prompt_logprobs of the same request: per position, the prompt's
    # token first ({token id: {logprob, rank, decoded_token}}), then the most likely one.
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == len(lp.tokens) and prompt_logprobs[0] is None
    for token, logprob, top, position in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], prompt_logprobs[1:]):
        assert all(key.isdigit() for key in position) and 1 <= len(position) <= 2
        chosen = next(iter(position.values()))
        assert chosen["decoded_token"] == token and chosen["logprob"] == logprob and chosen["rank"] >= 1
        best = [e for e in position.values() if e["rank"] == 1]
        assert len(best) == 1 and top == {best[0]["decoded_token"]: best[0]["logprob"]}
        assert (chosen["rank"] == 1) == (len(position) == 1)
    # Reproducible: a loglikelihood is the same on every call.
    assert score().choices[0].logprobs.token_logprobs == lp.token_logprobs
    # Without prompt_logprobs, the choice carries none.
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    assert r.choices[0].logprobs.token_logprobs == lp.token_logprobs
    assert "prompt_logprobs" not in (r.choices[0].model_extra or {})
    # Each keeps its own number of alternatives: 3 for echo's logprobs, 1 in prompt_logprobs.
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=3, extra_body={"prompt_logprobs": 1})
    assert all(len(top) == 3 for top in r.choices[0].logprobs.top_logprobs[1:])
    assert [len(p) for p in r.choices[0].model_extra["prompt_logprobs"][1:]] == [len(p) for p in prompt_logprobs[1:]]


def test_echo_prompt_logprob_is_the_generated_tokens_logprob(client):
    """The logprob echo gives a prompt token is the one the model gave it when it generated it.
    It comes from the prefill's logits instead of a decode step's, whose quantized kernels round
    differently (up to ~0.02 seen); a token scored at the wrong position would not match."""
    from tokenloom.model.source import load_tokenizer

    tokenizer = load_tokenizer()
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    generated = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, logprobs=1)
    tokens = generated.choices[0].logprobs.tokens
    token_ids = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(t)) for t in tokens]
    assert all(len(t) == 1 for t in token_ids), tokens
    scored = client.completions.create(model=MODEL, prompt=ids + [t[0] for t in token_ids], max_tokens=0, echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert lp.tokens[len(ids):] == tokens
    assert lp.token_logprobs[len(ids):] == pytest.approx(generated.choices[0].logprobs.token_logprobs, abs=0.05)


def test_streamed_echo_equals_non_streamed(client):
    # Sampled, n=2 (both completions run in the same steps either way, so the same seed gives the
    # same texts); and a batch of prompts scored without generating (choice index = prompt index).
    sampled = dict(prompt=PROMPT, max_tokens=3, n=2, temperature=1.0, seed=9, logprobs=1,
                   extra_body={"ignore_eos": True, "skip_special_tokens": False})
    scored = dict(prompt=[PROMPT, "Once upon a time"], max_tokens=0, logprobs=2)
    for kwargs in (sampled, scored):
        full = client.completions.create(model=MODEL, echo=True, **kwargs)
        chunks = list(client.completions.create(model=MODEL, echo=True, stream=True, stream_options={"include_usage": True}, **kwargs))
        texts: dict[int, str] = {}
        tokens: dict[int, list] = {}
        token_logprobs: dict[int, list] = {}
        offsets: dict[int, list] = {}
        for chunk in chunks:
            for c in chunk.choices:
                if c.index not in texts:  # a choice's first chunk starts with the whole prompt
                    prompt = PROMPT if kwargs is sampled else kwargs["prompt"][c.index]
                    assert c.text.startswith(prompt) and c.logprobs.token_logprobs[0] is None
                texts[c.index] = texts.get(c.index, "") + c.text
                tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
                token_logprobs.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
                offsets.setdefault(c.index, []).extend(c.logprobs.text_offset)
        assert texts == {c.index: c.text for c in full.choices}
        assert tokens == {c.index: c.logprobs.tokens for c in full.choices}
        assert offsets == {c.index: c.logprobs.text_offset for c in full.choices}
        for c in full.choices:
            assert "".join(c.logprobs.tokens) == c.text
            # Within kernel rounding: the two may batch the prompts' prefills differently.
            assert token_logprobs[c.index] == pytest.approx(c.logprobs.token_logprobs, abs=0.05)
        assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == (6 if kwargs is sampled else 0)
        assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


# ---- errors -------------------------------------------------------------------------------------


def _error(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_400_invalid_field_names_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=5)
    err = _error(e.value)
    assert err["param"] == "temperature" and "temperature" in err["message"] and "2" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_completion_tokens=0)
    assert _error(e.value)["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as e:  # a type error, caught by the request model
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"top_k": "many"})
    assert _error(e.value)["param"] == "top_k"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    assert _error(e.value)["param"] == "messages"
    # max_tokens 0 only with echo (scoring the prompt).
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    err = _error(e.value)
    assert err["param"] == "max_tokens" and "echo" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, extra_body={"min_tokens": 1})
    assert _error(e.value)["param"] == "min_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=-1, echo=True)
    assert _error(e.value)["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"prompt_logprobs": 21})
    assert _error(e.value)["param"] == "prompt_logprobs"


def test_400_malformed_json(server):
    r = httpx.post(server.url("/v1/completions"), headers={**server.headers, "Content-Type": "application/json"}, content=b'{"prompt": "x",')
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url("/v1/chat/completions"), headers=server.headers, json=["not", "an", "object"])
    assert r.status_code == 400


def test_400_prompt_too_long(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hello " * 300, max_tokens=2)
    err = _error(e.value)
    assert "256" in err["message"] and "max_model_len" in err["message"] and err["param"] == "prompt"


def test_401_without_or_with_wrong_key(server):
    for key in ("wrong-key", "test-key-12"):
        with pytest.raises(openai.AuthenticationError) as e:
            server.client(api_key=key).completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        assert e.value.status_code == 401 and _error(e.value)["code"] == "invalid_api_key"
    r = httpx.post(server.url("/v1/completions"), json={"prompt": PROMPT})
    assert r.status_code == 401
    assert httpx.get(server.url("/v1/models")).status_code == 401


def test_404_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-17", prompt=PROMPT, max_tokens=1)
    err = _error(e.value)
    assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-17" in err["message"]


# ---- load, disconnects and metrics ----------------------------------------------------------------


def test_burst_with_disconnects_frees_everything(server):
    num, quitters = 50, set(range(0, 50, 5))

    async def one(aclient, i: int) -> tuple[str, str | None]:
        stream = await aclient.completions.create(
            model=MODEL, prompt=f"{i} little pigs went", max_tokens=4, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
            if i in quitters:
                await stream.close()  # the client goes away mid-stream
                return "quit", None
        return text, finish

    async def burst():
        async with server.async_client() as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(num)))

    before = server.metrics()
    results = asyncio.run(burst())
    for i, (text, finish) in enumerate(results):
        if i not in quitters:
            assert text and finish == "length", (i, text, finish)
    after = server.wait_idle()
    assert after["tokenloom:num_requests_running"] == 0
    assert after["tokenloom:num_requests_waiting"] == 0
    assert after["tokenloom:num_kv_blocks_used"] == 0
    assert after["tokenloom:num_kv_blocks_free"] == after["tokenloom:num_kv_blocks_total"] > 0
    assert after["tokenloom:kv_cache_usage_perc"] == 0

    def success(m: dict, reason: str) -> float:
        return next((v for k, v in m.items() if k.startswith("tokenloom:request_success_total{") and f'finished_reason="{reason}"' in k), 0.0)

    # Quitters that were still generating were aborted; the others ran to max_tokens.
    assert success(after, "length") - success(before, "length") >= num - len(quitters)
    assert success(after, "abort") - success(before, "abort") >= 1


def test_non_streamed_disconnect_aborts(server):
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url("/v1/completions"),
            headers=server.headers,
            json={"prompt": PROMPT, "max_tokens": 240, "ignore_eos": True},
            timeout=httpx.Timeout(30, read=1.5),
        )
    after = server.wait_idle()
    assert after["tokenloom:num_requests_running"] == 0 and after["tokenloom:num_kv_blocks_used"] == 0
    aborted = [k for k in after if k.startswith("tokenloom:request_success_total{") and "abort" in k]
    assert after[aborted[0]] == before.get(aborted[0], 0) + 1


def test_metrics_exposition(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    m = server.metrics()
    for name in (
        "tokenloom:num_requests_running",
        "tokenloom:num_requests_waiting",
        "tokenloom:kv_cache_usage_perc",
        "tokenloom:num_kv_blocks_used",
        "tokenloom:num_kv_blocks_free",
        "tokenloom:request_success_total",
        "tokenloom:time_to_first_token_seconds_count",
        "tokenloom:e2e_request_latency_seconds_count",
        "tokenloom:prompt_tokens_total",
        "tokenloom:generation_tokens_total",
    ):
        assert name in m, name
    assert m["tokenloom:time_to_first_token_seconds_count"] >= 1
    assert m["tokenloom:e2e_request_latency_seconds_sum"] > 0


TOOLS_DROPPED = 'tokenloom:tool_requests_without_tools_in_prompt_total{model_name="tiny"}'


def test_tools_the_default_template_drops_are_counted_and_warned_about_once(server, client):
    """SmolLM2's own chat template leaves `tools` out of the prompt: each such request is counted
    on /metrics, and the log says so (and how to fix it) once for the template, not per request."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    before = server.metrics()[TOOLS_DROPPED]
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert server.metrics()[TOOLS_DROPPED] == before  # no tools, nothing dropped
    for _ in range(2):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=[weather], tool_choice="auto", max_tokens=1)
    assert server.metrics()[TOOLS_DROPPED] == before + 2
    warnings = [line for line in Path(server.log.name).read_text(errors="replace").splitlines()
                if "drops the request's tools" in line]
    assert len(warnings) == 1, warnings
    assert "--chat-template <name or path>" in warnings[0] and "'hermes'" in warnings[0]


def test_bench_serve_json(server):
    out = subprocess.run(
        [str(TOKENLOOM), "bench", "serve", "--base-url", server.base_url, "--api-key", server.api_key, "--num-prompts", "4",
         "--input-len", "8", "--output-len", "3", "--request-rate", "50", "--seed", "1", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["completed"] == 4 and result["failed"] == 0 and result["model"] == MODEL
    assert result["total_output_tokens"] == 12 and result["total_input_tokens"] == 32
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            assert result[f"{stat}_{metric}_ms"] >= 0
    assert result["mean_e2el_ms"] >= result["mean_ttft_ms"] > 0


def test_front_end_imports_neither_torch_nor_xgrammar():
    """The server's front end reads the model's config and tokenizer from metadata and validates
    structured-output specs lazily: importing it pulls in neither torch nor xgrammar (~1 s of CPU
    and ~250 MB per server; only the engine core needs them)."""
    import subprocess
    import sys

    code = ("import sys, tokenloom.entrypoints.openai.api_server, tokenloom.entrypoints.cli; "
            "print(sorted(m for m in ('torch', 'xgrammar') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


# ---- vLLM's request rules and extras --------------------------------------------------------------


def test_400_max_tokens_beyond_the_context_names_the_field(client):
    # prompt + max_tokens must fit in max_model_len (256), as in vLLM's and OpenAI's servers: a
    # request that would run to the end of the context unasked is refused at once.
    prompt = [504] * 250
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6
    ask = [{"role": "user", "content": "Hi"}]
    for create, field, kwargs in (
        (client.completions.create, "max_tokens", dict(prompt=prompt, max_tokens=7)),
        (client.chat.completions.create, "max_tokens", dict(messages=ask, max_tokens=300)),
        (client.chat.completions.create, "max_completion_tokens", dict(messages=ask, max_completion_tokens=300)),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            create(model=MODEL, **kwargs)
        err = _error(e.value)
        assert err["param"] == field and "maximum context length is 256 tokens" in err["message"], err


def test_truncate_prompt_tokens_keeps_the_prompts_end(client):
    """vLLM's truncate_prompt_tokens: a prompt far beyond the 256-token context runs on its last
    k tokens, as if those had been sent; -1 keeps the longest prompt the context takes."""
    long_ids = [504 + i % 300 for i in range(1000)]
    greedy = dict(model=MODEL, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    kept = client.completions.create(prompt=long_ids[-20:], **greedy)
    cut = client.completions.create(prompt=long_ids, echo=True, **{**greedy, "extra_body": {
        "ignore_eos": True, "truncate_prompt_tokens": 20}})
    assert cut.usage.prompt_tokens == 20 and cut.choices[0].text.endswith(kept.choices[0].text)
    echoed = client.completions.create(prompt=long_ids[-20:], echo=True, **greedy)
    assert cut.choices[0].text == echoed.choices[0].text  # the echo is the kept tokens' text
    text = " ".join(f"word{i}" for i in range(2000))  # ~6000 tokens: refused without truncation
    with pytest.raises(openai.BadRequestError):
        client.completions.create(prompt=text, **greedy)
    full = client.completions.create(prompt=text, **{**greedy, "max_tokens": 1,
                                                     "extra_body": {"truncate_prompt_tokens": -1}})
    assert full.usage.prompt_tokens == 255 and full.usage.completion_tokens == 1
    ask = [{"role": "user", "content": text}]
    chat = client.chat.completions.create(messages=ask, **{**greedy, "extra_body": {"truncate_prompt_tokens": 30}})
    assert chat.usage.prompt_tokens == 30 and chat.usage.completion_tokens == 3


def test_400_for_what_vllm_refuses_too(client):
    ask = [{"role": "user", "content": "Hi"}]
    cases = [
        ("priority", dict(extra_body={"priority": 3})),  # FCFS server: priorities would be ignored
        ("stream_options", dict(stream_options={"include_usage": True})),  # without stream
        ("truncate_prompt_tokens", dict(extra_body={"truncate_prompt_tokens": 257})),  # > max_model_len
        ("truncate_prompt_tokens", dict(extra_body={"truncate_prompt_tokens": 0})),
    ]
    for field, kwargs in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ask, max_tokens=2, **kwargs)
        assert _error(e.value)["param"] == field
    # A part this text model cannot read is named, not lost in a union's type errors.
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    err = _error(e.value)
    assert err["param"] == "messages" and "'image_url' part" in err["message"] and "more error" not in err["message"]


def test_chat_text_parts_prefill_echo_template_kwargs_and_usage_per_chunk(client):
    greedy = dict(model=MODEL, max_tokens=6, temperature=0)
    joined = client.chat.completions.create(messages=[{"role": "user", "content": "Line one.\nLine two."}], **greedy)
    parts = client.chat.completions.create(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Line one."}, {"type": "text", "text": "Line two."}]}], **greedy)
    # vLLM joins text parts with a newline: the same prompt, the same reply.
    assert parts.usage.prompt_tokens == joined.usage.prompt_tokens
    assert parts.choices[0].message.content == joined.choices[0].message.content
    # An assistant prefill continued, and echoed in front of the reply (vLLM's echo).
    prefill = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1, 2, 3,"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    cont = client.chat.completions.create(messages=prefill, extra_body=extra, **greedy)
    echoed = client.chat.completions.create(messages=prefill, extra_body={**extra, "echo": True}, **greedy)
    assert echoed.choices[0].message.content == "1, 2, 3," + cont.choices[0].message.content
    # The prefill leaves the turn open: fewer prompt tokens than the closed conversation's.
    closed = client.chat.completions.create(messages=prefill, extra_body={"add_generation_prompt": False}, **greedy)
    assert cont.usage.prompt_tokens < closed.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=prefill, extra_body={"continue_final_message": True}, **greedy)
    assert _error(e.value)["param"] == "continue_final_message"
    # A template of one's own, with its variables.
    own = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **greedy, extra_body={
        "chat_template": "{{ greeting }} {% for m in messages %}{{ m.content }}{% endfor %}",
        "chat_template_kwargs": {"greeting": "Hello there,"}, "add_generation_prompt": False})
    plain = client.completions.create(model=MODEL, prompt="Hello there, Hi", max_tokens=1)
    assert own.usage.prompt_tokens == plain.usage.prompt_tokens
    # continuous_usage_stats: every chunk carries the counts so far.
    stream = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], stream=True, **greedy,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [chunk.usage.completion_tokens for chunk in stream if chunk.choices and chunk.usage is not None]
    assert counts and counts == sorted(counts) and counts[-1] >= 1


def test_completion_stream_with_continuous_usage(client):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [chunk.usage.completion_tokens for chunk in stream if chunk.choices]
    assert counts == sorted(counts) and counts[-1] == 5
