"""Tool calls (serving/http/tools.py): every family's format parsed, the streaming hold-back, the plan's checks and
grammars, the tools reaching a chat template that reads them (and a system message for one that does not); then
the real openai package against a real server on the built-in model: a named call, required calls, an auto call,
the same streamed and assembled by the SDK's own stream helper, chat.completions.parse with a pydantic model,
and earlier turns' tool calls and results sent back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from test_http_support import ServerProcess

from loraplane_server.serving.http.errors import ApiError
from loraplane_server.serving.http.tools import (
    NamedFunction,
    NamedToolChoice,
    ToolDef,
    ToolStream,
    parse_tool_calls,
    plan_tools,
    tools_in_messages,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
NAMES = {"get_weather", "get_time"}
PARIS = {"city": "Paris", "unit": "celsius"}


def tools(*defs: dict) -> list[ToolDef]:
    return [ToolDef.model_validate(d) for d in defs]


# parsing each family's format
@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        # Hermes (Qwen2.5, Qwen3, SmolLM2): one block per call, or a list in one
        (f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(PARIS)}}}\n</tool_call>', None, [PARIS]),
        (
            'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
            "Let me look.",
            [PARIS, {"zone": "CET"}],
        ),
        ('<tool_call>[{"name": "get_time", "arguments": {"zone": "UTC"}}]</tool_call>', None, [{"zone": "UTC"}]),
        # Mistral: a list after [TOOL_CALLS], or v11's name[ARGS]{...}
        ('[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}]', None, [{"zone": "UTC"}]),
        ('[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}', None, [{"zone": "UTC"}]),
        # Llama 3.x: <|python_tag|> or bare JSON with "parameters", several separated by ;
        ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}', None, [{"zone": "UTC"}]),
        (
            '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": '
            '{"city": "Paris", "unit": "celsius"}}',
            None,
            [{"zone": "UTC"}, PARIS],
        ),
        # arguments as JSON text (some fine-tunes write them so)
        ('{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}', None, [{"zone": "UTC"}]),
        # Phi-4-mini
        ('<|tool_call|>[{"name": "get_time", "arguments": {"zone": "UTC"}}]<|/tool_call|>', None, [{"zone": "UTC"}]),
        # pythonic (Llama 3.2 / 4, Gemma) and a fenced block
        ("[get_time(zone='UTC'), get_weather(city='Paris', unit='celsius')]", None, [{"zone": "UTC"}, PARIS]),
        ('```json\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n```', None, [{"zone": "UTC"}]),
    ],
)
def test_each_familys_format_is_read(text: str, content: str | None, calls: list[dict]) -> None:
    got_content, got = parse_tool_calls(text, NAMES)
    assert got_content == content
    assert [json.loads(c.arguments) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny today.",
        '{"name": "launch_rockets", "arguments": {}}',  # not one of the tools
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>',  # cut short
        '{"city": "Paris"}',  # JSON, but no call
        "[1, 2, 3]",
        "[os.system('x')]",  # not a bare name: never a call (and never evaluated)
        "[get_time(zone=open('f').read())]",  # not a literal
    ],
)
def test_text_that_is_no_call_is_the_content(text: str) -> None:
    assert parse_tool_calls(text, NAMES) == (text, [])


# streaming
def feed_all(pieces: list[str]) -> tuple[str, ToolStream]:
    stream = ToolStream()
    sent = "".join(stream.feed(p) for p in pieces)
    return sent, stream


def test_plain_content_streams_with_only_a_possible_markers_start_held() -> None:
    sent, stream = feed_all(["The ", "answer", " is <", "b>42</b> ", "<tool"])
    assert sent == "The answer is <b>42</b> "  # "<tool" may begin <tool_call>: held
    tail, calls = stream.calls(NAMES)
    assert tail == "<tool" and not calls  # it did not: it goes out at the end


def test_a_call_after_content_holds_back_from_its_marker() -> None:
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    pieces = ["Let me ", "check.\n<tool", "_call>", *(call[len("<tool_call>") :][i : i + 7] for i in range(0, 80, 7))]
    sent, stream = feed_all(pieces)
    assert sent == "Let me check.\n"
    tail, calls = stream.calls(NAMES)
    assert tail == "" and [c.name for c in calls] == ["get_time"]


def test_an_answer_that_opens_like_json_is_held_and_sent_when_it_is_no_call() -> None:
    sent, stream = feed_all(["  ", '{"a"', ": 1}"])
    assert sent == ""
    assert stream.calls(NAMES) == ('  {"a": 1}', [])


# the plan
def test_the_plans_checks_name_what_is_wrong() -> None:
    with pytest.raises(ApiError, match="twice"):
        plan_tools(tools(WEATHER, WEATHER), None, None)
    with pytest.raises(ApiError, match="not one of the tools") as info:
        plan_tools(tools(WEATHER), NamedToolChoice(type="function", function=NamedFunction(name="x")), None)
    assert info.value.param == "tool_choice.function.name"
    with pytest.raises(ApiError, match="needs tools"):
        plan_tools(None, "required", None)
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
    with pytest.raises(ApiError, match="object schema"):
        plan_tools(tools(bad), None, None)
    assert plan_tools(None, "none", None) is None
    assert plan_tools(tools(WEATHER), None, None).mode == "auto"  # type: ignore[union-attr]


def test_required_calls_grammar_bounds_the_calls_by_parallel_tool_calls() -> None:
    for parallel, max_items in ((None, None), (False, 1)):
        plan = plan_tools(tools(WEATHER, TIME), "required", parallel)
        assert plan is not None
        constraint = plan.constraint()
        assert constraint is not None and constraint.kind == "json_schema"
        schema = json.loads(constraint.spec)
        assert schema.get("maxItems") == max_items and schema["minItems"] == 1
        valid = [{"name": "get_time", "arguments": {"zone": "UTC"}}]
        jsonschema.validate(valid, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "get_time", "arguments": {"city": "Paris"}}], schema)


def test_tools_go_in_a_system_message_for_a_template_that_reads_none() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    out = tools_in_messages(messages, [WEATHER])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.")
    assert '"get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"] and out[1:] == messages[1:]


# end to end: the real openai package on a real server
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("tools-server") / "server.log"
    proc = ServerProcess("--max-model-len 1024 --num-kv-blocks 128".split(), log)
    proc.wait_ready()
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MODEL = "smollm2-135m"


def arguments_of(call: Any, tool: dict) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


@pytest.mark.slow
def test_a_named_call_follows_its_schema(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    answer = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=64, temperature=0
    )
    message = answer.choices[0].message
    assert message.tool_calls and len(message.tool_calls) == 1 and message.content is None
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments_of(call, WEATHER)


@pytest.mark.slow
def test_required_calls_name_the_tools_and_follow_their_schemas(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        arguments_of(call, WEATHER if call.function.name == "get_weather" else TIME)


# what the model writes under auto is its own: the regex here makes it write a Hermes call (the format SmolLM2 is
# shown), so the parse of auto answers is what is checked
HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Lyon)", "unit": "celsius"\}\}\n</tool_call>'  # noqa: E501
)


@pytest.mark.slow
def test_an_auto_call_is_parsed_into_tool_calls(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        max_tokens=64,
        temperature=0,
        extra_body={"structured_outputs": {"regex": HERMES_CALL}},
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "get_weather"
    assert arguments_of(choice.message.tool_calls[0], WEATHER)["city"] in ("Paris", "Lyon")
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=16, temperature=0)
    if not plain.choices[0].message.tool_calls:  # the model's own answer: content, and no call made up
        assert plain.choices[0].message.content and plain.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["named", "auto"])
def test_streamed_calls_are_assembled_by_the_sdk(client: openai.OpenAI, how: str) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "max_tokens": 64, "temperature": 0}
    if how == "named":
        kwargs["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    else:
        kwargs["extra_body"] = {"structured_outputs": {"regex": HERMES_CALL}}
    with client.chat.completions.stream(**kwargs, stream_options={"include_usage": True}) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    arguments_of(message.tool_calls[0], WEATHER)
    assert final.usage is not None and final.usage.completion_tokens > 0
    unstreamed = client.chat.completions.create(**kwargs)
    assert unstreamed.choices[0].message.tool_calls
    assert json.loads(unstreamed.choices[0].message.tool_calls[0].function.arguments) == json.loads(
        message.tool_calls[0].function.arguments
    )  # greedy: the same call streamed or not


class City(BaseModel):  # bounded, so that a 135M model's answer ends within max_tokens
    name: str = Field(max_length=16)
    country: Literal["France", "Italy", "Spain"]
    is_capital: bool


@pytest.mark.slow
def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Describe Paris as JSON."}]
    answer = client.chat.completions.parse(
        model=MODEL, messages=ask, response_format=City, max_tokens=64, temperature=0
    )
    parsed = answer.choices[0].message.parsed
    assert isinstance(parsed, City) and answer.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_earlier_calls_and_their_results_are_sent_back(client: openai.OpenAI, server: ServerProcess) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(PARIS)}}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    answer = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.usage is not None
    # the call reached the prompt (SmolLM2's template reads no tool_calls: as Hermes text), the tools did not
    # (tool_choice none)
    assert (
        answer.usage.prompt_tokens
        > client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, temperature=0).usage.prompt_tokens
        + 20
    )  # type: ignore[union-attr]
