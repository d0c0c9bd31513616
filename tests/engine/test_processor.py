"""The input processor: tokenization, validation with errors that name the field and the limit,
and the token-id caches it fills in the SamplingParams."""
from __future__ import annotations


import msgspec
import pytest

from tokenloom.engine.processor import InputProcessor
from tokenloom.messages import EngineCoreRequest
from tokenloom.model.config import ModelArchConfig
from tokenloom.sampling_params import SamplingParams

VOCAB_SIZE = 49152
EOS = 2  # <|im_end|>
MAX_MODEL_LEN = 64


def smollm2_config(eos_token_ids=(EOS,)) -> ModelArchConfig:
    return ModelArchConfig(
        architecture="llama",
        num_hidden_layers=30,
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=VOCAB_SIZE,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=list(eos_token_ids),
    )


@pytest.fixture
def processor(tokenizer):
    return InputProcessor(tokenizer, smollm2_config(), MAX_MODEL_LEN)


def test_text_prompt_is_tokenized(processor, tokenizer):
    request, prompt = processor.process("r1", "Hello, 世界!", SamplingParams(), arrival_time=12.5, priority=3)
    assert isinstance(request, EngineCoreRequest)
    assert prompt == "Hello, 世界!"
    assert request.prompt_token_ids == tokenizer.encode("Hello, 世界!")
    assert (request.request_id, request.arrival_time, request.priority, request.eos_token_id) == ("r1", 12.5, 3, EOS)


def test_token_ids_and_dict_prompts(processor, tokenizer):
    ids = tokenizer.encode("Hello", add_special_tokens=False)
    request, prompt = processor.process("a", ids, SamplingParams(), 0.0)
    assert request.prompt_token_ids == ids and prompt is None
    request, prompt = processor.process("b", {"prompt_token_ids": ids}, SamplingParams(), 0.0)
    assert request.prompt_token_ids == ids and prompt is None
    request, prompt = processor.process("c", {"prompt": "Hello"}, SamplingParams(), 0.0)
    assert request.prompt_token_ids == ids and prompt == "Hello"
    with pytest.raises(ValueError, match="'prompt' .*'prompt_token_ids'"):
        processor.process("d", {"text": "Hello"}, SamplingParams(), 0.0)


@pytest.mark.parametrize("prompt", ["", [], {"prompt_token_ids": []}, {"prompt": ""}])
def test_empty_prompt_is_rejected(processor, prompt):
    with pytest.raises(ValueError, match="must not be empty"):
        processor.process("r", prompt, SamplingParams(), 0.0)


@pytest.mark.parametrize("bad_id", [VOCAB_SIZE, VOCAB_SIZE + 10, -1])
def test_out_of_vocab_prompt_ids_name_the_field_and_the_vocab_size(processor, bad_id):
    with pytest.raises(ValueError, match="prompt_token_ids") as info:
        processor.process("r", [5, bad_id, 7], SamplingParams(), 0.0)
    assert str(VOCAB_SIZE) in str(info.value) and str(bad_id) in str(info.value)


def test_non_integer_prompt_ids_are_rejected(processor):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        processor.process("r", [1, "2", 3], SamplingParams(), 0.0)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        processor.process("r", [1, True], SamplingParams(), 0.0)


def test_prompt_must_be_shorter_than_max_model_len(processor):
    processor.process("ok", [5] * (MAX_MODEL_LEN - 1), SamplingParams(), 0.0)
    for length in (MAX_MODEL_LEN, MAX_MODEL_LEN + 100):
        with pytest.raises(ValueError, match="max_model_len") as info:
            processor.process("r", [5] * length, SamplingParams(), 0.0)
        assert f"{length} tokens" in str(info.value) and f"max_model_len is {MAX_MODEL_LEN}" in str(info.value)


def test_max_tokens_none_fills_the_context_and_params_are_not_mutated(processor):
    params = SamplingParams(max_tokens=None, stop_token_ids=[7])
    request, _ = processor.process("r", [5] * 10, params, 0.0)
    assert request.sampling_params.max_tokens == MAX_MODEL_LEN - 10
    assert params.max_tokens is None and params._all_stop_token_ids is None
    request, _ = processor.process("r", [5] * 10, SamplingParams(max_tokens=3), 0.0)
    assert request.sampling_params.max_tokens == 3


@pytest.mark.parametrize(
    "field, params",
    [
        ("stop_token_ids", SamplingParams(stop_token_ids=[VOCAB_SIZE])),
        ("allowed_token_ids", SamplingParams(allowed_token_ids=[1, VOCAB_SIZE + 5])),
        ("logit_bias", SamplingParams(logit_bias={VOCAB_SIZE: 1.0})),
    ],
)
def test_sampling_token_ids_are_checked_against_the_vocab(processor, field, params):
    with pytest.raises(ValueError, match=field) as info:
        processor.process("r", "hi", params, 0.0)
    assert str(VOCAB_SIZE) in str(info.value)


def test_all_stop_token_ids(tokenizer, processor):
    request, _ = processor.process("r", "hi", SamplingParams(stop_token_ids=[7, 9]), 0.0)
    assert request.sampling_params._all_stop_token_ids == [EOS, 7, 9]
    request, _ = processor.process("r", "hi", SamplingParams(stop_token_ids=[7], ignore_eos=True), 0.0)
    assert request.sampling_params._all_stop_token_ids == [7]
    request, _ = processor.process("r", "hi", SamplingParams(), 0.0)
    assert request.sampling_params._all_stop_token_ids == [EOS]
    assert request.sampling_params.stop_token_ids is None


def test_a_models_other_eos_ids_become_stop_token_ids(tokenizer):
    processor = InputProcessor(tokenizer, smollm2_config(eos_token_ids=[0, EOS]), MAX_MODEL_LEN)
    request, _ = processor.process("r", "hi", SamplingParams(stop_token_ids=[9]), 0.0)
    params = request.sampling_params
    assert request.eos_token_id == EOS
    assert params.stop_token_ids == [9, 0] and params._all_stop_token_ids == [0, EOS, 9]
    request, _ = processor.process("r", "hi", SamplingParams(ignore_eos=True), 0.0)
    assert request.sampling_params.stop_token_ids is None
    assert request.sampling_params._all_stop_token_ids == []


def test_bad_words_are_tokenized_with_and_without_a_leading_space(processor, tokenizer):
    request, _ = processor.process("r", "hi", SamplingParams(bad_words=["hello", " world", "hello"]), 0.0)
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    assert request.sampling_params._bad_words_token_ids == [enc("hello"), enc(" hello"), enc("world"), enc(" world")]


def test_processed_request_crosses_the_wire_with_its_caches(processor):
    request, _ = processor.process("r", "hi", SamplingParams(bad_words=["x"], max_tokens=None), 0.0)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert decoded == request
    assert decoded.sampling_params._bad_words_token_ids == request.sampling_params._bad_words_token_ids


def test_apply_chat_template(processor):
    conversation = [{"role": "user", "content": "What is 2+2?"}]
    prompt = processor.apply_chat_template(conversation)
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    without = processor.apply_chat_template(conversation, add_generation_prompt=False)
    assert without == prompt[: -len("<|im_start|>assistant\n")]
    prompts = processor.apply_chat_template([conversation, [{"role": "user", "content": "Hi"}]])
    assert isinstance(prompts, list) and prompts[0] == prompt
    assert prompts[1].endswith("Hi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="conversation"):
        processor.apply_chat_template([["not a message"]])


def test_chat_content_parts_continue_final_message_and_own_templates(processor):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Line one."}, {"type": "text", "text": "Line two."}]}]
    # OpenAI's text parts read as vLLM joins them: one string, a newline between parts.
    assert processor.apply_chat_template(parts) == processor.apply_chat_template(
        [{"role": "user", "content": "Line one.\nLine two."}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\].*'image_url'"):
        processor.apply_chat_template([{"role": "user", "content": [
            {"type": "text", "text": "Look"}, {"type": "image_url", "image_url": {"url": "x"}}]}])
    # An assistant prefill: the last message stays open, without its end-of-turn token.
    prefill = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1, 2,"}]
    prompt = processor.apply_chat_template(prefill, add_generation_prompt=False, continue_final_message=True)
    assert prompt.endswith("<|im_start|>assistant\n1, 2,")
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        processor.apply_chat_template(prefill, continue_final_message=True)
    # A template of one's own, and its variables.
    template = "{% for m in messages %}[{{ m.role }}{{ suffix }}] {{ m.content }}\n{% endfor %}"
    assert processor.apply_chat_template(prefill, add_generation_prompt=False, chat_template=template,
                                         chat_template_kwargs={"suffix": "!"}) == \
        "[user!] Count to five.\n[assistant!] 1, 2,\n"


def test_priority_under_fcfs_is_refused(tokenizer):
    fcfs = InputProcessor(tokenizer, smollm2_config(), MAX_MODEL_LEN, scheduling_policy="fcfs")
    fcfs.process("a", "Hi", SamplingParams(), 0.0, priority=0)
    with pytest.raises(ValueError, match="priority is 2 .*scheduling_policy='priority'"):
        fcfs.process("b", "Hi", SamplingParams(), 0.0, priority=2)
    by_priority = InputProcessor(tokenizer, smollm2_config(), MAX_MODEL_LEN, scheduling_policy="priority")
    assert by_priority.process("c", "Hi", SamplingParams(), 0.0, priority=2)[0].priority == 2


def test_max_tokens_within_context_is_checked_only_when_asked(processor):
    # The server's rule (vLLM's and OpenAI's): prompt + max_tokens must fit in the context.
    fits = SamplingParams(max_tokens=MAX_MODEL_LEN - 10)
    processor.process("a", [5] * 10, fits, 0.0, max_tokens_within_context=True)
    too_many = SamplingParams(max_tokens=MAX_MODEL_LEN - 9)
    with pytest.raises(ValueError, match=rf"^max_tokens is too large: {MAX_MODEL_LEN - 9}\. .*"
                                         rf"{MAX_MODEL_LEN} tokens and the request has 10 input tokens"):
        processor.process("b", [5] * 10, too_many, 0.0, max_tokens_within_context=True)
    # Offline (vLLM's LLM too) such a request runs to the end of the context instead.
    assert processor.process("c", [5] * 10, too_many, 0.0)[0].sampling_params.max_tokens == MAX_MODEL_LEN - 9
    processor.process("d", [5] * 10, SamplingParams(max_tokens=None), 0.0, max_tokens_within_context=True)


class _BosTokenizer:
    """A stand-in for a tokenizer that adds a BOS (Llama 3 style): one char per token."""

    bos_token, bos_token_id, eos_token_id = "^", 1, 2

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [1 if c == "^" else 10 + ord(c) % 100 for c in text]
        return ([1] if add_special_tokens else []) + ids


def test_truncate_prompt_tokens_keeps_the_last_tokens(processor, tokenizer):
    text = " ".join(f"word{i}" for i in range(200))  # far beyond MAX_MODEL_LEN tokens and characters
    ids = tokenizer.encode(text)
    with pytest.raises(ValueError):
        processor.process("whole", text, SamplingParams(), 0.0)
    request, prompt = processor.process("cut", text, SamplingParams(truncate_prompt_tokens=10), 0.0)
    assert request.prompt_token_ids == ids[-10:] and prompt == tokenizer.decode(ids[-10:])
    request, prompt = processor.process("ids", ids, SamplingParams(truncate_prompt_tokens=5), 0.0)
    assert request.prompt_token_ids == ids[-5:] and prompt is None
    request, prompt = processor.process("both", {"prompt": text, "prompt_token_ids": ids},
                                        SamplingParams(truncate_prompt_tokens=5), 0.0)
    assert request.prompt_token_ids == ids[-5:] and prompt == tokenizer.decode(ids[-5:])
    request, _ = processor.process("all-that-fit", ids, SamplingParams(truncate_prompt_tokens=-1), 0.0)
    assert request.prompt_token_ids == ids[-(MAX_MODEL_LEN - 1):]
    # A prompt already short enough is left as it is, its text too.
    request, prompt = processor.process("short", "Hello", SamplingParams(truncate_prompt_tokens=10), 0.0)
    assert request.prompt_token_ids == tokenizer.encode("Hello") and prompt == "Hello"
    with pytest.raises(ValueError, match="truncate_prompt_tokens is 65 but max_model_len is 64"):
        processor.process("too-big", ids, SamplingParams(truncate_prompt_tokens=MAX_MODEL_LEN + 1), 0.0)


def test_truncation_keeps_the_bos_in_front(gemma3_path):
    """A tokenizer that adds a BOS (Gemma 3's) keeps it when the prompt is cut, as a tokenizer
    truncating on the left does (vLLM's), and the kept tokens are the text's last ones."""
    from tokenloom.model.source import load_model_config, load_tokenizer

    tokenizer = load_tokenizer(gemma3_path)
    processor = InputProcessor(tokenizer, load_model_config(gemma3_path), MAX_MODEL_LEN)
    text = " ".join(f"word{i}" for i in range(200))
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    request, prompt = processor.process("cut", text, SamplingParams(truncate_prompt_tokens=8), 0.0)
    assert request.prompt_token_ids == [tokenizer.bos_token_id] + ids[-7:]
    assert prompt == tokenizer.decode(request.prompt_token_ids)


def test_no_second_bos_when_the_prompt_already_has_one():
    processor = InputProcessor(_BosTokenizer(), smollm2_config(), MAX_MODEL_LEN)
    with_bos, _ = processor.process("a", "^hi", SamplingParams(), 0.0)
    plain, _ = processor.process("b", "hi", SamplingParams(), 0.0)
    assert with_bos.prompt_token_ids == plain.prompt_token_ids == [1, 10 + ord("h") % 100, 10 + ord("i") % 100]


def test_hybrid_kv_cache_capacity_is_the_engines_not_blocks_times_size(tokenizer):
    """With sliding-window layers every KV cache group takes blocks: the engine reports how many
    tokens one request can hold, and a longer prompt is refused at once, naming it."""
    processor = InputProcessor(tokenizer, smollm2_config(), 4096, num_kv_blocks=100, block_size=16,
                               kv_cache_capacity_tokens=500)
    assert processor.max_prompt_tokens == 500
    processor.process("fits", list(range(100, 600)), SamplingParams(), 0.0)
    with pytest.raises(ValueError, match="holds at most 500 tokens of one request"):
        processor.process("too-long", list(range(100, 601)), SamplingParams(), 0.0)
