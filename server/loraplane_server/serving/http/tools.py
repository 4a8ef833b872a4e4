"""Tool calls on /v1/chat/completions: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

- `tool_choice` a named function: the output is constrained (xgrammar) to that function's `parameters` schema and
  answered as one call to it; `required`: constrained to a JSON array of one or more calls ({name, arguments}, each
  name one of the tools and its arguments its schema; one call when parallel_tool_calls is false), answered as
  those calls. Both always parse: the grammar admits nothing else.
- `auto` (the default when tools are given): the model writes what it likes; the server reads the calls it wrote
  in its family's own format, finding any of them: `<tool_call>{...}</tool_call>` or a list inside (Hermes: Qwen2.5,
  Qwen3, SmolLM2), `[TOOL_CALLS][...]` and `[TOOL_CALLS]name[ARGS]{...}` (Mistral), `<|python_tag|>` and bare
  JSON objects `{"name", "parameters"}` separated by `;` (Llama 3.x), `<|tool_call|>[...]<|/tool_call|>` (Phi-4),
  pythonic calls `[f(a=1), g(b="x")]` (Llama 3.2/4 pythonic, Gemma), and a ```json fenced block. A call counts
  only when its name is one of the request's tools and its arguments are a JSON object; otherwise the text is
  the answer's content, as written.
- `none`: the tools are not shown to the model and nothing is parsed.
The tools reach the model through its chat template (`tools`, as transformers passes them); a template that does
not read `tools` (SmolLM2's, for one) gets them in a system message in the Hermes format instead, so the model is
never asked to call tools it was not shown. Earlier turns' `tool_calls` and `tool` messages go to the template as
transformers documents them (arguments as an object).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplane_server.detokenizer import stop_prefix_len
from loraplane_server.sampling_params import StructuredOutput
from loraplane_server.serving.http.errors import ApiError

FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"  # OpenAI's rule for a function's name
# where a call starts, in the formats read here (the ones a model's tokenizer may keep as special tokens too)
MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<|tool_call|>", "```json", "```tool_code")
_ANY_OBJECT = {"type": "object"}
_DECODER = json.JSONDecoder()


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=FUNCTION_NAME, description="the function's name")
    description: str | None = Field(default=None, description="what it does, shown to the model")
    parameters: dict[str, Any] | None = Field(default=None, description="a JSON Schema for its arguments (an object)")
    strict: bool | None = Field(
        default=None, description="true or false alike: forced calls always follow the schema (xgrammar)"
    )


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    """tool_choice {type: function, function: {name}}: the answer is one call to that function."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of the server."""

    tools: tuple[ToolDef, ...]
    mode: Literal["none", "auto", "required", "named"]
    named: str | None = None
    parallel: bool = True

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (transformers' JSON-schema form); none with tool_choice none."""
        if self.mode == "none" or not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def names(self) -> set[str]:
        return {t.function.name for t in self.tools}

    def schema_of(self, name: str) -> dict[str, Any]:
        tool = next(t for t in self.tools if t.function.name == name)
        return tool.function.parameters or _ANY_OBJECT

    def constraint(self) -> StructuredOutput | None:
        """The output's grammar for a forced call (named, required); None for auto and none."""
        if self.mode == "named":
            assert self.named is not None
            return StructuredOutput("json_schema", json.dumps(self.schema_of(self.named)))
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": t.function.name},
                        "arguments": t.function.parameters or _ANY_OBJECT,
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutput("json_schema", json.dumps(schema))
        return None

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the answer's content, its tool calls) from the generated text."""
        if self.mode == "named":
            assert self.named is not None
            return None, [ToolCall(self.named, _normal_json(text))]
        if self.mode == "required":
            return None, [ToolCall(c["name"], json.dumps(c["arguments"])) for c in json.loads(text)]
        if self.mode == "auto":
            content, calls = parse_tool_calls(text, self.names)
            if calls and not self.parallel:
                calls = calls[:1]
            return content, calls
        return text, []


def plan_tools(tools: list[ToolDef] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolPlan | None:
    """The request's ToolPlan (None without tools), or a 400 naming what does not fit."""
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ApiError(400, f"tools: the function name {dup!r} is given twice", param="tools")
    for t in tools:
        params = t.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise ApiError(
                400,
                f"tools: {t.function.name}'s parameters must be an object schema",
                param="tools.function.parameters",
            )
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ApiError(
                400,
                f"tool_choice names {choice.function.name!r}, which is not one of the tools ({', '.join(names)})",
                param="tool_choice.function.name",
            )
        return ToolPlan(tuple(tools), "named", choice.function.name, parallel is not False)
    return ToolPlan(tuple(tools), choice or "auto", None, parallel is not False)


# the prompt
HERMES_SYSTEM = (
    "You may call one or more functions to answer. The functions, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call functions, answer with each call on its own line as\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments object>}}\n</tool_call>'
)


def tools_in_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template that does not read `tools`: the tools in a system message (Hermes' format), before the
    conversation's own system message if it has one."""
    text = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{text}".strip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def template_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as chat templates read them: arguments as an object where they parse."""
    out = []
    for call in calls:
        function = dict(call.get("function") or {})
        args = function.get("arguments")
        if isinstance(args, str):
            try:
                function["arguments"] = json.loads(args)
            except ValueError:
                pass
        out.append({**call, "function": function})
    return out


def tool_calls_as_text(calls: list[dict[str, Any]]) -> str:
    """An assistant turn's calls as Hermes text, for a template that does not read tool_calls."""
    parts = []
    for call in template_tool_calls(calls):
        function = call.get("function") or {}
        body = {"name": function.get("name"), "arguments": function.get("arguments")}
        parts.append(f"<tool_call>\n{json.dumps(body)}\n</tool_call>")
    return "\n".join(parts)


# parsing what the model wrote
def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls): the calls the text makes in any format read here, the content the text before them
    (None when empty). No call, or one that names no tool or has no object for arguments: the text is the
    content and there are no calls."""
    start = _first_marker(text)
    head, rest = (text[:start], text[start:]) if start is not None else ("", text)
    calls = _read_calls(rest.strip())
    if calls is None or not calls or any(c.name not in names for c in calls):
        return text, []
    content = head.strip()
    return content or None, calls


def _first_marker(text: str) -> int | None:
    found = [i for i in (text.find(m) for m in MARKERS) if i >= 0]
    return min(found) if found else None


def _read_calls(text: str) -> list[ToolCall] | None:
    """The calls a tool-call text makes (it starts with its marker, or is bare JSON or pythonic); None if not."""
    if text.startswith("<tool_call>"):
        calls: list[ToolCall] = []
        for block in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, flags=re.S):
            found = _json_calls(block.strip())
            if found is None:
                return None
            calls += found
        return calls
    if text.startswith("<|tool_call|>"):
        inner = text[len("<|tool_call|>") :].split("<|/tool_call|>")[0]
        return _json_calls(inner.strip())
    if text.startswith("[TOOL_CALLS]"):
        inner = text[len("[TOOL_CALLS]") :].strip()
        if "[ARGS]" in inner:  # Mistral's v11 form: name[ARGS]{...} per call
            return _mistral_args_calls(inner)
        return _json_calls(inner)
    if text.startswith("<|python_tag|>"):
        text = text[len("<|python_tag|>") :].strip()
    if text.startswith("```"):
        inner = re.sub(r"^```[a-z_]*\s*", "", text)
        inner = inner.split("```")[0].strip()
        return _json_calls(inner) or _pythonic_calls(inner)
    if text.startswith("{"):
        return _json_calls(text)
    if text.startswith("["):
        return _json_calls(text) or _pythonic_calls(text)
    return None


def _json_calls(text: str) -> list[ToolCall] | None:
    """Calls as JSON: an object, a list of them, or objects separated by `;` (Llama 3.1); each {name,
    arguments | parameters}."""
    values: list[Any] = []
    pos = 0
    while pos < len(text):
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            return None
        values += value if isinstance(value, list) else [value]
        pos = end
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
    calls = []
    for value in values:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        args = value.get("arguments", value.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall(value["name"], json.dumps(args)))
    return calls or None


def _mistral_args_calls(text: str) -> list[ToolCall] | None:
    calls = []
    for part in text.split("[TOOL_CALLS]"):
        name, sep, args = part.partition("[ARGS]")
        if not sep:
            return None
        try:
            value = json.loads(args.strip())
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        calls.append(ToolCall(name.strip(), json.dumps(value)))
    return calls


def _pythonic_calls(text: str) -> list[ToolCall] | None:
    """[f(a=1), g(b="x")] or f(a=1): keyword arguments that are Python literals (ast, never evaluated)."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    items = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for item in items:
        if not isinstance(item, ast.Call) or not isinstance(item.func, ast.Name) or item.args:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in item.keywords if kw.arg is not None}
        except ValueError:
            return None
        if len(args) != len(item.keywords):
            return None
        calls.append(ToolCall(item.func.id, json.dumps(args)))
    return calls or None


def _normal_json(text: str) -> str:
    """A forced call's arguments as compact JSON (the grammar made it valid; the text as is if not)."""
    try:
        return json.dumps(json.loads(text))
    except ValueError:
        return text


class ToolStream:
    """Streaming with tool_choice auto: content deltas go out as they come until the text may be a tool call
    (it starts like one, or a marker begins in it), from where the rest is held for the parse at the end.
    Held text that is not a call after all goes out at the end, so the deltas always add up to the content."""

    def __init__(self) -> None:
        self.text = ""  # all of it so far
        self.sent = 0  # chars of it sent as content
        self.held = False  # a call may have begun at `sent`

    def feed(self, piece: str) -> str:
        """The content to send now for this piece of text."""
        self.text += piece
        if self.held:
            return ""
        rest = self.text[self.sent :]
        if self.sent == 0:
            stripped = rest.lstrip()
            if not stripped:
                return ""
            if stripped[0] in "{[" or any(stripped.startswith(m) for m in MARKERS):
                self.held = True
                return ""
            if any(m.startswith(stripped) for m in MARKERS):
                return ""  # a marker's beginning: wait and see
        marker = _first_marker(rest)
        if marker is not None:
            self.held = True
            self.sent += marker
            return rest[:marker]
        out = rest[: len(rest) - stop_prefix_len(rest, list(MARKERS))]  # a marker's possible start held
        self.sent += len(out)
        return out

    def calls(self, names: set[str]) -> tuple[str, list[ToolCall]]:
        """At the end: (the content still to send, the calls made). Only held text can be calls (what was sent
        is content); held text that is no call goes out as content."""
        rest = self.text[self.sent :]
        calls = parse_tool_calls(rest, names)[1] if self.held else []
        if calls:  # held from where the call began: nothing before it is unsent
            self.sent = len(self.text)
            return "", calls
        self.sent = len(self.text)
        return rest, []
