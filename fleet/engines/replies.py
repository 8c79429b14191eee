"""What one reply says of how it was served, whichever engine served it.

llama-server's every completion carries `timings` (`prompt_n`, `cache_n`, `predicted_n`,
`predicted_per_second`): prompt tokens processed, prompt tokens taken from its cache, tokens generated and
its own decode rate. vLLM has no `timings`; its `usage` says the same counts (`prompt_tokens`,
`prompt_tokens_details.cached_tokens`, `completion_tokens`) and no rate, which the client then measures. A
field a reply lacks or gives in another type reads as absent, never as a crash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Timings:
    """What one reply says of its serving; 0 for a count it lacks, None for a rate it lacks."""

    prompt_n: int = 0  # prompt tokens processed for this request
    cache_n: int = 0  # prompt tokens taken from the cache
    predicted_n: int = 0  # tokens generated
    predicted_per_second: float | None = None  # the server's own decode rate for this reply

    @classmethod
    def of(cls, timings: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> Timings:
        """From llama-server's `timings`; without them, from the OpenAI `usage` vLLM reports."""
        t = timings if isinstance(timings, dict) else {}
        if not t and isinstance(usage, dict):
            details = usage.get("prompt_tokens_details")
            cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
            prompt = _count(usage.get("prompt_tokens"))
            return cls(
                prompt_n=max(prompt - cached, 0),
                cache_n=min(cached, prompt),
                predicted_n=_count(usage.get("completion_tokens")),
            )
        rate = t.get("predicted_per_second")
        return cls(
            prompt_n=_count(t.get("prompt_n")),
            cache_n=_count(t.get("cache_n")),
            predicted_n=_count(t.get("predicted_n")),
            predicted_per_second=float(rate) if isinstance(rate, int | float) and rate > 0 else None,
        )


def _count(value: object) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0 else 0
