"""Several generations answering one OpenAI request (n > 1, or a batch of prompts), started and closed together."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from loraplane_server.http.generation import Generation, TokenEvent


async def start_all(gens: list[Generation]) -> None:
    """Start every generation; if any fails, close them all and raise the first error."""
    results = await asyncio.gather(*(g.start() for g in gens), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await close_all(gens)
        raise errors[0]


async def close_all(gens: list[Generation]) -> None:
    for g in gens:
        await g.close()


async def merged_events(gens: list[Generation]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """(choice index, event) from every generation, in arrival order."""
    if len(gens) == 1:
        async for ev in gens[0].events():
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, TokenEvent | None]] = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for ev in gen.events():
                queue.put_nowait((i, ev))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
