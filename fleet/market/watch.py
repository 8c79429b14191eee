"""One listing for every instance in flight, instead of a show per host.

Bring-ups (and anything else waiting on instances) register their ids; one poller lists them all at
once, every second at first and less often as the youngest of them ages (vast.ai's boot takes
minutes), and hands each waiter a fresh snapshot. An instance missing from a snapshot is either not
yet visible (vast.ai's read path lags create) or gone; the waiter decides which from what it knows.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from fleet.market import Instance, Market, MarketError

MIN_INTERVAL_S = 1.0  # vast.ai's listing allows one request a second per key
AGE_SHARE = 0.25  # poll at a quarter of the youngest instance's age: boot phases last long or short


@dataclass(frozen=True)
class Snapshot:
    generation: int
    at: float  # time.monotonic() when the listing answered
    instances: dict[int, Instance]


class InstanceWatch:
    def __init__(self, market: Market, max_interval_s: float = 10.0) -> None:
        self._market = market
        self._max_interval_s = max(max_interval_s, MIN_INTERVAL_S)
        self._since: dict[int, float] = {}  # id -> when it was registered
        self._latest = Snapshot(0, 0.0, {})
        self._error: MarketError | None = None
        self._changed = asyncio.Condition()
        self._joined = asyncio.Event()  # a new id cuts the poller's sleep short
        self._task: asyncio.Task | None = None

    @contextlib.asynccontextmanager
    async def watching(self, instance_id: int):  # type: ignore[no-untyped-def]
        """Keep `instance_id` in the listing while the block runs."""
        self._since[instance_id] = time.monotonic()
        self._joined.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._poll(), name="instance-watch")
        try:
            yield self
        finally:
            self._since.pop(instance_id, None)

    async def next(self, after_generation: int) -> Snapshot:
        """The first snapshot newer than `after_generation`; raises the listing's error if it failed."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._latest.generation > after_generation or self._error)
            if self._error is not None and self._latest.generation <= after_generation:
                raise self._error
            return self._latest

    def _interval(self) -> float:
        if not self._since:
            return self._max_interval_s
        youngest = time.monotonic() - max(self._since.values())
        return min(self._max_interval_s, max(MIN_INTERVAL_S, AGE_SHARE * youngest))

    async def _poll(self) -> None:
        polled = time.monotonic()  # a new instance is not listed at once: wait an interval first
        while self._since:
            while self._since:  # a newcomer shortens the wait to what its own age asks for
                self._joined.clear()
                remaining = polled + self._interval() - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(self._joined.wait(), remaining)
                except TimeoutError:
                    break
            if not self._since:
                return
            ids = sorted(self._since)
            try:
                found = await self._market.instances(ids)
                error = None
            except MarketError as e:
                found, error = {}, e
            polled = time.monotonic()
            async with self._changed:
                if error is None:
                    self._latest = Snapshot(self._latest.generation + 1, polled, found)
                    self._error = None
                else:
                    self._error = error
                self._changed.notify_all()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
