"""The shipped tool-aware chat templates (entrypoints/chat_templates): each shows the model the
request's tools, renders a past tool call in the format its `--tool-call-parser` reads back, and
is picked by name by `--chat-template` / `LLM.chat(chat_template=...)`; an unknown name is one
line naming the option. Rendered as the server renders (transformers' Jinja sandbox, through the
input processor) with SmolLM2's tokenizer; no model runs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenloom.engine.chat_template import tools_dropped
from tokenloom.engine.processor import InputProcessor
from tokenloom.entrypoints.chat_templates import SHIPPED_TEMPLATES, resolve_chat_template, shipped_template
from tokenloom.entrypoints.openai.tool_parsers import TOOL_PARSERS
from tokenloom.model.config import ModelArchConfig

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
EXCHANGE = ASK + [
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": CALL}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
]


@pytest.fixture(scope="module")
def processor(hf_smollm2_tokenizer):
    config = ModelArchConfig(architecture="llama", num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                             num_attention_heads=1, num_key_value_heads=1, head_dim=64, vocab_size=49152,
                             rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=2048,
                             tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2])
    return InputProcessor(hf_smollm2_tokenizer, config, 2048)


@pytest.mark.parametrize("name", sorted(SHIPPED_TEMPLATES))
def test_shipped_template_shows_the_tools_and_writes_calls_its_parser_reads(processor, name):
    template = resolve_chat_template(name)
    assert template == shipped_template(f"tool_chat_template_{name}.jinja") == shipped_template(f"tool_chat_template_{name}")
    (job,) = processor.chat_render_jobs(ASK, tools=[WEATHER, TIME], chat_template=template)
    prompt = processor.apply_chat_template(ASK, tools=[WEATHER, TIME], chat_template=template)
    assert "get_weather" in prompt and "get_time" in prompt and "Current weather in a city" in prompt
    assert not tools_dropped(job, prompt)
    assert prompt.rstrip().endswith("What is the weather in Paris?" + ("<|im_end|>\n<|im_start|>assistant" if name == "hermes"
                                     else "<|eot_id|><|start_header_id|>assistant<|end_header_id|>"))
    # A past call, rendered into the prompt, reads back as the same call with the template's parser.
    history = processor.apply_chat_template(EXCHANGE[:2], add_generation_prompt=False, tools=[WEATHER],
                                            chat_template=template)
    shown = processor.apply_chat_template(EXCHANGE, tools=[WEATHER], chat_template=template)
    before, _, after = history.rpartition("assistant")
    turn = (after.split("<|im_end|>")[0] if name == "hermes"
            else after.split("<|end_header_id|>", 1)[1].split("<|eot_id|>")[0])
    content, calls = TOOL_PARSERS[SHIPPED_TEMPLATES[name]]().extract(turn.strip())
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(CALL["name"], CALL["arguments"])] and not content
    assert '{"sky": "sunny"}' in shown.replace('\\"', '"')  # the tool's result is shown to the model
    # Without tools, a plain chat in the family's own format.
    plain = processor.apply_chat_template(ASK, chat_template=template)
    assert "get_weather" not in plain and "What is the weather in Paris?" in plain


def test_default_template_drops_tools_and_is_warned_about_once(processor, caplog):
    """SmolLM2's own template never shows `tools`: the check sees it (also when the user names a
    tool), warns once per template, and not for a template that lists them."""
    caplog.set_level("WARNING", logger="tokenloom.engine.processor")
    mention = [{"role": "user", "content": "Use get_weather for Paris."}]
    for messages in (ASK, mention, ASK):
        (job,) = processor.chat_render_jobs(messages, tools=[WEATHER])
        assert tools_dropped(job, processor.apply_chat_template(messages, tools=[WEATHER]))
    warnings = [r.getMessage() for r in caplog.records if "drops the request's tools" in r.getMessage()]
    assert len(warnings) == 1 and "--chat-template" in warnings[0] and "hermes" in warnings[0]
    caplog.clear()
    processor.apply_chat_template(ASK, tools=[WEATHER], chat_template=resolve_chat_template("hermes"))
    processor.apply_chat_template(ASK)  # no tools: nothing to drop
    assert not [r for r in caplog.records if "drops the request's tools" in r.getMessage()]


def test_unknown_template_name_is_one_line_naming_the_option():
    with pytest.raises(ValueError, match=r"--chat-template 'hermess' is neither a file, a shipped chat template "
                                         r"\(hermes, llama3_json\)"):
        resolve_chat_template("hermess")
    # `tokenloom serve` says it before it loads anything.
    tokenloom = Path(sys.executable).with_name("tokenloom")
    run = subprocess.run([str(tokenloom), "serve", "--chat-template", "hermess"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0 and "--chat-template 'hermess' is neither a file" in run.stderr
    assert "Traceback" not in run.stderr
