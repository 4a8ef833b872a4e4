"""Structured output requests, in every API's own shape, to the engine's one type (`StructuredOutput`).

The shapes: OpenAI's `response_format` (text, json_object, json_schema) on /v1/chat/completions and, as vLLM
accepts it, /v1/completions; vLLM's `structured_outputs` ({json, regex, choice, grammar, json_object}, its
current form) and its older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar` (which vLLM
0.32 ignores, telling its log and not the client: they are honoured here); LoRAX's `parameters.response_format`
({type: json_object, schema}). A request names at most one constraint: two are a 400 naming both, rather than
one winning silently.
Options the engine cannot honour (another guided decoding backend, vLLM's whitespace and structural-tag knobs)
are refused by name.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from loraplane_server.errors import InvalidParameterError
from loraplane_server.sampling_params import StructuredOutput
from loraplane_server.serving.http.errors import ApiError

BACKENDS = ("xgrammar", "auto")  # guided_decoding_backend values this server honours: xgrammar is its one backend
NonEmpty = Annotated[str, Field(min_length=1)]
JSON_SCHEMA_DOC = (
    "a JSON Schema (an object); the output is a JSON value it accepts. As a JSON string too (vLLM's guided_json)"
)
STRICT_DOC = (
    "true or false alike: the output is always constrained to the schema, token by token (xgrammar), so it "
    "never strays from it"
)


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=256, description="the schema's name (reported back by OpenAI)")
    description: str | None = Field(default=None, description="what the output is for; it does not constrain it")
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema", description=JSON_SCHEMA_DOC)
    strict: bool | None = Field(default=None, description=STRICT_DOC)


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object) or json_schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(default=None, description="with type json_schema: the schema")


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its StructuredOutputsParams): exactly one of json, regex, choice, grammar,
    json_object. Its other options change how the output is formatted, which this server does not do: any
    value but their default is refused by name."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json", description=JSON_SCHEMA_DOC)
    regex: NonEmpty | None = Field(default=None, description="the whole output matches this pattern")
    choice: list[NonEmpty] | None = Field(default=None, min_length=1, description="the output is one of these")
    grammar: NonEmpty | None = Field(default=None, description="an EBNF grammar with a root rule (xgrammar's)")
    json_object: bool | None = Field(default=None, description="true: any JSON object")
    disable_any_whitespace: bool = Field(default=False, description="only false is supported")
    disable_additional_properties: bool = Field(default=False, description="only false is supported")
    whitespace_pattern: str | None = Field(default=None, description="not supported; must be absent")
    structural_tag: str | None = Field(default=None, description="not supported; must be absent")


class LoraxResponseFormat(BaseModel):
    """LoRAX's parameters.response_format (lorax-client's ResponseFormat): a JSON object, of `schema` if given."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["json_object"]
    json_schema: dict[str, Any] | None = Field(
        default=None, alias="schema", description="a JSON Schema the output follows; none: any JSON object"
    )


class Constraint(NamedTuple):
    """One constraint a request names, and the field that named it (for errors)."""

    param: str
    output: StructuredOutput


def make(param: str, kind: str, spec: str = "", choices: tuple[str, ...] = ()) -> Constraint:
    """A Constraint; the engine type's own refusal is a 422 naming the API's field."""
    try:
        return Constraint(param, StructuredOutput(kind, spec, choices))
    except InvalidParameterError as exc:
        raise ApiError(422, f"{param}: {exc}", param=param, code="invalid_parameter") from exc


def schema_text(schema: dict[str, Any] | str, param: str) -> str:
    """A schema as the JSON text the engine compiles; a string must itself be a JSON object (422 naming the
    field otherwise), so a typo is refused here rather than deep in the grammar compiler."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError as exc:
            raise ApiError(422, f"{param}: not valid JSON ({exc})", param=param, code="invalid_schema") from exc
        if not isinstance(parsed, dict):
            raise ApiError(422, f"{param}: a JSON Schema must be a JSON object", param=param, code="invalid_schema")
        schema = parsed
    return json.dumps(schema, ensure_ascii=False)


def from_response_format(fmt: ResponseFormat | None, param: str = "response_format") -> list[Constraint]:
    """OpenAI's response_format: text is no constraint; json_schema without its schema is refused (OpenAI's
    type allows it, but then nothing says what to follow), rather than served as any JSON."""
    if fmt is None or fmt.type == "text":
        return []
    if fmt.type == "json_object":
        return [make(param, "json_object")]
    spec = fmt.json_schema
    if spec is None or spec.json_schema is None:
        raise ApiError(
            422,
            f"{param}: type json_schema needs json_schema.schema (the JSON Schema); for any JSON object use "
            "type json_object",
            param=f"{param}.json_schema.schema",
            code="invalid_schema",
        )
    return [make(param, "json_schema", schema_text(spec.json_schema, f"{param}.json_schema.schema"))]


def from_structured_outputs(so: StructuredOutputs | None, param: str = "structured_outputs") -> list[Constraint]:
    """vLLM's structured_outputs: every constraint it names (single() refuses two), and none is a 422 as in
    vLLM; its formatting options are refused by name, since the engine cannot honour them."""
    if so is None:
        return []
    refused = {
        "disable_any_whitespace": so.disable_any_whitespace,
        "disable_additional_properties": so.disable_additional_properties,
        "whitespace_pattern": so.whitespace_pattern is not None,
        "structural_tag": so.structural_tag is not None,
    }
    for name, is_set in refused.items():
        if is_set:
            raise ApiError(
                422,
                f"{param}.{name}: not supported by this server",
                param=f"{param}.{name}",
                code="unsupported_parameter",
            )
    found = []
    if so.json_ is not None:
        found.append(make(f"{param}.json", "json_schema", schema_text(so.json_, f"{param}.json")))
    if so.regex is not None:
        found.append(make(f"{param}.regex", "regex", so.regex))
    if so.choice is not None:
        found.append(make(f"{param}.choice", "choice", choices=tuple(so.choice)))
    if so.grammar is not None:
        found.append(make(f"{param}.grammar", "grammar", so.grammar))
    if so.json_object:
        found.append(make(f"{param}.json_object", "json_object"))
    if not found:
        raise ApiError(
            422,
            f"{param} names no constraint: give one of json, regex, choice, grammar or json_object: true",
            param=param,
            code="invalid_parameter",
        )
    return found


def from_guided(
    json_schema: dict[str, Any] | str | None,
    regex: str | None,
    choice: list[str] | None,
    grammar: str | None,
    backend: str | None,
) -> list[Constraint]:
    """vLLM's guided_* fields (removed from vLLM, still sent by older clients)."""
    if backend is not None and backend not in BACKENDS:
        raise ApiError(
            422,
            f"guided_decoding_backend: {backend!r} is not available; this server decodes with xgrammar "
            f"(send {' or '.join(BACKENDS)}, or leave it out)",
            param="guided_decoding_backend",
            code="unsupported_parameter",
        )
    found = []
    if json_schema is not None:
        found.append(make("guided_json", "json_schema", schema_text(json_schema, "guided_json")))
    if regex is not None:
        found.append(make("guided_regex", "regex", regex))
    if choice is not None:
        found.append(make("guided_choice", "choice", choices=tuple(choice)))
    if grammar is not None:
        found.append(make("guided_grammar", "grammar", grammar))
    return found


def from_lorax(fmt: LoraxResponseFormat | None, param: str = "parameters.response_format") -> StructuredOutput | None:
    """LoRAX's response_format: its schema when given (lorax-client always sends one), else any JSON object."""
    if fmt is None:
        return None
    if fmt.json_schema is None:
        return make(param, "json_object").output
    return make(param, "json_schema", schema_text(fmt.json_schema, f"{param}.schema")).output


def single(found: list[Constraint]) -> StructuredOutput | None:
    """The one constraint a request names, None for none; two or more are a 400 naming two of them (which one
    should win is the caller's to say)."""
    if not found:
        return None
    if len(found) > 1:
        a, b = found[0].param, found[1].param
        raise ApiError(
            400,
            f"{a} and {b} both constrain the output; send only one of them",
            param=b,
            code="conflicting_constraints",
        )
    return found[0].output
