"""The engine's typed errors: raised for each bad input, intact across the AsyncEngine thread hop, mapped to a
status code by the HTTP layer in one place; and no HTTP module tells errors apart by their message text."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from engine_helpers import make_engine, run_all

from loraplane_server import errors as engine_errors
from loraplane_server.engine.async_engine import AsyncEngine
from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.errors import (
    AdapterError,
    AdapterInUseError,
    AdapterLoadError,
    EmptyPromptError,
    EngineError,
    EngineShutdownError,
    InternalEngineError,
    InvalidParameterError,
    InvalidPromptError,
    InvalidRequestError,
    InvalidTokenIdError,
    PinLimitError,
    PromptTooLongError,
    RequestFailedError,
    UnknownAdapterError,
)
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.serving.http.errors import ApiError, api_error, error_body
from loraplane_server.serving.http.generation import Generation
from loraplane_server.serving.http.sampling import make_params
from loraplane_server.serving.http.server_config import ServerConfig
from loraplane_server.serving.http.state import ServerState

HTTP_DIR = Path(__file__).resolve().parents[1] / "server" / "loraplane_server" / "serving" / "http"
MAX_MODEL_LEN = 64
VOCAB = 512  # the tiny models' (conftest.save_tiny)
E = TypeVar("E", bound=BaseException)


def tiny_engine(model_dir: Path, tmp: Path) -> LLMEngine:
    # 4 blocks of 8 tokens: a request asking for more than 32 tokens in all does not fit the KV cache
    return make_engine(
        model_dir,
        block_size=8,
        num_kv_blocks=4,
        max_model_len=MAX_MODEL_LEN,
        max_loras=2,
        disk_cache_dir=str(tmp / "disk-cache"),
    )


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    return tiny_engine(tiny_llama_dir, tmp_path_factory.mktemp("engine-errors"))


def exactly(kind: type[E], error: BaseException | None) -> E:
    """error, which must be of type kind itself (not a subclass, nor a base)."""
    if isinstance(error, kind) and type(error) is kind:
        return error
    raise AssertionError(f"expected {kind.__name__}, got {type(error).__name__}: {error}")


def raised(kind: type[E], fn: Callable[[], object]) -> E:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - what the test inspects
        return exactly(kind, exc)
    raise AssertionError("nothing raised")


# the engine raises each typed error
def test_bad_prompts_raise_typed_errors(engine: LLMEngine) -> None:
    params = SamplingParams(max_new_tokens=4)
    empty = raised(EmptyPromptError, lambda: engine.add_request([], params))
    assert issubclass(EmptyPromptError, ValueError) and empty.param is None
    long = raised(PromptTooLongError, lambda: engine.add_request(list(range(MAX_MODEL_LEN)), params))
    assert (long.num_tokens, long.max_model_len) == (MAX_MODEL_LEN, MAX_MODEL_LEN)
    assert f"context is {MAX_MODEL_LEN} tokens" in str(long)
    bad_id = raised(InvalidTokenIdError, lambda: engine.add_request([1, VOCAB + 3, 2], params))
    assert (bad_id.param, bad_id.token_id, bad_id.vocab_size) == ("prompt", VOCAB + 3, VOCAB)
    assert raised(InvalidTokenIdError, lambda: engine.add_request([1, -1], params)).token_id == -1
    no_tokenizer = raised(InvalidPromptError, lambda: engine.add_request("text needs a tokenizer", params))
    assert no_tokenizer.param == "prompt"
    too_big = raised(InvalidPromptError, lambda: engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=40)))
    assert "do not fit in the KV cache" in str(too_big)
    rid = engine.add_request([1, 2, 3], params, request_id="twice")
    again = raised(InvalidRequestError, lambda: engine.add_request([4, 5], params, request_id="twice"))
    assert again.param == "request_id"
    engine.abort(rid)
    run_all(engine)


def test_bad_sampling_values_raise_invalid_parameter() -> None:
    top_p = raised(InvalidParameterError, lambda: SamplingParams(top_p=0.0))
    assert issubclass(InvalidParameterError, ValueError)
    assert top_p.param == "top_p" and str(top_p) == "top_p=0.0 must be in (0, 1]"
    assert top_p.naming("parameters.top_p") == "parameters.top_p=0.0 must be in (0, 1]"
    assert raised(InvalidParameterError, lambda: SamplingParams(stop=["ok", ""])).param == "stop"


def test_adapter_calls_raise_typed_errors(engine: LLMEngine, tmp_path: Path) -> None:
    unknown = raised(
        UnknownAdapterError, lambda: engine.add_request([1, 2], SamplingParams(max_new_tokens=2), adapter_id="nobody")
    )
    assert unknown.adapter_id == "nobody" and issubclass(UnknownAdapterError, AdapterError)
    raised(UnknownAdapterError, lambda: engine.adapters.set_tier("nobody", "host"))
    assert raised(InvalidRequestError, lambda: engine.adapters.set_tier("nobody", "attic")).param == "tier"
    assert raised(InvalidRequestError, lambda: engine.adapters.prewarm("nobody", "attic")).param == "tier"

    # a request on an adapter that cannot load: the adapter is in use meanwhile, then the request fails typed
    (tmp_path / "empty").mkdir()
    engine.adapters.register("broken", str(tmp_path / "empty"))
    rid = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2), adapter_id="broken")
    in_use = raised(AdapterInUseError, lambda: engine.adapters.unload("broken"))
    assert (in_use.adapter_id, in_use.num_users) == ("broken", 1)
    out = run_all(engine)[rid]
    failure = exactly(AdapterLoadError, out.failure)
    assert out.finish_reason == "error" and failure.adapter_id == "broken" and out.error == str(failure)
    assert str(failure).startswith("adapter 'broken' failed to load: ")
    assert engine.adapters.unload("broken")


def test_pinning_past_the_limit_raises_pin_limit(engine: LLMEngine, tmp_path: Path) -> None:
    for name in ("p1", "p2"):
        engine.adapters.register(name, str(tmp_path / name))
    engine.adapters.prewarm("p1", "none", pinned=True)  # max_loras=2: one pin at most
    try:
        assert raised(PinLimitError, lambda: engine.adapters.prewarm("p2", "none", pinned=True)).param == "pinned"
    finally:
        engine.adapters.unload("p1")
        engine.adapters.unload("p2")


# the thread hop
def test_typed_errors_cross_the_async_engine_intact(tiny_llama_dir: Path, tmp_path: Path) -> None:
    engine = tiny_engine(tiny_llama_dir, tmp_path)
    front = AsyncEngine(engine)

    async def first(prompt: object, adapter_id: str | None = None) -> BaseException:
        stream = front.generate(prompt, SamplingParams(max_new_tokens=2), adapter_id=adapter_id)  # type: ignore[arg-type]
        try:
            await anext(stream)
        except BaseException as exc:  # noqa: BLE001 - what the test inspects
            return exc
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        raise AssertionError("nothing raised")

    async def main() -> None:
        assert str(exactly(EmptyPromptError, await first([]))) == "the prompt is empty"
        bad_id = exactly(InvalidTokenIdError, await first([VOCAB]))
        assert bad_id.param == "prompt" and bad_id.token_id == VOCAB
        assert exactly(UnknownAdapterError, await first([1, 2], adapter_id="nobody")).adapter_id == "nobody"
        broken = exactly(InternalEngineError, await first(None))  # not a prompt: the engine's failure, cause chained
        assert isinstance(broken.__cause__, TypeError)

        mine = AdapterInUseError("a", 2)

        def refuse() -> None:
            raise mine

        with pytest.raises(AdapterInUseError) as got:
            await front.call(refuse)
        assert got.value is mine  # the very object raised on the engine thread
        front.shutdown()
        exactly(EngineShutdownError, await first([1, 2]))
        with pytest.raises(EngineShutdownError):
            await front.call(lambda: None)

    try:
        asyncio.run(main())
    finally:
        front.shutdown()


# the HTTP mapping
STATUS_CASES: list[tuple[EngineError, int, str, str | None]] = [
    (UnknownAdapterError("a"), 404, "adapter_not_found", None),
    (AdapterError("bad adapter_config.json"), 400, "invalid_adapter", None),
    (AdapterInUseError("a", 1), 409, "adapter_in_use", None),
    (PinLimitError("cannot pin"), 409, "pin_limit", "pinned"),
    (InvalidParameterError("top_k=-1 must be >= 0", "top_k"), 422, "invalid_parameter", "top_k"),
    (EmptyPromptError(), 400, "empty_prompt", None),
    (PromptTooLongError(70, 64), 400, "context_length_exceeded", None),
    (InvalidTokenIdError(600, 512), 400, "invalid_token_id", "prompt"),
    (InvalidPromptError("does not fit"), 400, "invalid_prompt", None),
    (InvalidRequestError("tier 'attic'", "tier"), 400, "invalid_request", "tier"),
    (EngineShutdownError(), 503, "shutting_down", None),
    (InternalEngineError("engine step failed"), 500, "engine_error", None),
    # carried by a failed request's output, never raised: the routes answer those themselves
    (RequestFailedError("NaN"), 500, "engine_error", None),
    (AdapterLoadError("a", "gone"), 500, "engine_error", None),
    (EngineError("anything else"), 500, "engine_error", None),
]


@pytest.mark.parametrize(
    ("error", "status", "code", "param"), STATUS_CASES, ids=[type(c[0]).__name__ for c in STATUS_CASES]
)
def test_each_engine_error_has_its_status(error: EngineError, status: int, code: str, param: str | None) -> None:
    api = api_error(error)
    assert (api.status, api.code, api.param) == (status, code, param)
    openai = error_body("/v1/completions", api.status, api.message, api.param, api.code)["error"]
    assert (openai["code"], openai["param"]) == (code, param)
    lorax = error_body("/generate", api.status, api.message, api.param, api.code)
    expected = "overloaded" if status == 503 else "generation" if status >= 500 else "validation"
    assert lorax == {"error": api.message, "error_type": expected}


def test_every_engine_error_has_a_status_case() -> None:
    kinds = {c for c in vars(engine_errors).values() if isinstance(c, type) and issubclass(c, EngineError)}
    assert kinds == {type(error) for error, *_ in STATUS_CASES}


def test_mapping_names_the_api_parameter_and_context() -> None:
    shutdown = api_error(EngineShutdownError())
    assert shutdown.message == "the server is shutting down" and shutdown.headers == {"Retry-After": "1"}
    with pytest.raises(ApiError) as got:
        make_params({"top_p": "parameters.top_p"}, top_p=2.0)
    assert got.value.status == 422 and got.value.param == "parameters.top_p"
    assert got.value.message == "parameters.top_p=2.0 must be in (0, 1]"
    repoint = api_error(AdapterInUseError("a", 1), param="source", prefix="cannot re-point adapter 'a'")
    assert repoint.status == 409 and repoint.param == "source"
    assert repoint.message == "cannot re-point adapter 'a': adapter 'a' is in use by 1 requests"


def test_generation_and_state_map_engine_errors(tiny_llama_dir: Path, tmp_path: Path) -> None:
    engine = tiny_engine(tiny_llama_dir, tmp_path)
    config = ServerConfig(engine=engine.config, admin_token="a-long-admin-token")
    state = ServerState(config)
    state.engine, state.front = engine, AsyncEngine(engine)
    state.lifecycle.mark_ready()

    async def start(ids: list[int], adapter_id: str | None = None, max_new: int = 2) -> ApiError:
        gen = Generation(state, "openai", ids, SamplingParams(max_new_tokens=max_new), adapter_id)
        try:
            await gen.start()
        except ApiError as exc:
            return exc
        finally:
            await gen.close()
        raise AssertionError("started")

    async def main() -> None:
        assert (await start([1, 2], "nobody")).status == 404
        assert (await start([])).code == "empty_prompt"
        assert (await start([1, 2], max_new=40)).code == "invalid_prompt"  # more than the KV cache holds
        assert state.public_error(AdapterLoadError("x", "/srv/secret: no adapter_config.json")) == (
            "adapter 'x' failed to load; an admin can see the reason at GET /v1/adapters/x"
        )
        assert state.public_error(RequestFailedError("NaN")) == "NaN"
        state.close()
        shut = await start([1, 2])
        assert shut.status == 503 and shut.code == "shutting_down"
        with pytest.raises(ApiError) as got:
            await state.call(lambda: None)
        assert got.value.status == 503 and got.value.code == "shutting_down"

    try:
        asyncio.run(main())
    finally:
        state.close()


# no message matching in http/
def _message_matches(tree: ast.AST) -> list[int]:
    """Lines that inspect an exception's text: str(e) or e.args, for an `except ... as e` name, used other than
    passed on whole (a call's argument, an f-string's value); and any `in`/`not in` test against str(...)."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Call) and isinstance(o.func, ast.Name) and o.func.id == "str" for o in operands):
                found.append(node.lineno)
        if not (isinstance(node, ast.ExceptHandler) and node.name):
            continue
        for inner in ast.walk(node):
            text_of_exc = (
                isinstance(inner, ast.Call)
                and isinstance(inner.func, ast.Name)
                and inner.func.id == "str"
                and any(isinstance(a, ast.Name) and a.id == node.name for a in inner.args)
            ) or (
                isinstance(inner, ast.Attribute)
                and inner.attr == "args"
                and isinstance(inner.value, ast.Name)
                and inner.value.id == node.name
            )
            if not text_of_exc:
                continue
            parent = parents[inner]
            passed_on = (isinstance(parent, ast.Call) and inner in parent.args) or isinstance(
                parent, (ast.keyword, ast.FormattedValue)
            )
            if not passed_on:
                found.append(node.lineno)
    return found


def test_the_scan_catches_message_matching() -> None:
    cases = {
        'try:\n    f()\nexcept ValueError as exc:\n    if "shut down" in str(exc):\n        raise\n': True,
        "try:\n    f()\nexcept ValueError as exc:\n    message = str(exc)\n": True,
        'try:\n    f()\nexcept ValueError as exc:\n    ok = str(exc).startswith("unknown")\n': True,
        "try:\n    f()\nexcept ValueError as exc:\n    first = exc.args[0]\n": True,
        'if "x" in str(thing):\n    pass\n': True,
        "try:\n    f()\nexcept ValueError as exc:\n    raise ApiError(400, str(exc), code=c) from exc\n": False,
        'try:\n    f()\nexcept ValueError as exc:\n    log(f"failed: {exc}", detail=str(exc))\n': False,
    }
    for source, matches in cases.items():
        assert bool(_message_matches(ast.parse(source))) is matches, source


def test_no_http_module_matches_on_exception_text() -> None:
    files = sorted(HTTP_DIR.glob("*.py"))
    assert len(files) > 10
    found = {f.name: lines for f in files if (lines := _message_matches(ast.parse(f.read_text())))}
    assert not found, f"type errors by their class, not their message (loraplane_server.errors): {found}"
