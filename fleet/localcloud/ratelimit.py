"""vast.ai's rate limits, as its API reference documents them (see docs/vast-fidelity.md).

A limit is a minimum interval between requests per endpoint and identity, which vast.ai's reference
determines by "bearer token + session user + `api_key` query param + client IP"; search is ten a minute,
and a daily search quota stands behind it. Where the documents leave a choice open, the harder one is
taken: the identity is the client's address alone (two keys, or every process of one account, calling from
one address share each limit), a refused request counts as a request (it restarts the interval), a refused
create adds the documented penalty, and an endpoint the reference gives no limit gets one second.

The 429 bodies vary as on vast.ai: plain text, `{"detail": ...}`, or the common error shape; a
`Retry-After` header, fractional, comes with some of them and not others.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

Body = Literal["text", "detail", "error"]


@dataclass(frozen=True)
class Limit:
    interval_s: float
    penalty_s: float = 0.0  # a refused request pushes the next allowed one this far out
    body: Body = "text"
    per_minute: int = 0  # a window limit instead of an interval (search)


# (method, route template without its trailing slash) -> limit; from vast.ai's OpenAPI `x-rate-limit`.
LIMITS: dict[tuple[str, str], Limit] = {
    ("POST", "/api/v0/bundles"): Limit(0.0, per_minute=10),
    ("PUT", "/api/v0/asks/{id}"): Limit(4.5, penalty_s=12.0, body="detail"),
    ("GET", "/api/v0/instances/{id}"): Limit(2.0, body="detail"),
    ("GET", "/api/v1/instances"): Limit(1.0, body="detail"),
    ("DELETE", "/api/v0/instances/{id}"): Limit(3.0, body="error"),
    ("PUT", "/api/v0/instances/{id}"): Limit(1.0, body="error"),
    ("POST", "/api/v0/ssh"): Limit(1.0),
    ("GET", "/api/v0/charges"): Limit(1.0),
}
DEFAULT_LIMIT = Limit(1.0)
DAILY_SEARCH_QUOTA = 100_000  # the SDK knows the quota exists; its size is not published
SEARCH = ("POST", "/api/v0/bundles")


@dataclass
class Refusal:
    status: int
    body: Any  # a str (plain text) or a JSON object
    headers: dict[str, str]


@dataclass
class RateLimiter:
    daily_search_quota: int = DAILY_SEARCH_QUOTA
    scale: float = 1.0  # 0 turns every limit off (the kind cloud)
    _next_allowed: dict[tuple, float] = field(default_factory=dict)
    _windows: dict[tuple, deque[float]] = field(default_factory=dict)
    _searches: dict[tuple, tuple[str, int]] = field(default_factory=dict)  # identity -> (UTC day, count)
    _refusals: int = 0
    refused: int = 0  # 429s answered, for tests and benches

    def set_search_quota_left(self, left: int) -> None:
        """Fault: this many searches remain today for every identity (the next one past it is refused)."""
        self.daily_search_quota = left
        self._searches.clear()

    def check(self, method: str, route: str, identity: tuple[str, str], ip: str) -> Refusal | None:
        """None when the request may be served now; else the 429 to answer."""
        key = (method, route.rstrip("/") or route)
        if key == SEARCH:
            quota = self._check_quota(identity, ip)
            if quota:
                return quota
        if self.scale <= 0:
            return None
        limit = LIMITS.get(key, DEFAULT_LIMIT)
        who = (key, ip)
        now = time.monotonic()
        if limit.per_minute:
            window = self._windows.setdefault(who, deque())
            while window and window[0] <= now - 60.0 * self.scale:
                window.popleft()
            window.append(now)  # a refused search counts too
            if len(window) > limit.per_minute:
                return self._refuse(limit, window[0] + 60.0 * self.scale - now)
            return None
        interval = limit.interval_s * self.scale
        next_allowed = self._next_allowed.get(who, 0.0)
        if now < next_allowed:
            self._next_allowed[who] = max(next_allowed, now + max(interval, limit.penalty_s * self.scale))
            return self._refuse(limit, self._next_allowed[who] - now)
        self._next_allowed[who] = now + interval
        return None

    def _check_quota(self, identity: tuple[str, str], ip: str) -> Refusal | None:
        day = datetime.now(UTC).strftime("%Y-%m-%d")
        who = (*identity, ip)
        seen_day, count = self._searches.get(who, (day, 0))
        count = count + 1 if seen_day == day else 1
        self._searches[who] = (day, count)
        if count <= self.daily_search_quota:
            return None
        self.refused += 1
        midnight = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0) + timedelta(days=1)
        return Refusal(
            429,
            {"success": False, "error": "search_quota_exceeded", "msg": "Daily search quota exceeded."},
            {"X-RateLimit-Reset": str(int(midnight.timestamp()))},
        )

    def _refuse(self, limit: Limit, wait_s: float) -> Refusal:
        self.refused += 1
        self._refusals += 1
        threshold = f"{limit.interval_s:.1f}" if limit.interval_s else f"{limit.per_minute}/min"
        message = f"API requests too frequent endpoint threshold={threshold}"
        body: Any
        if limit.body == "detail":
            body = {"detail": message}
        elif limit.body == "error":
            body = {"success": False, "error": "rate_limit_exceeded", "msg": message}
        else:
            body = message
        # vast.ai's reference says it sets no Retry-After; some answers carry one all the same.
        headers = {"Retry-After": f"{max(wait_s, 0.1):.1f}"} if self._refusals % 3 == 0 else {}
        return Refusal(429, body, headers)
