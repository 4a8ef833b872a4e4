"""Engine behaviour on the real built-in model: seeds, stops, aborts, limits, the asyncio front."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from engine_helpers import make_engine

from loraplane_server.engine.async_engine import AsyncEngine
from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> LLMEngine:
    return make_engine(smollm2_dir, num_kv_blocks=256, max_model_len=512)


@pytest.fixture(autouse=True)
def blocks_return(engine: LLMEngine):
    free0 = engine.block_manager.num_free_blocks
    yield
    assert not engine.has_unfinished
    assert engine.block_manager.num_free_blocks == free0


def test_builtin_model_answers(engine: LLMEngine) -> None:
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    out = engine.generate([prompt], SamplingParams(max_new_tokens=30))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ends on <|im_end|>


def test_seeded_request_same_alone_and_in_batch(engine: LLMEngine) -> None:
    params = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=42)
    prompt = "Tell me a story about a dragon."
    alone = engine.generate([prompt], params)[0].token_ids
    others = [f"Write about topic number {i}." for i in range(15)]
    other_params = [
        SamplingParams(max_new_tokens=10 + i, temperature=1.0, seed=None if i % 2 else i) for i in range(15)
    ]
    batch = engine.generate(others[:7] + [prompt] + others[7:], other_params[:7] + [params] + other_params[7:])
    assert batch[7].token_ids == alone
    assert len({tuple(o.token_ids) for o in batch}) > 1
    different_seed = engine.generate([prompt], SamplingParams(**{**params.__dict__, "seed": 7}))[0].token_ids
    assert different_seed != alone


def test_stop_string_and_stop_token(engine: LLMEngine) -> None:
    greedy = engine.generate(["The capital of France is"], SamplingParams(max_new_tokens=20))[0]
    word = greedy.text.split()[1]
    stopped = engine.generate(["The capital of France is"], SamplingParams(max_new_tokens=20, stop=[word]))[0]
    assert stopped.finish_reason == "stop"
    assert word not in stopped.text and greedy.text.startswith(stopped.text)
    tok = greedy.token_ids[3]
    by_id = engine.generate(["The capital of France is"], SamplingParams(max_new_tokens=20, stop_token_ids=[tok]))[0]
    first = greedy.token_ids.index(tok)
    assert by_id.token_ids == greedy.token_ids[: first + 1] and by_id.finish_reason == "stop"


def test_streamed_deltas_add_up_to_the_final_output(engine: LLMEngine) -> None:
    prompt = "Caf\u00e9 in Tokyo \u6771\u4eac: list three drinks, one per line."
    greedy = engine.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))[0].text
    lines = greedy.split("\n")
    stop = next((line[1:4] for line in lines[1:] if len(line) > 4), greedy[len(greedy) // 2 : len(greedy) // 2 + 3])
    for params in (
        SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=True),
        SamplingParams(max_new_tokens=24, ignore_eos=True, stop=[stop]),  # cut part-way, as greedy.find(stop)
        SamplingParams(max_new_tokens=24, ignore_eos=True, stop=[greedy[:2]]),  # right at the start
    ):
        rid = engine.add_request(prompt, params)
        text, ids, logprobs = "", [], []
        while engine.has_unfinished:
            for out in engine.step():
                text += out.delta_text
                ids += out.delta_token_ids
                logprobs += out.delta_logprobs
                assert out.finished or (not out.text and not out.token_ids)  # the whole output only at the end
        assert out.request_id == rid and out.finished
        assert (text, ids, logprobs) == (out.text, out.token_ids, out.logprobs)
        assert out.text == (greedy if not params.stop else greedy[: greedy.find(params.stop[0])])
        assert len(out.logprobs) == (24 if params.logprobs else 0)


def test_max_new_tokens_and_logprobs(engine: LLMEngine) -> None:
    out = engine.generate(["Count: one, two,"], SamplingParams(max_new_tokens=7, ignore_eos=True, logprobs=True))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert len(out.logprobs) == 7 and all(lp <= 0.0 for lp in out.logprobs)


def test_abort_frees_blocks(engine: LLMEngine) -> None:
    ids = [
        engine.add_request("Write a long essay about the sea.", SamplingParams(max_new_tokens=200)) for _ in range(4)
    ]
    waiting = engine.add_request("never scheduled", SamplingParams(max_new_tokens=5))
    engine.abort(waiting)
    finished: dict[str, str | None] = {}
    for _ in range(3):
        finished.update((o.request_id, o.finish_reason) for o in engine.step() if o.finished)
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    assert engine.abort(ids[0]) and engine.abort(ids[1])
    assert not engine.abort(ids[0])
    num_generated = 0  # ids[2]'s tokens so far
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
            if out.request_id == ids[2]:
                num_generated += len(out.delta_token_ids)
                if num_generated == 5:
                    engine.abort(ids[2])
    assert finished[ids[0]] == finished[ids[1]] == finished[ids[2]] == finished[waiting] == "abort"
    assert finished[ids[3]] == "length"


def test_bad_requests_are_refused(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="context is 512"):
        engine.add_request(list(range(600)), SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.add_request([1, 2, 10**7], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    out = engine.generate(["Still fine?"], SamplingParams(max_new_tokens=3))[0]
    assert out.finished


def test_context_limit_ends_generation(engine: LLMEngine) -> None:
    out = engine.generate([list(range(100, 600))], SamplingParams(max_new_tokens=100, ignore_eos=True))[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"


def test_async_streams_and_cancel(engine: LLMEngine) -> None:
    sync = engine.generate(["Hello"], SamplingParams(max_new_tokens=6, ignore_eos=True))[0].token_ids
    front = AsyncEngine(engine)  # from here on only its thread may step the engine

    async def stream(prompt: str, n: int) -> list[list[int]]:
        return [
            o.delta_token_ids async for o in front.generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
        ]

    async def cancel_after(k: int) -> int:
        seen = 0
        async for _ in front.generate("A long story:", SamplingParams(max_new_tokens=300, ignore_eos=True)):
            seen += 1
            if seen == k:
                break
        return seen

    async def main() -> tuple[list[list[list[int]]], int]:
        got = await asyncio.gather(stream("Hello", 6), stream("Bonjour", 9), cancel_after(3))
        return list(got[:2]), got[2]  # type: ignore[return-value]

    try:
        (a, b), seen = asyncio.run(main())
        assert [len(x) for x in a] == [1] * 6 and [len(x) for x in b] == [1] * 9
        assert seen == 3
        assert [t for x in a for t in x] == sync

        async def bad() -> None:
            async for _ in front.generate([], SamplingParams()):
                pass

        with pytest.raises(ValueError, match="empty"):
            asyncio.run(bad())
    finally:
        front.shutdown()
