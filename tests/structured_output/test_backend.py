"""The xgrammar backend and the grammar manager on the real SmolLM2 vocabulary: spec keys, the
door's validation messages, a model vocabulary wider than the tokenizer's, and the cache."""
from __future__ import annotations

import json

import numpy as np
import pytest
import xgrammar as xgr

from tokenloom.model.loader import load_tokenizer
from tokenloom.sampling_params import StructuredOutputsParams as SO
from tokenloom.structured_output import StructuredOutputManager, spec_key, validate
from tokenloom.structured_output.backend import compile_spec, tokenizer_info


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_a_schema_dict_and_its_text_share_a_key_and_keep_their_order():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    assert spec_key(SO(json=schema)) == spec_key(SO(json=json.dumps(schema)))
    assert '"b"' in spec_key(SO(json=schema))[1].split('"a"')[0]  # b stays first: the output's order
    assert spec_key(SO(json=schema)) != spec_key(SO(json=schema, disable_any_whitespace=True))


@pytest.mark.parametrize(("spec", "message"), [
    (SO(json={"type": "object", "properties": {"x": {"type": "frob"}}}), 'structured_outputs.json is not a valid JSON schema: Unsupported type "frob"'),
    (SO(json="[1, 2]"), "structured_outputs.json must be a JSON schema object, got list"),
    (SO(json="{"), "structured_outputs.json is not valid JSON"),
    (SO(regex="[a-"), "structured_outputs.regex is not a valid regular expression"),
    (SO(grammar='root ::= "a" | undefined'), "structured_outputs.grammar is not a valid grammar"),
])
def test_validate_names_the_field_and_quotes_the_compiler(spec, message):
    with pytest.raises(ValueError) as e:
        validate(spec)
    assert str(e.value).startswith(message), str(e.value)
    assert ".cc:" not in str(e.value)  # the compiler's source location is not the user's business


def test_valid_specs_pass(tokenizer):
    for spec in (SO(json={"type": "object"}), SO(regex="[0-9]+"), SO(choice=['a "quoted" one', "b\\c"]),
                 SO(grammar='root ::= "x"+'), SO(json_object=True)):
        validate(spec)


def test_model_vocabulary_wider_than_the_tokenizer(tokenizer):
    """Padded embeddings: ids past the tokenizer exist in the logits but are never allowed."""
    vocab = len(tokenizer) + 64
    compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab, [tokenizer.eos_token_id]), max_threads=1)
    matcher = xgr.GrammarMatcher(compile_spec(compiler, SO(json_object=True)))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask, 0)
    allowed = np.flatnonzero(np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little"))
    assert allowed.size and allowed.max() < len(tokenizer)


def test_choice_with_quotes_and_backslashes_is_exact(tokenizer):
    compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, len(tokenizer), [tokenizer.eos_token_id]), max_threads=1)
    choices = ['a "quoted" one', "b\\c"]
    for text in choices:
        matcher = xgr.GrammarMatcher(compile_spec(compiler, SO(choice=choices)))
        assert matcher.accept_string(text) and matcher.is_completed()
    assert not xgr.GrammarMatcher(compile_spec(compiler, SO(choice=choices))).accept_string("b\\\\c")


def test_manager_compiles_a_spec_once_and_shares_it(tokenizer):
    manager = StructuredOutputManager(tokenizer, len(tokenizer), [tokenizer.eos_token_id], max_num_seqs=4)
    a = manager.request_grammar(SO(json={"type": "object"}))
    b = manager.request_grammar(SO(json='{"type": "object"}'))
    c = manager.request_grammar(SO(regex="[0-9]"))
    assert a.future is b.future and a.future is not c.future
    a.future.result(timeout=60)
    assert a.ready() and b.ready() and a.matcher is not b.matcher  # one matcher per request
    assert a.accept(tokenizer.encode("{", add_special_tokens=False))
    rows = manager.grammar_bitmask([a, b])
    assert rows.shape[0] == 2 and not bool((rows[0] == rows[1]).all())  # each row its own state
    manager.shutdown()
