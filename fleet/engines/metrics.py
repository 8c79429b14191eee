"""What a server's /metrics (Prometheus text) says fleet needs, whichever engine wrote it: how many requests
it is working on now. llama-server counts them in one gauge; vLLM in two (running, and waiting for room),
each with labels per engine and model."""

from __future__ import annotations

import math

IN_FLIGHT = {
    "llamacpp:requests_processing": "llama-server",
    "vllm:num_requests_running": "vllm",
    "vllm:num_requests_waiting": "vllm",
}
MAX_LINES = 20000  # a host's answer is not trusted: what is past this is not read


def requests_in_flight(metrics: str) -> int | None:
    """The requests in flight, summed over the gauges and label sets that count them; None when the answer
    names none, or gives one that is not a whole count."""
    total, seen = 0.0, False
    for line in metrics.splitlines()[:MAX_LINES]:
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        if name not in IN_FLIGHT:
            continue
        try:
            number = float(value.strip())
        except ValueError:
            return None
        if not math.isfinite(number) or number < 0 or number != int(number):
            return None
        total, seen = total + number, True
    return int(total) if seen else None
