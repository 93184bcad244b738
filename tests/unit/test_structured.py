"""Structured outputs (``shared/structured.py``, ``shared/engine/grammar.py``): every output of a tiny random model
parses and validates against its JSON schema, matches its regex or is one of its choices, greedy and sampled;
speculative decoding (drafts checked against the grammar) and a prefill -> decode hand-off (the matcher rebuilt
from the delivered tokens) give the plain engine's output; bad specs are refused with the problem named."""
from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.speculator import SpecConfig, Speculator
from shared.errors import DeepinferError
from shared.sampling import SamplingParams
from shared.spec.types import Proposal, TokenFeatures
from tests.model_factory import write_tiny_hf_folder

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
SPECS = [{"type": "json_schema", "schema": SCHEMA}, {"type": "json_object"},
         {"type": "regex", "pattern": r"[a-c]{2,4}-[0-9]{1,3}"}, {"type": "choice", "choices": ["yes", "no", "maybe"]},
         {"type": "grammar", "grammar": 'root ::= "(" [0-9] ("+" [0-9])? ")"'}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=11, max_position_embeddings=1024)


def engine(folder, spec=None):
    eng = LLMEngine.from_path(str(folder), EngineConfig(dtype="float64", block_size=8, num_kv_blocks=256,
                                                        max_num_batched_tokens=64))
    eng.set_speculator(spec)
    return eng


def valid(spec: dict, text: str) -> bool:
    kind = spec["type"]
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), spec["schema"])
        return True
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(spec["pattern"], text) is not None
    if kind == "choice":
        return text in spec["choices"]
    return re.fullmatch(r"\([0-9](\+[0-9])?\)", text) is not None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_matches_its_spec(folder, temperature):
    eng = engine(folder)
    prompts = [eng.tokenizer.encode(p) for p in ("hello there", "a b c d e f", "json please:")]
    for spec in SPECS:
        params = SamplingParams(max_tokens=200, temperature=temperature, seed=3, structured=spec)
        for out in eng.generate(prompts, params):
            assert out[-1] in eng.eos_token_ids, (spec, eng.tokenizer.decode(out))   # the grammar ended it
            assert valid(spec, eng.tokenizer.decode(out)), (spec, eng.tokenizer.decode(out))


class Drafter:
    """Drafts the expected continuation, one wrong token in three (some the grammar refuses)."""
    name = "oracle"

    def __init__(self, prompt, expected):
        self.prompt, self.expected, self.calls = prompt, expected, 0

    def propose(self, sequences, k):
        out = []
        for seq in sequences:
            done = len(seq.token_ids) - len(self.prompt)
            self.calls += 1
            draft = [t if (i + self.calls) % 3 else (t + 7) % 200 for i, t in enumerate(self.expected[done:done + k])]
            out.append(Proposal(draft, [TokenFeatures(position=i) for i in range(len(draft))]))
        return out


def test_speculative_decoding_and_a_hand_off_give_the_plain_output(folder):
    plain = engine(folder)
    prompt = plain.tokenizer.encode("hello there")
    params = SamplingParams(max_tokens=120, temperature=0, structured=SPECS[0])
    expected = plain.generate([prompt], params)[0]
    spec = Speculator(Drafter(prompt, expected), SpecConfig(k=4))
    assert engine(folder, spec).generate([prompt], params)[0] == expected
    assert spec.counters.accepted > 0 and spec.counters.drafted > spec.counters.accepted

    pre, dec = engine(folder), engine(folder)
    rid = pre.add_request(prompt, dataclasses.replace(params, prefill_only=True), hold_kv=True)
    first = [t for _ in iter(pre.has_unfinished, False) for out in pre.step() for t in out.new_token_ids]
    assert dec.kv_port.import_prefilled("x", prompt, first[0], params, pre.kv_port.export_kv(rid),
                                        model_fingerprint=pre.fingerprint)
    got = [first[0]] + [t for _ in iter(dec.has_unfinished, False) for out in dec.step() for t in out.new_token_ids]
    assert got == expected


@pytest.mark.parametrize("spec, named", [
    ({"type": "json_schema", "schema": {"type": "objekt"}}, "objekt"), ({"type": "regex", "pattern": "a(b"}, "regex"),
    ({"type": "choice", "choices": []}, "choices"), ({"type": "grammar", "grammar": "start: 'a' |"}, "grammar"),
    ({"type": "xml"}, "type"), ({"type": "json_schema", "schema": "x"}, "schema")])
def test_bad_specs_are_refused_naming_the_problem(spec, named):
    with pytest.raises(DeepinferError) as err:
        SamplingParams(structured=spec)
    assert named in err.value.message and err.value.http_status == 400


def test_properties_come_out_in_the_schemas_order(folder):
    eng = engine(folder)
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    out = eng.generate([eng.tokenizer.encode("x")], SamplingParams(max_tokens=40, temperature=0, structured={
        "type": "json_schema", "schema": schema}))[0]
    assert list(json.loads(eng.tokenizer.decode(out))) == ["zeta", "alpha"]
