"""Structured outputs through `LLM.generate` on the embedded SmolLM2-135M: every finished output
follows its schema, regex or choice; n > 1 children, a max_tokens cut, bad specs, and the ledger's
account of the grammar compilation."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tokenloom import LLM, SamplingParams
from tokenloom.messages import LedgerBucket
from tokenloom.sampling_params import StructuredOutputsParams as SO

sys.path.insert(0, str(Path(__file__).parents[1] / "structured_output"))
from schemas import CHOICES, REGEXES, SCHEMAS, check_json  # noqa: E402


@pytest.fixture(scope="module")
def llm():
    llm = LLM(num_kv_blocks=512, max_num_seqs=64)
    yield llm
    llm.shutdown() if hasattr(llm, "shutdown") else None


def test_every_finished_output_follows_its_schema_regex_or_choice(llm):
    prompts, params, checks = [], [], []
    for i, (prompt, schema) in enumerate(SCHEMAS):
        prompts.append(prompt)
        # Greedy and sampled (seeded) rows in the same batch.
        temp = {"temperature": 0.0} if i % 2 else {"temperature": 0.7, "seed": i}
        params.append(SamplingParams(max_tokens=120, structured_outputs=SO(json=schema), **temp))
        checks.append(lambda text, schema=schema: check_json(text, schema))
    for regex in REGEXES:
        prompts.append("Write it:")
        params.append(SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(regex=regex)))
        checks.append(lambda text, regex=regex: _full_match(regex, text))
    for choice in CHOICES:
        prompts.append("Pick one:")
        params.append(SamplingParams(temperature=0.8, seed=3, max_tokens=10, structured_outputs=SO(choice=choice)))
        checks.append(lambda text, choice=choice: _in(text, choice))
    prompts.append("JSON please:")
    params.append(SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=SO(json_object=True, disable_any_whitespace=True)))
    checks.append(lambda text: _is_object(text))

    outputs = llm.generate(prompts, params, use_tqdm=False)
    finish = [o.outputs[0].finish_reason for o in outputs]
    assert finish.count("stop") >= len(prompts) - 2, finish  # the tiny model may run long on a few
    for out, check in zip(outputs, checks):
        c = out.outputs[0]
        if c.finish_reason == "stop":
            check(c.text)


def _full_match(regex: str, text: str) -> None:
    assert re.fullmatch(regex, text), (regex, text)


def _in(text: str, choice: list[str]) -> None:
    assert text in choice, (text, choice)


def _is_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


def test_unconstrained_requests_in_the_same_batch_are_unaffected(llm):
    free = SamplingParams(temperature=0.0, max_tokens=12)
    alone = llm.generate(["The capital of France is"], free, use_tqdm=False)[0].outputs[0].text
    mixed = llm.generate(["The capital of France is", "A person:"],
                         [free, SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(json=SCHEMAS[0][1]))],
                         use_tqdm=False)
    assert mixed[0].outputs[0].text == alone


def test_n_children_each_follow_the_grammar(llm):
    schema = SCHEMAS[6][1]  # tags
    out = llm.generate(["Tags:"], SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=40,
                                                 structured_outputs=SO(json=schema)), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert c.finish_reason == "stop"
        check_json(c.text, schema)


def test_max_tokens_cut_reports_length(llm):
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 200}}, "required": ["story"]}
    c = llm.generate(["A story:"], SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=SO(json=schema)),
                     use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 8
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.text)


def test_first_request_of_a_new_schema_waits_for_its_grammar_in_the_ledger(llm):
    # A schema whose compile takes tens of milliseconds (300 patterned fields): a one-field schema
    # compiles in about 2 ms, which a busy machine can finish before the core's first step looks.
    fields = {f"ledger_field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]+$"} for i in range(300)}
    schema = {"type": "object", "properties": fields, "required": list(fields)}
    params = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=SO(json=schema))
    first = llm.generate(["Ledger:"], params, use_tqdm=False)[0]
    again = llm.generate(["Ledger:"], params, use_tqdm=False)[0]
    assert first.outputs[0].text == again.outputs[0].text
    assert first.metrics.core.seconds[LedgerBucket.GRAMMAR_COMPILE] > 0
    assert first.metrics.parts["queue_grammar_compile"] > 0
    assert again.metrics.core.seconds[LedgerBucket.GRAMMAR_COMPILE] == 0  # compiled once, cached


@pytest.mark.parametrize(("spec", "message"), [
    (SO(json='{"type": "object", "properties": {"a": {"type": "nonsense"}}}'), "structured_outputs.json is not a valid JSON schema"),
    (SO(json="{not json"), "structured_outputs.json is not valid JSON"),
    (SO(regex="(unclosed"), "structured_outputs.regex is not a valid regular expression"),
    (SO(grammar="root ::= missing_rule"), "structured_outputs.grammar is not a valid grammar"),
])
def test_bad_specs_are_refused_before_queueing(llm, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(["x"], SamplingParams(structured_outputs=spec), use_tqdm=False)
