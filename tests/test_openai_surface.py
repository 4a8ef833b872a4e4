"""No request field is silently dropped (issue 38, item 4), and structured output requests in every API's shape
reach the engine as its one type (item 2).

Every field of the real openai package's request types (CompletionCreateParams for /v1/completions and
chat.CompletionCreateParams for /v1/chat/completions, Streaming and NonStreaming, base classes included) and of
vLLM 0.32.0's request models is sent with a non-default value; the answer is either 200 with the field honoured
(checked on what the engine was handed: its SamplingParams and prompt ids) or a no-op the table below declares
(pure metadata), or a 400 / 422 whose message and `param` name the field. Never 200 with the field dropped.

Checked in process on the real app with an engine that records what it is handed (test_http_support's
`recording_app`) and a Llama-3-style tokenizer (test_bos: it adds a BOS, so add_special_tokens shows). The few
tests that need the engine's constraint end to end run a real server once loraplane_server.executor.structured
exists (pytest.importorskip).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import lorax
import lorax.types
import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import pytest
from test_bos import save_llama3_tokenizer
from test_http_support import Recorded, RecordingApp, ServerProcess, recording_app
from transformers import AutoTokenizer

from loraplane_server.sampling_params import StructuredOutput
from loraplane_server.serving.http.lorax import LoraxParameters
from loraplane_server.serving.http.openai_protocol import ChatCompletionRequest, CompletionRequest

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HONOURED, NOOP, REFUSED = "honoured", "no-op", "refused"
PROMPT = "hello world the capital of France is"
MESSAGES = [{"role": "user", "content": "hello world"}]
BASE = {
    COMPLETIONS: {"model": "base", "prompt": PROMPT, "max_tokens": 2, "temperature": 0},
    CHAT: {"model": "base", "messages": MESSAGES, "max_tokens": 2, "temperature": 0},
}
REQUIRED = {"model", "prompt", "messages"}  # every request has them: the base request checks them

# vLLM 0.32.0's request fields, read from its CompletionRequest (vllm/entrypoints/openai/completion/protocol.py)
# and ChatCompletionRequest (vllm/entrypoints/openai/chat_completion/protocol.py) in the vLLM the e2e tests
# install (~/.cache/loraplane-e2e/vllm/0.32.0/venv); test_the_vllm_lists_match_its_source rereads them there
VLLM_COMPLETION = (
    "model prompt echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop stream "
    "stream_options suffix temperature top_p user use_beam_search top_k min_p repetition_penalty watermarking "
    "length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens "
    "spaces_between_special_tokens truncate_prompt_tokens truncation_side allowed_token_ids prompt_logprobs "
    "logprob_token_ids bad_words prompt_embeds add_special_tokens response_format structured_outputs priority "
    "request_id session_id return_tokens_as_token_ids return_token_ids routed_experts_prompt_start "
    "return_token_offsets mm_payload return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs "
    "repetition_detection thinking_token_budget stream_interval"
).split()
VLLM_CHAT = (
    "messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n "
    "presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice "
    "reasoning_effort thinking_token_budget include_reasoning parallel_tool_calls user use_beam_search top_k min_p "
    "repetition_penalty watermarking length_penalty stop_token_ids include_stop_str_in_output ignore_eos "
    "min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens truncation_side "
    "prompt_logprobs logprob_token_ids allowed_token_ids bad_words echo add_generation_prompt "
    "continue_final_message add_special_tokens documents chat_template chat_template_kwargs media_io_kwargs "
    "mm_processor_kwargs structured_outputs priority request_id session_id return_tokens_as_token_ids "
    "return_token_ids routed_experts_prompt_start return_token_offsets return_prompt_text mm_payload "
    "return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs repetition_detection "
    "stream_interval"
).split()
# removed from vLLM (0.32 drops them with a log line), still sent by older clients: honoured here
GUIDED = "guided_json guided_regex guided_choice guided_grammar guided_decoding_backend guided_whitespace_pattern"
EXTENSIONS = ["speculative", *GUIDED.split()]  # ours, and the guided_* fields
VLLM_SOURCE = Path.home() / ".cache/loraplane-e2e/vllm/0.32.0/venv/lib/python3.11/site-packages/vllm/entrypoints/openai"


def typed_dict_fields(*types: type) -> set[str]:
    """Every key of TypedDicts, their base classes' included."""
    return {name for t in types for cls in t.__mro__ for name in getattr(cls, "__annotations__", {})}


OPENAI_FIELDS = {
    COMPLETIONS: typed_dict_fields(
        completion_params.CompletionCreateParamsStreaming, completion_params.CompletionCreateParamsNonStreaming
    ),
    CHAT: typed_dict_fields(
        chat_params.CompletionCreateParamsStreaming, chat_params.CompletionCreateParamsNonStreaming
    ),
}
VLLM_FIELDS = {COMPLETIONS: VLLM_COMPLETION, CHAT: VLLM_CHAT}


def request_fields(route: str) -> list[str]:
    return sorted((OPENAI_FIELDS[route] | set(VLLM_FIELDS[route]) | set(EXTENSIONS)) - REQUIRED)


# what a request became
@dataclass
class Outcome:
    response: httpx.Response
    recorded: list[Recorded]
    app: RecordingApp

    @property
    def params(self) -> Any:
        return self.recorded[0].params

    @property
    def prompt(self) -> list[int]:
        return self.recorded[0].prompt_ids

    @property
    def body(self) -> Any:
        return self.response.json()

    def events(self) -> list[Any]:
        lines = self.response.text.splitlines()
        return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]

    def token(self, text: str) -> int:
        return int(self.app.engine.tokenizer.convert_tokens_to_ids(text))


Check = Callable[[Outcome, Outcome], bool]  # (this request's outcome, the base request's)


@dataclass(frozen=True)
class Case:
    """A non-default value for a field, what the server does with it, and how honouring it shows."""

    value: Any
    verdict: str
    check: Check | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other fields the value needs (stream for stream_options)


def refused(value: Any) -> Case:
    return Case(value, REFUSED)


def noop(value: Any) -> Case:
    return Case(value, NOOP)


def honoured(value: Any, check: Check, **extra: Any) -> Case:
    return Case(value, HONOURED, check, extra)


def structured(kind: str, spec: str = "", choices: tuple[str, ...] = ()) -> Check:
    return lambda o, b: o.params.structured == StructuredOutput(kind, spec, choices) and b.params.structured is None


SHARED: dict[str, Case] = {
    # OpenAI
    "frequency_penalty": honoured(0.5, lambda o, b: o.params.frequency_penalty == 0.5 and not o.params.speculates),
    "presence_penalty": honoured(-0.5, lambda o, b: o.params.presence_penalty == -0.5),
    "logit_bias": honoured({"5": 1.0, "7": -100}, lambda o, b: o.params.logit_bias == {5: 1.0, 7: -100.0}),
    "max_tokens": honoured(3, lambda o, b: o.params.max_new_tokens == 3),
    "n": honoured(2, lambda o, b: len(o.recorded) == 2 and len(o.body["choices"]) == 2),
    "seed": honoured(7, lambda o, b: o.params.seed == 7 and b.params.seed is None),
    "stop": honoured(["x"], lambda o, b: o.params.stop == ["x"]),
    "stream": honoured(True, lambda o, b: o.response.headers["content-type"].startswith("text/event-stream")),
    "stream_options": honoured(
        {"include_usage": True}, lambda o, b: o.events()[-1]["usage"]["completion_tokens"] == 1, stream=True
    ),
    "temperature": honoured(0.5, lambda o, b: o.params.temperature == 0.5 and b.params.temperature == 0),
    "top_p": honoured(0.5, lambda o, b: o.params.top_p == 0.5),
    "user": noop("someone"),
    "response_format": honoured({"type": "json_object"}, structured("json_object")),
    # vLLM
    "use_beam_search": refused(True),
    "top_k": honoured(5, lambda o, b: o.params.top_k == 5),
    "min_p": honoured(0.1, lambda o, b: o.params.min_p == 0.1 and b.params.min_p == 0.0),
    "repetition_penalty": honoured(1.2, lambda o, b: o.params.repetition_penalty == 1.2),
    "watermarking": refused(True),
    "length_penalty": refused(0.5),
    "stop_token_ids": honoured([7], lambda o, b: o.params.stop_token_ids == [7] and b.params.stop_token_ids == []),
    "include_stop_str_in_output": refused(True),
    "ignore_eos": honoured(True, lambda o, b: o.params.ignore_eos and not b.params.ignore_eos),
    "min_tokens": refused(2),
    "skip_special_tokens": refused(False),
    "spaces_between_special_tokens": refused(False),
    "truncate_prompt_tokens": honoured(2, lambda o, b: o.prompt == b.prompt[-2:], truncation_side="left"),
    "truncation_side": honoured("right", lambda o, b: o.prompt == b.prompt[:2], truncate_prompt_tokens=2),
    "allowed_token_ids": refused([1]),
    "prompt_logprobs": honoured(1, lambda o, b: o.params.prompt_logprobs == 1 and b.params.prompt_logprobs is None),
    "logprob_token_ids": refused([1]),
    "bad_words": refused(["x"]),
    "structured_outputs": honoured({"regex": "a+"}, structured("regex", "a+")),
    "priority": refused(1),
    "request_id": honoured("my-request-1", lambda o, b: o.body["id"].endswith("-my-request-1")),
    "session_id": noop("session-1"),
    "return_tokens_as_token_ids": refused(True),
    "return_token_ids": refused(True),
    "routed_experts_prompt_start": refused(1),
    "return_token_offsets": refused(True),
    "mm_payload": refused("none"),
    "return_mm_kwargs": refused(False),
    "cache_salt": refused("salt"),
    "kv_transfer_params": refused({"a": 1}),
    "ec_transfer_params": refused({"a": 1}),
    "vllm_xargs": refused({"a": 1}),
    "repetition_detection": refused({"max_pattern_size": 2}),
    "thinking_token_budget": refused(10),
    "stream_interval": refused(4),
    # guided_*
    "guided_json": honoured({"type": "object"}, structured("json_schema", '{"type": "object"}')),
    "guided_regex": honoured("a+", structured("regex", "a+")),
    "guided_choice": honoured(["yes", "no"], structured("choice", choices=("yes", "no"))),
    "guided_grammar": honoured('root ::= "a"', structured("grammar", 'root ::= "a"')),
    "guided_decoding_backend": refused("outlines"),
    "guided_whitespace_pattern": refused(" "),
    # ours
    "speculative": honoured("ngram", lambda o, b: o.params.speculative == "ngram" and b.params.speculative is None),
}
CASES: dict[str, dict[str, Case]] = {
    COMPLETIONS: {
        **SHARED,
        "echo": honoured(True, lambda o, b: o.body["choices"][0]["text"] == PROMPT + b.body["choices"][0]["text"]),
        # (echo with logprobs asks the engine for the prompt's logprobs: tests/test_openai_surface.py's end to end)
        "logprobs": honoured(
            2,
            lambda o, b: (
                o.params.logprobs
                and o.params.top_logprobs == 2
                and o.body["choices"][0]["logprobs"]["token_logprobs"] == [-0.5]
                and list(o.body["choices"][0]["logprobs"]["top_logprobs"][0].values()) == [-0.5, -0.5 - 0.693]
            ),
        ),
        "suffix": refused("!"),
        "best_of": refused(2),
        "prompt_embeds": refused("AAAA"),
        # the Llama-3-style tokenizer adds a BOS; false leaves it out
        "add_special_tokens": honoured(
            False, lambda o, b: b.prompt[0] == o.token("<|begin_of_text|>") and o.prompt == b.prompt[1:]
        ),
    },
    CHAT: {
        **SHARED,
        "max_completion_tokens": honoured(3, lambda o, b: o.params.max_new_tokens == 3),
        "logprobs": honoured(
            True, lambda o, b: o.params.logprobs and o.body["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.5
        ),
        "top_logprobs": honoured(
            2,
            lambda o, b: (
                o.params.top_logprobs == 2
                and [t["logprob"] for t in o.body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]]
                == [-0.5, -0.5 - 0.693]
            ),
            logprobs=True,
        ),
        # tools reach the prompt (in the template, or a system message for a template that reads none); auto
        # leaves the output free (tests/test_tools.py has the calls end to end)
        "tools": honoured(
            [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            lambda o, b: len(o.prompt) > len(b.prompt) + 10 and o.params.structured is None,
        ),
        "tool_choice": refused("auto"),  # without tools: a 400 naming it
        "parallel_tool_calls": noop(False),  # without tools: nothing to call in parallel
        "functions": refused([{"name": "f"}]),
        "function_call": refused("auto"),
        "metadata": noop({"k": "v"}),
        "store": refused(True),
        "safety_identifier": noop("user-1"),
        "prompt_cache_key": noop("key-1"),
        "prompt_cache_options": refused({"ttl": "1h"}),
        "prompt_cache_retention": refused("24h"),
        "service_tier": refused("flex"),
        "modalities": refused(["text", "audio"]),
        "audio": refused({"voice": "alloy", "format": "wav"}),
        "prediction": refused({"type": "content", "content": "x"}),
        "web_search_options": refused({}),
        "reasoning_effort": refused("low"),
        "verbosity": refused("low"),
        "moderation": refused({"model": "omni-moderation-latest"}),
        "add_generation_prompt": honoured(
            False, lambda o, b: len(o.prompt) < len(b.prompt) and b.prompt[: len(o.prompt)] == o.prompt
        ),  # fmt: skip
        "continue_final_message": honoured(
            True,
            lambda o, b: o.prompt[-1] == o.token("hello") and o.prompt[-2] == o.token("<|end_header_id|>"),
            add_generation_prompt=False,
            messages=[*MESSAGES, {"role": "assistant", "content": "hello"}],
        ),
        "add_special_tokens": honoured(True, lambda o, b: o.prompt == [b.prompt[0], *b.prompt]),
        "chat_template_kwargs": honoured(
            {"system_hint": "hello"},
            lambda o, b: len(o.prompt) > len(b.prompt) and o.prompt[-len(b.prompt) + 1 :] == b.prompt[1:],  # fmt: skip
        ),
        "echo": refused(True),
        "documents": refused([{"title": "t", "text": "x"}]),
        "chat_template": refused("{{ messages }}"),
        "media_io_kwargs": refused({"image": {}}),
        "mm_processor_kwargs": refused({"x": 1}),
        "include_reasoning": refused(False),
        "return_prompt_text": refused(True),
    },
}
UNKNOWN = Case("surface-test", REFUSED)  # a field the table does not know: the server must refuse it by name


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> RecordingApp:
    model_dir = save_llama3_tokenizer(tmp_path_factory.mktemp("surface") / "llama3")
    return recording_app(AutoTokenizer.from_pretrained(str(model_dir)), model_dir)


def send(app: RecordingApp, route: str, **fields: Any) -> Outcome:
    before = len(app.engine.recorded)
    response = app.client.post(route, json={**BASE[route], **fields})
    return Outcome(response, app.engine.recorded[before:], app)


def assert_refused(outcome: Outcome, name: str) -> None:
    r = outcome.response
    assert r.status_code in (400, 422), (name, r.status_code, r.text)
    error = r.json()["error"]
    assert name in error["message"] and str(error["param"]).startswith(name), (name, r.text)
    assert not outcome.recorded  # nothing reached the engine


@pytest.mark.parametrize(("route", "name"), [(r, f) for r in (COMPLETIONS, CHAT) for f in request_fields(r)])
def test_every_field_is_honoured_or_refused_by_name(app: RecordingApp, route: str, name: str) -> None:
    case = CASES[route].get(name, UNKNOWN)
    base = send(app, route)
    assert base.response.status_code == 200, base.response.text
    outcome = send(app, route, **case.extra, **{name: case.value})
    if case.verdict == REFUSED:
        assert_refused(outcome, name)
        return
    assert outcome.response.status_code == 200, outcome.response.text
    if case.verdict == NOOP:  # the engine is handed exactly what it is handed without the field
        assert [(x.prompt_ids, x.params) for x in outcome.recorded] == [(x.prompt_ids, x.params) for x in base.recorded]
    else:
        assert case.check is not None and case.check(outcome, base), (name, outcome.recorded, outcome.response.text)


def test_every_known_field_has_a_case_and_comes_from_an_api() -> None:
    """Our models know no field the APIs lack, and the table decides every field they know."""
    for route, model in ((COMPLETIONS, CompletionRequest), (CHAT, ChatCompletionRequest)):
        ours = {f.alias or name for name, f in model.model_fields.items()} - REQUIRED
        assert ours <= set(request_fields(route)), ours - set(request_fields(route))
        assert ours <= set(CASES[route]), ours - set(CASES[route])


def test_the_vllm_lists_match_its_source() -> None:
    if not VLLM_SOURCE.is_dir():
        pytest.skip(f"no vLLM 0.32.0 at {VLLM_SOURCE} (make e2e-vllm installs it)")

    def fields(path: str, name: str) -> list[str]:
        tree = ast.parse((VLLM_SOURCE / path).read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
        targets = [s.target for s in cls.body if isinstance(s, ast.AnnAssign)]
        return [t.id for t in targets if isinstance(t, ast.Name) and not t.id.startswith("_")]

    assert fields("completion/protocol.py", "CompletionRequest") == VLLM_COMPLETION
    assert fields("chat_completion/protocol.py", "ChatCompletionRequest") == VLLM_CHAT


def test_the_defaults_a_client_may_send_explicitly_are_accepted(app: RecordingApp) -> None:
    """Values that change nothing (a client sending every default, as some SDKs do) are served."""
    shared = {
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "min_p": 0,
        "use_beam_search": False,
        "length_penalty": 1.0,
        "skip_special_tokens": True,
        "priority": 0,
        "guided_decoding_backend": "xgrammar",
        "stream_interval": 1,
        "response_format": {"type": "text"},
        "stream_options": {"include_usage": False, "include_obfuscation": False},
    }
    chat = {"tools": [], "tool_choice": "none", "store": False, "modalities": ["text"], "service_tier": "auto"}
    for route, fields in (
        (COMPLETIONS, {**shared, "suffix": "", "best_of": 1, "logprobs": None}),
        (CHAT, {**shared, **chat}),
    ):
        base, outcome = send(app, route), send(app, route, **fields)
        assert outcome.response.status_code == 200, (route, outcome.response.text)
        assert outcome.params == base.params


@pytest.mark.parametrize(
    ("route", "fields", "name"),
    [
        (COMPLETIONS, {"logprobs": 21}, "logprobs"),  # OpenAI's bound: 20 alternatives
        (CHAT, {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        (CHAT, {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true, as OpenAI refuses it
        (COMPLETIONS, {"logit_bias": {"x": 1}}, "logit_bias"),
        (COMPLETIONS, {"logit_bias": {"5": 101}}, "logit_bias"),
        (CHAT, {"presence_penalty": 2.5}, "presence_penalty"),
        (CHAT, {"min_p": 1.5}, "min_p"),
        (COMPLETIONS, {"guided_decoding_backend": "auto", "guided_json": "{not json"}, "guided_json"),
        (COMPLETIONS, {"guided_json": "[1]"}, "guided_json"),  # a schema is an object
        (COMPLETIONS, {"guided_choice": []}, "guided_choice"),
        (COMPLETIONS, {"guided_choice": ["a", ""]}, "guided_choice"),
        (COMPLETIONS, {"guided_regex": ""}, "guided_regex"),
        (CHAT, {"structured_outputs": {}}, "structured_outputs"),
        (CHAT, {"structured_outputs": {"json_object": False}}, "structured_outputs"),
        (CHAT, {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}}, "structured_outputs.disable"),
        (CHAT, {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        (CHAT, {"structured_outputs": {"regex": "a", "backend": "x"}}, "structured_outputs.backend"),
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        (CHAT, {"response_format": {"type": "structural_tag", "format": {}}}, "response_format"),
        (CHAT, {"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
        (CHAT, {"messages": [{"role": "user", "content": "hi", "foo": 1}]}, "messages.0.foo"),
        (CHAT, {"messages": [{"role": "assistant", "content": "hi", "refusal": "no"}]}, "messages.0.refusal"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "x": 1}]}]},
            "messages.0.content.0.x",
        ),
        (CHAT, {"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
        (CHAT, {"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
        (CHAT, {"chat_template_kwargs": {"unread": 1}}, "chat_template_kwargs.unread"),
        (CHAT, {"chat_template_kwargs": {"bos_token": ""}}, "chat_template_kwargs.bos_token"),
        (CHAT, {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
        (CHAT, {"request_id": "has a space"}, "request_id"),
    ],
)
def test_bad_values_are_refused_by_name(app: RecordingApp, route: str, fields: dict, name: str) -> None:
    assert_refused(send(app, route, **fields), name)


# structured output: the mapping to the engine's type
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["Paris", "London"]}}, "required": ["answer"]}
SCHEMA_TEXT = json.dumps(SCHEMA)


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        *[
            (
                {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, **s}}},
                StructuredOutput("json_schema", SCHEMA_TEXT),
            )
            for s in ({}, {"strict": True}, {"strict": False, "description": "the answer"})
        ],
        ({"guided_json": SCHEMA}, StructuredOutput("json_schema", SCHEMA_TEXT)),
        ({"guided_json": SCHEMA_TEXT, "guided_decoding_backend": "auto"}, StructuredOutput("json_schema", SCHEMA_TEXT)),
        ({"guided_regex": "[0-9]+"}, StructuredOutput("regex", "[0-9]+")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutput("choice", choices=("yes", "no"))),
        ({"guided_grammar": 'root ::= "a" | "b"'}, StructuredOutput("grammar", 'root ::= "a" | "b"')),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json_schema", SCHEMA_TEXT)),
        ({"structured_outputs": {"json": SCHEMA_TEXT}}, StructuredOutput("json_schema", SCHEMA_TEXT)),
        ({"structured_outputs": {"regex": "a+"}}, StructuredOutput("regex", "a+")),
        ({"structured_outputs": {"choice": ["x", "y"]}}, StructuredOutput("choice", choices=("x", "y"))),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutput("grammar", 'root ::= "a"')),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
    ],
)
def test_each_shape_maps_to_the_engines_constraint(
    app: RecordingApp, route: str, fields: dict, expected: StructuredOutput | None
) -> None:
    outcome = send(app, route, **fields, n=2)
    assert outcome.response.status_code == 200, outcome.response.text
    assert [x.params.structured for x in outcome.recorded] == [expected, expected]  # every choice


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, ("response_format", "guided_json")),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            ("response_format", "structured_outputs.regex"),
        ),  # fmt: skip
        ({"guided_regex": "a", "guided_choice": ["a"]}, ("guided_regex", "guided_choice")),
        (
            {"structured_outputs": {"json": SCHEMA, "regex": "a"}},
            ("structured_outputs.json", "structured_outputs.regex"),
        ),
        (
            {"structured_outputs": {"choice": ["a"]}, "guided_grammar": "root ::= x"},
            ("structured_outputs.choice", "guided_grammar"),
        ),  # fmt: skip
    ],
)
@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_two_constraints_are_a_400_naming_both(app: RecordingApp, route: str, fields: dict, names: tuple) -> None:
    outcome = send(app, route, **fields)
    assert outcome.response.status_code == 400, outcome.response.text
    error = outcome.response.json()["error"]
    assert all(n in error["message"] for n in names) and error["code"] == "conflicting_constraints"
    assert not outcome.recorded


def _generate(app: RecordingApp, **parameters: Any) -> Outcome:
    before = len(app.engine.recorded)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, **parameters}}
    return Outcome(app.client.post("/generate", json=body), app.engine.recorded[before:], app)


def test_lorax_response_format_as_lorax_client_sends_it(app: RecordingApp) -> None:
    fmt = lorax.types.ResponseFormat(type="json_object", schema=SCHEMA)
    sent = lorax.types.Parameters(response_format=fmt, max_new_tokens=2).model_dump(by_alias=True)  # as the client
    outcome = _generate(app, **sent)
    assert outcome.response.status_code == 200, outcome.response.text
    assert outcome.params.structured == StructuredOutput("json_schema", SCHEMA_TEXT)
    outcome = _generate(app, response_format={"type": "json_object"})
    assert outcome.params.structured == StructuredOutput("json_object")
    assert _generate(app).params.structured is None


@pytest.mark.parametrize(
    ("parameters", "name"),
    [
        ({"response_format": {"type": "text"}}, "parameters.response_format"),
        ({"response_format": {"type": "json_object", "schema": SCHEMA, "x": 1}}, "parameters.response_format.x"),
        ({"api_token": "hf_x"}, "parameters.api_token"),
        ({"typical_p": 0.5}, "parameters.typical_p"),
        ({"watermark": True}, "parameters.watermark"),
        ({"merged_adapters": {"ids": ["a"]}}, "parameters.merged_adapters"),
        ({"grammar": {"type": "json", "value": {}}}, "parameters.grammar"),  # TGI's, not LoRAX's
        ({"min_p": 0.1}, "parameters.min_p"),
    ],
)
def test_lorax_fields_are_honoured_or_refused_by_name(app: RecordingApp, parameters: dict, name: str) -> None:
    outcome = _generate(app, **parameters)
    assert outcome.response.status_code in (400, 422), outcome.response.text
    assert name in outcome.response.json()["error"] and not outcome.recorded


def test_every_lorax_client_parameter_is_known() -> None:
    """lorax-client sends every field of its Parameters (most as null): each must be one we know."""
    sent = set(lorax.types.Parameters().model_dump(by_alias=True))
    assert sent <= set(LoraxParameters.model_fields), sent - set(LoraxParameters.model_fields)
    assert set(lorax.types.Request.model_fields) <= {"inputs", "parameters", "stream"}


def test_unknown_top_level_lorax_field_is_a_400(app: RecordingApp) -> None:
    r = app.client.post("/generate", json={"inputs": PROMPT, "parametres": {}})
    assert r.status_code == 400 and "parametres" in r.json()["error"], r.text


# end to end: the engine's constraint on a real server (once the engine side exists)
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    pytest.importorskip("loraplane_server.executor.structured")
    log = tmp_path_factory.mktemp("surface-server") / "server.log"
    proc = ServerProcess("--max-model-len 512 --num-kv-blocks 64".split(), log)
    proc.wait_ready()
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


def _post(server: ServerProcess, path: str, body: dict) -> Any:
    r = httpx.post(f"{server.url}{path}", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_constrained_outputs_follow_their_constraint(server: ServerProcess) -> None:
    question = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    chat = {"model": "smollm2-135m", "messages": question, "max_tokens": 48, "temperature": 0}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    content = _post(server, CHAT, {**chat, "response_format": fmt})["choices"][0]["message"]["content"]
    assert json.loads(content)["answer"] in ("Paris", "London"), content
    content = _post(server, CHAT, {**chat, "guided_choice": ["yes", "no"]})["choices"][0]["message"]["content"]
    assert content in ("yes", "no")
    completion = {"model": "smollm2-135m", "prompt": "The year is", "max_tokens": 8, "temperature": 0}
    text = _post(server, COMPLETIONS, {**completion, "structured_outputs": {"regex": " [0-9]{4}"}})["choices"][0][
        "text"
    ]
    assert re.fullmatch(" [0-9]{4}", text), text
    body = {"inputs": "A JSON object about Paris:", "parameters": {"max_new_tokens": 48, "response_format": {
        "type": "json_object", "schema": SCHEMA}}}  # fmt: skip
    assert json.loads(_post(server, "/generate", body)["generated_text"])["answer"] in ("Paris", "London")


def test_lorax_alternatives_as_lorax_client_reads_them(app: RecordingApp) -> None:
    sent = lorax.types.Parameters(return_k_alternatives=3, details=True, max_new_tokens=2).model_dump(by_alias=True)
    outcome = _generate(app, **sent)
    assert outcome.response.status_code == 200, outcome.response.text
    assert outcome.params.top_logprobs == 3
    response = lorax.types.Response(**outcome.body)  # the client's own model parses it
    assert response.details is not None
    alternatives = response.details.tokens[0].alternative_tokens
    assert alternatives is not None
    assert [a.logprob for a in alternatives] == pytest.approx([-0.5, -0.5 - 0.693, -0.5 - 2 * 0.693])


@pytest.mark.slow
def test_the_openai_client_reads_top_logprobs_and_the_shapers_take_effect(
    server: ServerProcess, smollm2_dir: Path
) -> None:
    """The real openai package: top_logprobs=5 on chat and logprobs=3 on completions come back as its types
    (best first, the chosen token first under greedy); a -100 logit_bias bans the greedy first token."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(
        model="smollm2-135m", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=5
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(c.top_logprobs) == 5 for c in content)
    for c in content:
        values = [t.logprob for t in c.top_logprobs]
        assert values == sorted(values, reverse=True) and c.top_logprobs[0].token == c.token
        assert c.logprob == pytest.approx(values[0])
    completion = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=3)
    lp = completion.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None and all(len(t) == 3 for t in lp.top_logprobs)
    free = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=3, temperature=0)
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    first = tokenizer.encode(free.choices[0].text, add_special_tokens=False)[0]
    shaped = client.completions.create(
        model="smollm2-135m",
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        logit_bias={str(first): -100},
        presence_penalty=1.0,
        frequency_penalty=1.0,
        extra_body={"min_p": 0.05},
    )
    text = shaped.choices[0].text
    assert text and tokenizer.encode(text, add_special_tokens=False)[0] != first


@pytest.mark.parametrize(
    ("route", "fields", "name"),
    [
        (COMPLETIONS, {"guided_regex": "[a-"}, "guided_regex"),
        (CHAT, {"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
        (
            CHAT,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(["}}},
                    },
                }
            },
            "response_format",
        ),  # fmt: skip
        (
            CHAT,
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(["}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),  # fmt: skip
    ],
)
def test_a_constraint_that_does_not_compile_is_a_400_naming_its_field(
    app: RecordingApp, route: str, fields: dict, name: str
) -> None:
    """Compiled on a worker thread before the engine sees the request: a 400 naming the field and why."""
    outcome = send(app, route, **fields)
    assert outcome.response.status_code == 400, outcome.response.text
    error = outcome.response.json()["error"]
    assert error["param"] == name and error["code"] == "invalid_constraint" and "compile" in error["message"]
    assert not outcome.recorded


@pytest.mark.slow
def test_echo_with_logprobs_and_prompt_logprobs_show_the_prompts_logprobs(server: ServerProcess) -> None:
    """OpenAI's echo with logprobs: the prompt's tokens first (the first with none), then the generated ones;
    vLLM's prompt_logprobs give the same values; LoRAX's decoder_input_details too. Streaming it is a 422."""
    body = {"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    echoed = _post(server, COMPLETIONS, {**body, "echo": True, "logprobs": 2})["choices"][0]
    plain = _post(server, COMPLETIONS, {**body, "prompt_logprobs": 2})["choices"][0]
    lp = echoed["logprobs"]
    prompt_entries = plain["prompt_logprobs"]
    n = len(prompt_entries)  # the prompt's tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and prompt_entries[0] is None
    assert len(lp["tokens"]) == n + 2 and "".join(lp["tokens"][:n]) == PROMPT
    for k in range(1, n):
        entry = prompt_entries[k]
        own = next(v for v in entry.values() if v["decoded_token"] == lp["tokens"][k] and v["rank"] >= 1)
        assert lp["token_logprobs"][k] == pytest.approx(own["logprob"], abs=1e-5)
        assert len(lp["top_logprobs"][k]) == 2 and len(entry) in (2, 3)  # the token itself, when not in the top 2
    assert lp["text_offset"][0] == 0 and lp["text_offset"][n] == len(PROMPT)
    refused = httpx.post(f"{server.url}{COMPLETIONS}", json={**body, "echo": True, "logprobs": 1, "stream": True})
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "echo"
    details = {"details": True, "decoder_input_details": True, "max_new_tokens": 2}
    prefill = _post(server, "/generate", {"inputs": PROMPT, "parameters": details})["details"]["prefill"]
    assert prefill[0]["logprob"] is None and len(prefill) == n
    assert [p["logprob"] for p in prefill[1:]] == pytest.approx(lp["token_logprobs"][1:n], abs=1e-4)


@pytest.mark.slow
def test_the_lorax_client_gets_json_and_alternatives(server: ServerProcess) -> None:
    """The real lorax-client over HTTP: response_format with a schema (the text validates), return_k_alternatives
    (each token's alternatives, best first, the greedy token first) and decoder_input_details."""
    client = lorax.Client(server.url, timeout=120)
    fmt = {"type": "json_object", "schema": SCHEMA}
    answer = client.generate("A JSON object about Paris:", max_new_tokens=48, response_format=fmt)
    jsonschema.validate(json.loads(answer.generated_text), SCHEMA)
    details = client.generate(
        PROMPT, max_new_tokens=3, return_k_alternatives=3, decoder_input_details=True, details=True
    ).details
    assert details is not None and len(details.tokens) == 3
    for token in details.tokens:
        alternatives = token.alternative_tokens or []
        assert len(alternatives) == 3 and alternatives[0].id == token.id
        assert [a.logprob for a in alternatives] == sorted((a.logprob for a in alternatives), reverse=True)
    assert details.prefill[0].logprob is None and all(p.logprob is not None for p in details.prefill[1:])
