"""Client-side pacing: stay inside vast.ai's rate limits instead of learning them from 429s.

vast.ai enforces a minimum interval between requests per endpoint and API key (and ten searches a
minute per client IP). fleet spaces its own requests by the same table, one endpoint at a time, and
measures each interval from the moment the previous answer arrived: the server saw that request
earlier, so the server-side interval is never shorter than ours. Every `VastMarket` of a process talks
through one pacer per (server, key), so the daemon's jobs and the CLI's commands share it.

Every process of an install also takes each call's turn from one `Budget` in the record (fleet/core/marketpace.py),
timed the same way. A 429 still happens when another install or tool uses the same key; `penalize` then pushes
the endpoint's next slot by `Retry-After` or the endpoint's own interval (its penalty for create).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Pace:
    interval_s: float
    per_minute: int = 0
    penalty_s: float = 0.0  # how long the server locks an endpoint after a refused request


# Margins of a tenth of a second above vast.ai's published thresholds (docs/vast-fidelity.md).
PACES: dict[str, Pace] = {
    "search": Pace(0.0, per_minute=10),
    "create": Pace(4.6, penalty_s=12.1),
    "show": Pace(2.1),
    "list": Pace(1.1),
    "destroy": Pace(3.1),
    "manage": Pace(1.1),
    "ssh_keys": Pace(1.1),
    "ssh_key_create": Pace(1.1),
    "charges": Pace(1.1),
}
DEFAULT_PACE = Pace(1.1)


class Budget(Protocol):
    """The install's one budget of calls, which every process of it draws on (vast.ai counts an identity's calls,
    not a process's): a turn per call, held while the request is in flight."""

    async def claim(self, endpoint: str, pace: Pace) -> tuple[float | None, float]:
        """(a token, 0.0): send now and `release` the token when the answer is in; (None, seconds): ask again
        after that long."""
        ...

    async def release(self, endpoint: str, pace: Pace, token: float) -> None:
        """The answer is in: the endpoint's next call may start `pace.interval_s` from now."""
        ...


@dataclass
class Counters:
    """What a process asked of the marketplace: calls and 429s by endpoint, seconds spent waiting."""

    calls: dict[str, int] = field(default_factory=dict)
    rate_limited: dict[str, int] = field(default_factory=dict)
    retries: dict[str, int] = field(default_factory=dict)
    waited_s: float = 0.0
    last_rate_limited_at: float | None = None  # time.monotonic() of the latest 429

    def rate_limited_since(self, started: float) -> bool:
        """Whether the marketplace refused a call (429) since `started` (time.monotonic())."""
        return self.last_rate_limited_at is not None and self.last_rate_limited_at >= started

    def total_calls(self) -> int:
        return sum(self.calls.values())

    def total_rate_limited(self) -> int:
        return sum(self.rate_limited.values())


class Pacer:
    def __init__(self, paces: dict[str, Pace] | None = None) -> None:
        self._paces = paces or PACES
        self._default = DEFAULT_PACE
        self._locks: dict[tuple[int, str], asyncio.Lock] = {}  # per event loop: a lock belongs to one
        self._next: dict[str, float] = {}
        self._window: dict[str, deque[float]] = {}
        self.counters = Counters()

    def pace(self, endpoint: str) -> Pace:
        return self._paces.get(endpoint, self._default)

    @contextmanager
    def scaled(self, factor: float) -> Iterator[None]:
        """Inside the block every endpoint's interval and penalty are `factor` times theirs, and its calls a
        minute 1/`factor` times (the install's budget in the record takes the same paces). For a bench that
        brings many simulated hosts up against the kind local cloud, which refuses no rate, before it measures
        at vast.ai's paces; vast.ai would refuse the calls, each refusal locking the endpoint for longer."""
        if not 0 < factor <= 1:
            raise ValueError(f"a pace scale is in (0, 1], not {factor}")

        def scale(p: Pace) -> Pace:
            per_minute = math.ceil(p.per_minute / factor) if p.per_minute else 0
            return Pace(p.interval_s * factor, per_minute, p.penalty_s * factor)

        paces, default = self._paces, self._default
        self._paces, self._default = {k: scale(p) for k, p in paces.items()}, scale(default)
        try:
            yield
        finally:
            self._paces, self._default = paces, default

    @asynccontextmanager
    async def slot(self, endpoint: str) -> AsyncIterator[None]:
        """Hold the endpoint for one request: wait for its next slot, and start the next interval when
        the answer is in."""
        lock = self._locks.setdefault((id(asyncio.get_running_loop()), endpoint), asyncio.Lock())
        async with lock:
            pace = self.pace(endpoint)
            wait = self._next.get(endpoint, 0.0) - time.monotonic()
            if pace.per_minute:
                window = self._window.setdefault(endpoint, deque())
                while window and window[0] <= time.monotonic() - 60.0:
                    window.popleft()
                if len(window) >= pace.per_minute:
                    wait = max(wait, window[0] + 60.0 - time.monotonic())
            if wait > 0:
                self.counters.waited_s += wait
                await asyncio.sleep(wait)
            self.counters.calls[endpoint] = self.counters.calls.get(endpoint, 0) + 1
            try:
                yield
            finally:
                now = time.monotonic()
                self._next[endpoint] = max(self._next.get(endpoint, 0.0), now + pace.interval_s)
                if pace.per_minute:
                    self._window.setdefault(endpoint, deque()).append(now)

    def penalize(self, endpoint: str, retry_after_s: float | None, attempt: int) -> float:
        """After a 429: how long until the endpoint's next slot. Retry-After when given; else the endpoint's
        penalty or interval, growing with each refusal in a row up to four times that, with jitter so that
        two processes sharing a key fall out of step."""
        self.counters.rate_limited[endpoint] = self.counters.rate_limited.get(endpoint, 0) + 1
        self.counters.last_rate_limited_at = time.monotonic()
        pace = self.pace(endpoint)
        if retry_after_s is not None:
            wait = retry_after_s + 0.05
        else:
            base = max(pace.penalty_s, pace.interval_s, 60.0 / pace.per_minute if pace.per_minute else 0.0, 1.0)
            wait = min(base * 2 ** max(attempt - 1, 0), 4 * base) * random.uniform(1.0, 1.5)
        return self.defer(endpoint, wait)

    def defer(self, endpoint: str, wait_s: float) -> float:
        """The endpoint's next slot is at least `wait_s` from now."""
        self._next[endpoint] = max(self._next.get(endpoint, 0.0), time.monotonic() + wait_s)
        return wait_s

    def retried(self, endpoint: str) -> None:
        self.counters.retries[endpoint] = self.counters.retries.get(endpoint, 0) + 1


_pacers: dict[tuple[str, str], Pacer] = {}


def shared_pacer(url: str, api_key: str) -> Pacer:
    """The process's pacer for this server and key (the key is only hashed into the lookup)."""
    who = (url, hashlib.sha256(api_key.encode()).hexdigest())
    if who not in _pacers:
        _pacers[who] = Pacer()
    return _pacers[who]
