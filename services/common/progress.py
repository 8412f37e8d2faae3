"""Bounded concurrent work with a progress bar (evaluation's router and judge passes)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


async def gather_bounded(fn: Callable[[T], Awaitable[R]], items: Sequence[T], *, concurrency: int, desc: str,
                         unit: str, progress: bool = True) -> list[R]:
    """``fn`` of each item, at most ``concurrency`` in flight, results in the items' order."""
    from tqdm import tqdm

    gate = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(items), desc=desc, unit=unit, disable=not progress)

    async def one(item: T) -> R:
        async with gate:
            result = await fn(item)
        bar.update()
        return result

    try:
        return list(await asyncio.gather(*(one(item) for item in items)))
    finally:
        bar.close()
