"""Structured output (executor/structured.py) on the built-in model in float32: JSON objects and schemas (a
seeded generator of schemas written for these tests) that parse and validate, regexes and choices that hold,
grammars that end with finish reason stop, constraints that do not compile refused with the engine serving on,
the compile cache, sampling, speculation and preemption; and the unconstrained requests of a mixed batch token
for token (and logprob for logprob) what they are without their constrained neighbours."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr
from engine_helpers import make_engine, run_all

from loraplane_server.engine.llm_engine import LLMEngine, RequestOutput
from loraplane_server.errors import InvalidParameterError
from loraplane_server.executor.model_runner import first_rows
from loraplane_server.executor.sampler import make_generator
from loraplane_server.executor.structured import (
    GrammarRejectedError,
    Grammars,
    Matchers,
    choice_grammar,
    compile_reason,
    fast_strings,
    unenforced_keyword,
)
from loraplane_server.sampling_params import SamplingParams, StructuredOutput
from loraplane_server.sequence import Sequence

EXAMPLES = Path(__file__).resolve().parents[1] / "server" / "examples" / "adapters"
ADAPTERS: list[str | None] = ["french", "pirate", "json", None]
TOPICS = ["a cat", "a city", "a book", "a car", "a planet", "a recipe", "a song", "a game", "a tree", "a river"]
Request = tuple[str | None, str, SamplingParams]  # adapter, prompt, params


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    """The example adapters registered; no prefix cache, so a prompt computes the same way in every run."""
    engine = make_engine(
        smollm2_dir,
        num_kv_blocks=1024,
        max_model_len=1024,
        max_loras=4,
        enable_prefix_caching=False,
        disk_cache_dir=str(tmp_path_factory.mktemp("dc")),
    )
    for name in ("french", "pirate", "json"):
        engine.adapters.register(name, str(EXAMPLES / name))
    return engine


@pytest.fixture(autouse=True)
def everything_returns(request: pytest.FixtureRequest):
    """After each engine test: no request left, every KV block and every matcher back."""
    if "engine" not in request.fixturenames:
        yield
        return
    engine: LLMEngine = request.getfixturevalue("engine")
    free0 = engine.block_manager.num_free_blocks
    yield
    assert not engine.has_unfinished
    assert engine.block_manager.num_free_blocks == free0
    assert len(engine.runner.matchers) == 0


def chat(engine: LLMEngine, question: str) -> str:
    messages = [{"role": "user", "content": question}]
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def run(engine: LLMEngine, requests: list[Request]) -> list[RequestOutput]:
    """Every request added at once, stepped to the end; outputs in request order, none failed."""
    ids = [engine.add_request(prompt, params, adapter_id=adapter) for adapter, prompt, params in requests]
    done = run_all(engine, timeout_s=1200, check_errors=True)  # a shared 2-core machine under `make test`'s load
    return [done[i] for i in ids]


def schema_params(schema: dict, max_new_tokens: int = 256, **extra: Any) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens, structured=StructuredOutput("json_schema", json.dumps(schema)), **extra
    )


def assert_valid(out: RequestOutput, schema: dict) -> None:
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
    jsonschema.validate(json.loads(out.text), schema)


# a seeded generator of JSON schemas: nested objects, arrays with bounds, enums, bounded numbers and strings,
# required fields; small enough that an output completes in well under 256 tokens
FIELDS = ["name", "city", "score", "tags", "level", "color", "size", "id", "note", "kind", "count", "items", "age"]
ENUM_VALUES: list[Any] = ["red", "green", "blue", "small", "large", "yes", "no", 1, 2, 3, True, None]


def random_scalar(rng: random.Random) -> dict:
    r = rng.random()
    if r < 0.3:
        low = rng.randint(0, 2)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(2, 10)}
    if r < 0.45:
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 1000)}
    if r < 0.6:
        low = rng.choice([-10, 0, 0.5, 1])
        return {"type": "number", "minimum": low, "maximum": low + rng.choice([1, 10, 100.5])}
    if r < 0.7:
        return {"type": "boolean"}
    return {"enum": rng.sample(ENUM_VALUES, rng.randint(2, 4))}


def random_array(rng: random.Random, depth: int) -> dict:
    low = rng.randint(0, 2)
    items = random_object(rng, depth - 1, 2) if depth > 0 and rng.random() < 0.3 else random_scalar(rng)
    return {"type": "array", "items": items, "minItems": low, "maxItems": low + rng.randint(0, 2)}


def random_value(rng: random.Random, depth: int) -> dict:
    r = rng.random()
    if depth > 0 and r < 0.2:
        return random_object(rng, depth, 3)
    if r < 0.4:
        return random_array(rng, depth)
    return random_scalar(rng)


def random_object(rng: random.Random, depth: int, max_fields: int) -> dict:
    names = rng.sample(FIELDS, rng.randint(1, max_fields))
    return {
        "type": "object",
        "properties": {name: random_value(rng, depth - 1) for name in names},
        "required": sorted(rng.sample(names, rng.randint(1, len(names)))),
        "additionalProperties": False,
    }


def random_schema(seed: int) -> dict:
    return random_object(random.Random(seed), 2, 4)


def test_schema_generator_is_seeded_and_varied() -> None:
    assert random_schema(3) == random_schema(3)
    kinds = json.dumps([random_schema(i) for i in range(75)])
    for word in ('"enum"', '"minItems"', '"maximum"', '"maxLength"', '"required"', '"type": "object", "properties"'):
        assert word in kinds
    nested = [s for s in map(random_schema, range(75)) if '"properties"' in json.dumps(s["properties"])]
    assert len(nested) >= 10


# no model
def test_choice_grammar_escapes_every_choice() -> None:
    assert choice_grammar(["a", 'say "hi"', "back\\slash", "new\nline"]) == (
        'root ::= "a" | "say \\"hi\\"" | "back\\\\slash" | "new\\nline"'
    )


def test_unenforced_keywords_are_found_where_they_are_and_property_names_are_not_keywords() -> None:
    assert unenforced_keyword({"properties": {"not": {"type": "string"}, "if": {"type": "integer"}}}) is None
    assert unenforced_keyword({"properties": {"tags": {"type": "array", "uniqueItems": True}}}) == (
        "uniqueItems at #/properties/tags"
    )
    assert unenforced_keyword({"anyOf": [{"type": "string"}, {"not": {}}]}) == "not at #/anyOf/1"
    assert unenforced_keyword({"items": {"type": "number", "multipleOf": 2}}) == "multipleOf at #/items"
    assert unenforced_keyword({"allOf": [{}, {}]}) == "allOf of 2 schemas at #"
    assert unenforced_keyword({"allOf": [{"type": "string"}], "uniqueItems": False}) is None


def test_string_length_bounds_become_a_pattern_of_unescaped_characters() -> None:
    schema = fast_strings(
        {
            "properties": {
                "a": {"type": "string", "minLength": 1, "maxLength": 5},
                "b": {"type": "string", "minLength": 2},
                "c": {"type": "string", "maxLength": 500},  # past MAX_PATTERN_LENGTH: left as it is
                "d": {"type": "string", "maxLength": 3, "format": "email"},
                "e": {"type": "string", "minLength": 5, "maxLength": 2},  # xgrammar's error, not ours
            }
        }
    )
    props = schema["properties"]
    assert props["a"] == {"type": "string", "pattern": '^[^"\\\\\\u0000-\\u001f]{1,5}$'}
    assert props["b"]["pattern"].endswith("{2,}$")
    assert "pattern" not in props["c"] and "pattern" not in props["d"] and "pattern" not in props["e"]
    assert re.fullmatch(props["a"]["pattern"][1:-1], "abcde") and not re.fullmatch(props["a"]["pattern"], "a\tb")


def test_without_xgrammar_a_constraint_is_refused_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, smollm2_dir: Path
) -> None:
    """The GPU check's machine has no xgrammar: the engine runs there, and a constrained request is refused."""
    from transformers import AutoTokenizer

    import loraplane_server.executor.structured as structured

    monkeypatch.setattr(structured, "xgr", None)
    grammars = Grammars(AutoTokenizer.from_pretrained(str(smollm2_dir)), 49152, [0])
    with pytest.raises(InvalidParameterError, match="xgrammar"):
        grammars.compile(StructuredOutput("json_object"))
    assert len(Matchers(49152)) == 0  # the runner's matchers start without it


def test_compile_reason_drops_the_log_prefix() -> None:
    error = RuntimeError("[09:34:27] /project/cpp/regex_converter.cc:83: Regex parsing error at position 3: x\nmore")
    assert compile_reason(error) == "Regex parsing error at position 3: x"
    check = RuntimeError("[09:34:27] /p/json.cc:49: Check failed: (error.empty()) is false: Failed to parse JSON")
    assert compile_reason(check) == "Failed to parse JSON"


TINY_VOCAB = ["<eos>", "a", "b", "1", "2", "ab", "12", '"', "{", "}"]  # id 0 stops


def tiny_grammars(cache_bytes: int = 1 << 30) -> Grammars:
    """Grammars over a 10-token vocabulary (16 logits wide: past the tokenizer), its compiler set directly."""
    grammars = Grammars(None, 16, [0], cache_bytes)
    info = xgr.TokenizerInfo(TINY_VOCAB, vocab_size=16, stop_token_ids=[0])
    grammars._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    return grammars


def test_masks_follow_their_rows_when_a_row_is_set_aside_between_fill_and_mask() -> None:
    grammars = tiny_grammars()
    digits, letters = (grammars.compile(StructuredOutput("regex", r)) for r in (r"\d+", "[ab]+"))
    matchers = Matchers(16)
    seqs = [Sequence(f"r{i}", [1], SamplingParams()) for i in range(3)]
    matchers.start(seqs[0], digits)
    matchers.start(seqs[2], letters)
    assert first_rows(seqs) == [(0, seqs[0]), (1, seqs[1]), (2, seqs[2])]
    fill = matchers.fill(first_rows(seqs))
    logits = torch.zeros(2, 16)  # row 1 (seqs[1]) set aside since: seqs[2] is row 1 now
    matchers.mask(logits, [(0, seqs[0]), (1, seqs[2])], fill)
    allowed = [{TINY_VOCAB[t] for t in range(10) if row[t] == 0} for row in logits]
    assert allowed == [{"1", "2", "12"}, {"a", "b", "ab"}]
    assert (logits[:, 10:] == float("-inf")).all()  # the lm_head's ids past the tokenizer: never allowed
    assert matchers.accept(seqs[2], TINY_VOCAB.index("ab")) is False and matchers.accept(seqs[2], 0) is True
    with pytest.raises(GrammarRejectedError):
        matchers.accept(seqs[0], TINY_VOCAB.index("a"))
    assert matchers.accept(seqs[1], 5) is False  # unconstrained
    for seq in seqs:
        matchers.release(seq)
    assert len(matchers) == 0 and matchers.fill(first_rows(seqs)) is None


def test_the_grammar_cache_is_an_lru_bounded_in_bytes() -> None:
    grammars = tiny_grammars()
    one = grammars.compile(StructuredOutput("regex", "a+"))
    size = one.memory_size_bytes
    grammars = tiny_grammars(cache_bytes=2 * size + size // 2)  # room for two
    a, b = (grammars.compile(StructuredOutput("regex", r)) for r in ("a+", "b+"))
    assert grammars.compile(StructuredOutput("regex", "a+")) is a  # a used last: b goes first
    grammars.compile(StructuredOutput("regex", "1+"))
    assert grammars.num_cached == 2 and (grammars.hits, grammars.misses) == (1, 3)
    assert grammars.compile(StructuredOutput("regex", "a+")) is a
    assert grammars.compile(StructuredOutput("regex", "b+")) is not b


# the engine
def test_json_object_and_a_schema_parse_and_validate(engine: LLMEngine) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    json_object = SamplingParams(max_new_tokens=120, structured=StructuredOutput("json_object"))
    outs = run(
        engine,
        [
            ("json", chat(engine, "What is the capital of Italy?"), json_object),
            ("json", chat(engine, "What is 9 plus 6?"), json_object),
            (None, chat(engine, "Describe a person as JSON."), schema_params(schema)),
            ("pirate", chat(engine, "Describe a person as JSON."), schema_params(schema)),
        ],
    )
    for out in outs[:2]:
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text
    for out in outs[2:]:
        assert_valid(out, schema)
    assert "answer" in json.loads(outs[0].text)  # the json adapter's own shape, within any object


@pytest.mark.isa_agnostic
def test_300_generated_schemas_in_a_mixed_batch_leave_the_unconstrained_requests_unchanged(
    engine: LLMEngine,
) -> None:
    """75 seeded schemas x (3 adapters + the base model), in one continuous batch with 48 unconstrained requests
    (greedy; a third with logprobs): every constrained output validates, every unconstrained one is token for
    token what it is when the batch holds it alone."""
    rng = random.Random(0)
    free: list[Request] = []
    for i in range(48):
        prompt = chat(engine, f"Tell me something about {TOPICS[i % len(TOPICS)]}, number {i}.")
        params = SamplingParams(max_new_tokens=rng.randint(12, 32), logprobs=i % 3 == 0)
        free.append((ADAPTERS[i % 4], prompt, params))
    schemas = [random_schema(seed) for seed in range(75)]
    constrained: list[Request] = []
    for i, schema in enumerate(schemas):
        for adapter in ADAPTERS:
            prompt = chat(engine, f"Describe {TOPICS[(i + len(constrained)) % len(TOPICS)]} as JSON.")
            constrained.append((adapter, prompt, schema_params(schema)))
    grammars = engine.grammars
    assert grammars is not None
    alone = run(engine, free)
    hits, misses = grammars.hits, grammars.misses
    mixed = list(constrained)
    for j, request in enumerate(free):  # spread through the batch
        mixed.insert(7 * j, request)
    outs = run(engine, mixed)
    by_request = dict(zip(map(id, mixed), outs, strict=True))
    for request, before in zip(free, alone, strict=True):
        after = by_request[id(request)]
        assert after.token_ids == before.token_ids
        # a batch of another size sums in another order (the forward is not batch-invariant in its last bits);
        # a row's own sampling is untouched by its neighbours' masks bit for bit (the runner's test below)
        assert after.logprobs == pytest.approx(before.logprobs, rel=1e-4, abs=1e-4)
    for i, request in enumerate(constrained):
        assert_valid(by_request[id(request)], schemas[i // 4])
    # each schema compiled once (at most: an earlier test may have compiled it)
    assert grammars.hits + grammars.misses - hits - misses == 300 and grammars.misses - misses <= 75


def test_masks_leave_the_unconstrained_rows_of_a_step_bit_for_bit(engine: LLMEngine) -> None:
    """One step's sampling (greedy, seeded and unseeded sampled rows, logprobs) with and without constrained rows
    beside them: the other rows' tokens and logprobs are the same bits; the constrained rows' tokens follow the
    grammar."""
    grammars = engine.grammars
    assert grammars is not None
    grammar = grammars.compile(StructuredOutput("regex", r"\d{3}"))
    params = [
        SamplingParams(logprobs=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, logprobs=True),
        SamplingParams(temperature=1.0, top_k=50, logprobs=True),
        SamplingParams(repetition_penalty=1.2, logprobs=True),
    ]

    constrained_rows = {1, 3, 4, 6}

    def sample(constrained: bool) -> tuple[list[int], list[float]]:
        seqs = [Sequence(f"r{i}", [1, 2, 3], params[i % 4]) for i in range(8)]
        for i, seq in enumerate(seqs):
            seq.generator = make_generator(seq.params.seed, engine.device)
            if constrained and i in constrained_rows:
                engine.runner.matchers.start(seq, grammar)
        logits = torch.randn(8, grammars.vocab_size, generator=torch.Generator().manual_seed(0)) * 4
        torch.manual_seed(1)  # the unseeded rows' noise
        fill = engine.runner.matchers.fill(enumerate(seqs))
        _, tokens, logprobs = engine.runner._sample(logits, seqs, fill)
        for seq in seqs:
            engine.runner.matchers.release(seq)
        return [t[0] for t in tokens], [lp[0] for lp in logprobs]

    free, free_lps = sample(False)
    mixed, mixed_lps = sample(True)
    for i in range(8):
        if i in constrained_rows:
            assert engine.decode([mixed[i]]).isdigit() and mixed[i] != free[i]
        else:
            assert (mixed[i], mixed_lps[i]) == (free[i], free_lps[i])


def random_regex(rng: random.Random) -> str:
    """A pattern of bounded pieces (every output completes in a few tokens)."""
    pieces = [
        r"\d{3}-\d{4}",
        r"[A-Z][a-z]{2,6}",
        r"(yes|no|maybe)",
        r"[a-z]{3,8}@[a-z]{3,6}\.(com|org|net)",
        r"\d{4}-\d{2}-\d{2}",
        r"#[0-9a-f]{6}",
        r"(red|green|blue) (car|house)",
        r"[1-9]\d{0,2}(\.\d{1,2})?",
        r"v\d\.\d{1,2}",
    ]
    return " ".join(rng.sample(pieces, rng.randint(1, 2)))


CHOICE_WORDS = ["Paris", "London", "Rome", "yes", "no", 'say "hi"', "Zürich", "a\nb", "42", "{json}", "x y z", "--"]


def test_regex_and_choice_hold_on_100_seeded_cases_each(engine: LLMEngine) -> None:
    rng = random.Random(1)
    cases: list[tuple[str, StructuredOutput]] = []
    for _ in range(100):
        cases.append(("regex", StructuredOutput("regex", random_regex(rng))))
        cases.append(("choice", StructuredOutput("choice", choices=tuple(rng.sample(CHOICE_WORDS, rng.randint(2, 5))))))
    questions = ["Give me an answer.", "What is your favourite thing?", "Write a value.", "Pick one."]
    for start in range(0, len(cases), 50):  # a few per batch, alongside free text
        batch = cases[start : start + 50]
        requests: list[Request] = [
            (ADAPTERS[i % 4], chat(engine, questions[i % 4]), SamplingParams(max_new_tokens=48, structured=s))
            for i, (_, s) in enumerate(batch)
        ]
        requests.append((None, chat(engine, "Tell me a story."), SamplingParams(max_new_tokens=16)))
        outs = run(engine, requests)
        for (kind, structured), out in zip(batch, outs[:-1], strict=True):
            assert out.finish_reason == "stop", (structured, out.text)
            if kind == "regex":
                assert re.fullmatch(structured.spec, out.text), (structured.spec, out.text)
            else:
                assert out.text in structured.choices, (structured.choices, out.text)


@pytest.mark.parametrize(
    ("structured", "message"),
    [
        (StructuredOutput("json_schema", '{"type": "object",'), "json_schema is not valid JSON"),
        (StructuredOutput("json_schema", "[1, 2]"), "json_schema must be a JSON object, not list"),
        (StructuredOutput("json_schema", '{"type": "strin"}'), 'does not compile: Unsupported type "strin"'),
        (StructuredOutput("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'), "minimum greater"),
        (StructuredOutput("json_schema", '{"$ref": "#/$defs/nope"}'), "does not compile"),
        (
            StructuredOutput("json_schema", '{"properties": {"tags": {"uniqueItems": true}}}'),
            "not supported: uniqueItems at #/properties/tags",
        ),
        (
            StructuredOutput("regex", "(ab"),
            "regex does not compile: Regex parsing error at position 4: The parenthesis is not closed",
        ),
        (StructuredOutput("grammar", 'root ::= "a" | foo'), "grammar does not compile: EBNF parser error at line 1"),
        (StructuredOutput("grammar", 'start ::= "a"'), 'The root rule with name "root" is not found'),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_and_the_engine_serves_on(
    engine: LLMEngine, structured: StructuredOutput, message: str
) -> None:
    with pytest.raises(InvalidParameterError, match=re.escape(message)) as caught:
        engine.add_request(chat(engine, "Hi"), SamplingParams(max_new_tokens=8, structured=structured))
    assert caught.value.param == "structured"
    assert not engine.requests and not engine.has_unfinished and len(engine.runner.matchers) == 0
    out = engine.generate([chat(engine, "Hi")], SamplingParams(max_new_tokens=4))[0]
    assert out.error is None and len(out.token_ids) == 4


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_grammar_that_completes_ends_the_sequence_with_stop(engine: LLMEngine, ignore_eos: bool) -> None:
    grammar = StructuredOutput("grammar", 'root ::= "yes" | "no" | "maybe " [a-z]{1,4}')
    params = SamplingParams(max_new_tokens=50, structured=grammar, ignore_eos=ignore_eos)
    out = engine.generate([chat(engine, "Is the sky blue?")], params)[0]
    assert out.finish_reason == "stop"
    assert re.fullmatch("yes|no|maybe [a-z]{1,4}", out.text), out.text
    assert out.token_ids[-1] in engine.eos_token_ids  # the grammar's stop ends it, whatever ignore_eos says
    assert len(out.token_ids) < 10


def test_sampling_stays_valid_and_is_reproducible(engine: LLMEngine) -> None:
    schemas = [random_schema(1000 + i) for i in range(12)]
    requests: list[Request] = [
        (
            ADAPTERS[i % 4],
            chat(engine, f"Describe {TOPICS[i % len(TOPICS)]} as JSON."),
            schema_params(s, temperature=1.0, top_p=0.95, top_k=100, seed=i, repetition_penalty=1.1),
        )
        for i, s in enumerate(schemas)
    ]
    first = run(engine, requests)
    for out, schema in zip(first, schemas, strict=True):
        assert_valid(out, schema)
    again = run(engine, requests[::-1])[::-1]  # another batch order: each request's own generator
    assert [o.token_ids for o in again] == [o.token_ids for o in first]


def test_the_compile_cache_is_hit_for_a_repeated_schema(engine: LLMEngine) -> None:
    grammars = engine.grammars
    assert grammars is not None
    text = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    params = SamplingParams(max_new_tokens=30, structured=StructuredOutput("json_schema", text))
    first = engine.inputs.check_structured(StructuredOutput("json_schema", text))
    hits, misses = grammars.hits, grammars.misses
    outs = engine.generate([chat(engine, "A number as JSON.")] * 3, params)
    assert (grammars.hits, grammars.misses) == (hits + 3, misses)
    assert engine.inputs.check_structured(StructuredOutput("json_schema", text)) is first
    assert all(o.finish_reason == "stop" and isinstance(json.loads(o.text)["n"], int) for o in outs)


def test_constrained_requests_do_not_speculate_and_unconstrained_ones_beside_them_do(engine: LLMEngine) -> None:
    """Prompt lookup on for every request: the constrained ones get no proposals (their output is what it is
    without speculation), the unconstrained one verifies its proposals in the same steps."""
    schema = random_schema(7)
    prompt = chat(engine, "Repeat: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.")
    plain = [(a, chat(engine, "Describe a cat as JSON."), schema_params(schema)) for a in ADAPTERS]
    spec = [(a, p, schema_params(schema, speculative="ngram")) for a, p, _ in plain]
    free = (None, prompt, SamplingParams(max_new_tokens=24, speculative="ngram"))
    reference = run(engine, [*plain, (None, prompt, SamplingParams(max_new_tokens=24))])
    accepted = engine.speculator.accepted_total
    outs = run(engine, [*spec, free])
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert all(o.num_spec_proposed == 0 for o in outs[:4])
    assert outs[4].num_spec_proposed > 0 and engine.speculator.accepted_total > accepted
    for out in outs[:4]:
        assert_valid(out, schema)


def test_preemption_by_recompute_keeps_each_matcher_where_its_output_is(engine: LLMEngine, smollm2_dir: Path) -> None:
    """A KV cache too small for the batch: sequences are preempted and recomputed, their matchers accept
    each token once (no token refused), and the outputs are those of the roomy engine."""
    small = make_engine(smollm2_dir, num_kv_blocks=24, max_model_len=384, enable_prefix_caching=False)
    schemas = [random_schema(2000 + i) for i in range(12)]
    requests: list[Request] = [
        (None, chat(engine, f"Describe {TOPICS[i % len(TOPICS)]} as JSON."), schema_params(s, max_new_tokens=160))
        for i, s in enumerate(schemas)
    ]
    ids = [small.add_request(p, params) for _, p, params in requests]
    preempted: set[str] = set()
    done: dict[str, RequestOutput] = {}
    while small.has_unfinished:
        done.update((o.request_id, o) for o in small.step() if o.finished)
        preempted |= {rid for rid, seq in small.requests.items() if seq.num_preemptions}
    assert preempted
    reference = run(engine, requests)
    for rid, ref, schema in zip(ids, reference, schemas, strict=True):
        assert done[rid].error is None and done[rid].token_ids == ref.token_ids
        assert_valid(done[rid], schema)
    assert len(small.runner.matchers) == 0


def test_greedy_constrained_tokens_are_the_best_the_grammar_allows(engine: LLMEngine, smollm2_dir: Path) -> None:
    """Each token of a greedy constrained output is the argmax of transformers' logits over the tokens the
    grammar allows there: the mask is the row's own and removes nothing the grammar allows."""
    from transformers import AutoModelForCausalLM

    grammars = engine.grammars
    assert grammars is not None
    constraints = [
        StructuredOutput("json_schema", json.dumps(random_schema(5))),
        StructuredOutput("regex", r"[A-Z][a-z]{2,6} \d{2}"),
        StructuredOutput("choice", choices=("Paris", "London", "Rome")),
        StructuredOutput("grammar", 'root ::= "The answer is " ("yes" | "no") "."'),
    ]
    prompts = [chat(engine, q) for q in ("Describe a cat as JSON.", "Name and age?", "Capital of France?", "Sky?")]
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=120, structured=s) for s in constraints])
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    bitmask = xgr.allocate_token_bitmask(1, grammars.vocab_size)
    for structured, out in zip(constraints, outs, strict=True):
        assert out.finish_reason == "stop"
        ids = out.prompt_token_ids + out.token_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, len(out.prompt_token_ids) - 1 : -1]  # [N, V]
        matcher = xgr.GrammarMatcher(grammars.compile(structured))
        for row, token in zip(logits, out.token_ids, strict=True):
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(row[None], bitmask, vocab_size=grammars.vocab_size)
            assert row[token] >= row.max() - 1e-3, (structured.kind, token, int(row.argmax()))
            assert matcher.accept_token(token)
        assert matcher.is_terminated()
