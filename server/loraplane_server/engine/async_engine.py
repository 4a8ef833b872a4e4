"""An asyncio front for the engine: one background thread steps it; each request streams.

The engine is not thread-safe, so only the stepping thread touches it: adds and aborts are
queued and applied between steps. A consumer that stops iterating (a client gone away) aborts
its request at once, which frees its KV blocks at the next step boundary.

`AsyncEngine.build` also loads the engine on the stepping thread, so that all of its torch work runs on
one thread. torch's CPU ops run on OpenMP, and libgomp keeps one thread team per thread that ever ran a
parallel region, for that thread's life. Once the teams' threads outnumber the cores, every worker stops
spinning between regions and sleeps (its "throttled" spin count, 100, whatever OMP_WAIT_POLICY says), so
every parallel region pays a futex wake: a one-row bf16 linear went from 14 us to 34-45 us, and a
70 -> 10 request over HTTP from ~103 ms (the engine stepped in process) to ~150-170 ms when the engine was
loaded on a worker thread and stepped on another. Threads that touch torch besides this one (the adapter
loaders) run their ops on one thread (`torch_threads.serial_torch_thread`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from loraplane_server.engine.input_processor import CheckedPrompt
from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.errors import EngineError, EngineShutdownError, InternalEngineError
from loraplane_server.request_output import RequestOutput
from loraplane_server.sampling_params import SamplingParams


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int] | CheckedPrompt
    params: SamplingParams
    adapter_id: str | None
    queue: asyncio.Queue[RequestOutput | BaseException]
    loop: asyncio.AbstractEventLoop


T = TypeVar("T")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, start: bool = True) -> None:
        """Step engine on a new thread; start=False: the caller's thread is the stepping one and runs
        _loop itself (build does)."""
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._streams: dict[str, _Add] = {}
        self._stopped = False
        self._ids = 0
        if start:
            self._thread = threading.Thread(target=self._loop, name="engine-step", daemon=True)
            self._thread.start()
        else:
            self._thread = threading.current_thread()

    @classmethod
    def build(cls, factory: Callable[[], LLMEngine]) -> concurrent.futures.Future[AsyncEngine]:
        """Call factory on a new thread and step the engine it returns on that same thread; the future
        holds the AsyncEngine once the engine is built, or factory's exception (and the thread ends)."""
        future: concurrent.futures.Future[AsyncEngine] = concurrent.futures.Future()

        def run() -> None:
            try:
                front = cls(factory(), start=False)
            except BaseException as exc:  # noqa: BLE001 - to the caller, which reports it
                future.set_exception(exc)
                return
            future.set_result(front)
            front._loop()

        threading.Thread(target=run, name="engine-step", daemon=True).start()
        return future

    async def generate(
        self,
        prompt: str | list[int] | CheckedPrompt,
        params: SamplingParams,
        request_id: str | None = None,
        adapter_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step that advanced it (its deltas); the last one is
        finished and also holds the whole text, token ids and logprobs.

        Raises the engine's own error, as add_request raised it (an EngineError), before the first yield;
        EngineShutdownError after shutdown(); InternalEngineError if the engine itself failed.
        """
        with self._lock:
            self._ids += 1
            request_id = request_id or f"areq-{self._ids}"
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._submit(_Add(request_id, prompt, params, adapter_id, queue, asyncio.get_running_loop()))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the stepping thread between two steps (engine state is not thread-safe)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._stopped:
                raise EngineShutdownError()
            self._calls.append((fn, future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    def _submit(self, add: _Add) -> None:
        with self._lock:
            if self._stopped:
                raise EngineShutdownError()
            self._adds.append(add)
        self._wake.set()

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    # the stepping thread
    def _loop(self) -> None:
        while True:
            self._apply_pending()
            if self._stopped and not self._streams:
                return
            if not self.engine.has_unfinished:
                for out in self.engine.poll_adapters():  # finish prewarms while idle
                    self._deliver(out)
                self._wake.wait(timeout=0.2)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail every stream, keep the thread alive
                self._fail_all(exc)
                continue
            for out in outputs:
                self._deliver(out)

    def _apply_pending(self) -> None:
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
            calls, self._calls = self._calls, []
        for fn, future in calls:
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - the caller gets it
                future.set_exception(exc)
        for add in adds:
            try:
                self.engine.add_request(add.prompt, add.params, add.request_id, add.adapter_id)
                self._streams[add.request_id] = add
            except EngineError as exc:  # the request's own error: to its caller as raised
                add.loop.call_soon_threadsafe(add.queue.put_nowait, exc)
            except Exception as exc:  # noqa: BLE001 - that request fails, the engine thread lives on
                error = _internal(f"could not add the request: {exc}", exc)
                add.loop.call_soon_threadsafe(add.queue.put_nowait, error)
        for request_id in aborts:
            self.engine.abort(request_id)

    def _deliver(self, out: RequestOutput) -> None:
        add = self._streams.get(out.request_id)
        if add is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        add.loop.call_soon_threadsafe(add.queue.put_nowait, out)

    def _fail_all(self, exc: Exception) -> None:
        for request_id, add in list(self._streams.items()):
            self.engine.abort(request_id)
            add.loop.call_soon_threadsafe(add.queue.put_nowait, _internal(f"engine step failed: {exc}", exc))
        self._streams.clear()


def _internal(message: str, cause: Exception) -> InternalEngineError:
    error = InternalEngineError(message)
    error.__cause__ = cause
    return error
