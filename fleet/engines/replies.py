"""What one reply says of how it was served, whichever engine served it, and the one rule its decode rate is
read by (decode_rate: the probes and the bench alike).

llama-server's every completion carries `timings` (`prompt_n`, `cache_n`, `predicted_n`,
`predicted_per_second`): prompt tokens processed, prompt tokens taken from its cache, tokens generated and
its own decode rate; with a draft model, also the tokens drafted and how many of them the target accepted
(`draft_n`, `draft_n_accepted`). vLLM has no `timings`; its `usage` says the same counts (`prompt_tokens`,
`prompt_tokens_details.cached_tokens`, `completion_tokens`) and no rate, which the client then measures from
the tokens' arrival. A field a reply lacks or gives in another type reads as absent, never as a crash, and so
does a number no reply means: not finite (JSON's 1e400 reads as infinity), negative, or past any count a reply
can hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MOST_COUNT = 1 << 40  # tokens: far past any context, far below where a float stops holding an integer
MOST_RATE = 1e7  # tokens a second: a reply's claimed rate past this is no rate


@dataclass(frozen=True)
class Timings:
    """What one reply says of its serving; 0 for a count it lacks, None for a rate it lacks."""

    prompt_n: int = 0  # prompt tokens processed for this request
    cache_n: int = 0  # prompt tokens taken from the cache
    predicted_n: int = 0  # tokens generated
    predicted_per_second: float | None = None  # the server's own decode rate for this reply
    draft_n: int = 0  # tokens a draft model proposed for this reply
    draft_n_accepted: int = 0  # of those, the ones the target model accepted

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
            predicted_per_second=float(rate) if _number(rate) and 0 < rate <= MOST_RATE else None,
            draft_n=(drafted := _count(t.get("draft_n"))),
            draft_n_accepted=min(_count(t.get("draft_n_accepted")), drafted),
        )


DECODE_SLACK = 2.0  # how far a reply's stated decode may exceed what the client saw arrive


def decode_rate(served: Timings, delivered_tok_s: float | None, whole_tok_s: float | None) -> float | None:
    """One reply's decode rate, or None when the reply cannot say it.

    A server that states its rate (llama-server's `timings`): that, never more than DECODE_SLACK times what
    arrived (`delivered_tok_s`, from the first token to the last): a host cannot flatter its decode much past
    what it delivered; the slack covers the client's own lag on a busy machine.

    A server that states none (vLLM: its `usage` counts alone): its tokens over the reply's whole time, from the
    request to the last byte (`whole_tok_s`), a bound below its decode that the prefill and any queueing lower
    a little. Never the tokens' arrival: a server or a client busy elsewhere sends or reads a reply it decoded
    over seconds in one piece (vLLM's CPU build under load sent its headers and all 200 tokens within 3 ms, 3
    replies in 5), and arrival then reads 50,000-170,000 tok/s of a healthy host, which made the thermal probe
    judge it collapsed."""
    claimed = served.predicted_per_second
    if claimed is not None:
        return claimed if delivered_tok_s is None else min(claimed, delivered_tok_s * DECODE_SLACK)
    return whole_tok_s


def count(value: object) -> int | None:
    """A count a host sent, or None when it is none: a whole number from 0 to MOST_COUNT."""
    if not _number(value) or not 0 <= value <= MOST_COUNT or value != int(value):  # type: ignore[operator]
        return None
    return int(value)  # type: ignore[arg-type]


USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def usage_counts(usage: object) -> dict[str, Any]:
    """An OpenAI `usage` as a host sent it, with only its counts that are counts (fleet reads no other field)."""
    if not isinstance(usage, dict):
        return {}
    kept: dict[str, Any] = {k: n for k in USAGE_COUNTS if (n := count(usage.get(k))) is not None}
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and (cached := count(details.get("cached_tokens"))) is not None:
        kept["prompt_tokens_details"] = {"cached_tokens": cached}
    return kept


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: object) -> int:
    return count(value) or 0
