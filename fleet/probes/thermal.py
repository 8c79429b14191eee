"""thermal: does the card keep its decode speed under sustained load (DOMAIN.md "Heat")?

A rented 3090 fell from 218.6 to 97.6 tok/s within 24 minutes with no throttle flag set. So: drive
sustained decode load on every slot but one and, without ever pausing it, measure the decode rate of one
more caller on the last slot every interval (the same batch each time, so the rates compare); sample the
card with nvidia-smi over SSH (hosts without it still get the rate part), and judge by the share (rate now /
rate at the start) and temperature limits, never by one absolute rate. (The load used to pause for each
measurement: on an H200 that left the card idle half the time, 33% mean utilisation, and heat never built.)
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import asyncssh
import httpx

from fleet.core.errors import FleetError
from fleet.engines.metrics import requests_in_flight
from fleet.probes import ProbeResult
from fleet.probes.gpu import QUERY, GpuParseError, GpuSample, parse_query_csv
from fleet.probes.server import Server, bounded
from fleet.probes.stream import Connection, StreamError

LOAD_WAIT_S = 30.0  # how long the load may take to be decoding before the first one-caller rate
LOAD_PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
RATE_ATTEMPTS = 3  # replies asked for one sample when a reply gives no rate


@dataclass(frozen=True)
class RatePoint:
    t_s: float
    tokens_per_s: float


@dataclass(frozen=True)
class CardPoint:
    t_s: float
    sample: GpuSample


@dataclass
class LoadCount:
    """What the load callers achieved: a probe whose load never reached the card proves nothing."""

    callers: int
    ok: int = 0
    failed: int = 0
    last_error: str | None = None


class ThermalError(FleetError):
    """The thermal probe could not take a measurement (the server refused its one-caller request)."""

    prefix = "thermal probe"


def judge_thermal(
    rates: list[RatePoint],
    cards: list[CardPoint],
    min_share: float,
    max_gpu_c: float,
    max_memory_c: float,
    load: LoadCount | None = None,
) -> ProbeResult:
    """Verdict by decode share (the one-caller rate late in the run / early in it) and card temperatures,
    provided the load reached the card: most of the load callers' requests must have been served."""
    if load is not None and load.callers and load.failed >= max(load.ok, 1):
        return ProbeResult(
            "thermal",
            False,
            f"the load never reached the card: {load.failed} of {load.ok + load.failed} load requests failed"
            f" ({load.last_error or 'no reply'})",
            {"load": asdict(load)},
        )
    if len(rates) < 2 or rates[0].tokens_per_s <= 0:
        return ProbeResult("thermal", False, "too few one-caller measurements to judge", {"rates": len(rates)})
    # Judge the last third of the run against the first third, by medians: one noisy measurement
    # (another process on the host, a network hiccup) moves neither.
    third = max(len(rates) // 3, 1)
    first = statistics.median(r.tokens_per_s for r in rates[:third])
    last = statistics.median(r.tokens_per_s for r in rates[-third:])
    shares = [r.tokens_per_s / first for r in rates]
    shares[-1] = last / first
    gpu_c = [c.sample.gpu_c for c in cards if c.sample.gpu_c is not None]
    mem_c = [c.sample.memory_c for c in cards if c.sample.memory_c is not None]
    metrics: dict[str, Any] = {
        "decode_rates": [round(r.tokens_per_s, 1) for r in rates],
        "decode_share": round(shares[-1], 3),
        "decode_share_min": round(min(shares), 3),
        "gpu_c_max": max(gpu_c) if gpu_c else None,
        "memory_c_max": max(mem_c) if mem_c else None,
        "throttle_flags": sorted(
            {
                name
                for c in cards
                for name in ("hw_thermal_slowdown", "sw_thermal_slowdown", "sw_power_cap")
                if getattr(c.sample, name)
            }
        ),
        "card_samples": len(cards),
        "load": asdict(load) if load is not None else None,
    }
    problems = []
    if shares[-1] < min_share:
        problems.append(f"decode share fell to {shares[-1]:.2f} of the cold rate (limit {min_share})")
    if gpu_c and max(gpu_c) > max_gpu_c:
        problems.append(f"GPU reached {max(gpu_c):.0f} C (limit {max_gpu_c:g})")
    if mem_c and max(mem_c) > max_memory_c:
        problems.append(f"memory reached {max(mem_c):.0f} C (limit {max_memory_c:g})")
    if problems:
        return ProbeResult("thermal", False, "; ".join(problems), metrics)
    note = "" if cards else " (no nvidia-smi on the host: decode share only)"
    return ProbeResult("thermal", True, f"decode share {shares[-1]:.2f} of cold{note}", metrics)


async def sample_card(ssh: asyncssh.SSHClientConnection | None) -> list[GpuSample] | None:
    """One nvidia-smi sample of every GPU, or None when the host has no nvidia-smi (or no SSH)."""
    if ssh is None:
        return None
    try:
        # a host's answer within a deadline and a size: one nvidia-smi line a GPU
        result = await asyncio.wait_for(ssh.run(" ".join(QUERY), check=False, errors="replace"), 30)
    except TimeoutError:
        return None
    if result.exit_status != 0 or len(str(result.stdout)) > 64 * 1024:
        return None
    try:
        return parse_query_csv(str(result.stdout))
    except GpuParseError:
        return None


class _Load:
    """Callers streaming long replies back to back on the other slots, until closed."""

    def __init__(self, server: Server, callers: int, tokens: int) -> None:
        self.server, self.tokens = server, tokens
        self.stop = False
        self.count = LoadCount(callers)
        self.tasks = [asyncio.create_task(self._caller()) for _ in range(callers)]

    async def _caller(self) -> None:
        conn = Connection(self.server)
        try:
            while not self.stop:
                try:
                    r = await conn.chat(
                        {"messages": LOAD_PROMPT, "max_tokens": self.tokens, "temperature": 1.0, "ignore_eos": True}
                    )
                    if r.status == 200 and r.served.predicted_n:
                        self.count.ok += 1
                    else:
                        self.count.failed += 1
                        self.count.last_error = r.error or f"HTTP {r.status}, no tokens"
                except (StreamError, OSError) as e:
                    self.count.failed += 1
                    self.count.last_error = f"{type(e).__name__}: {e}"
                    await conn.close()
                    conn = Connection(self.server)
                    await asyncio.sleep(0.2)  # a refused connection must not spin
        finally:
            await conn.close()

    async def close(self) -> None:
        self.stop = True
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def load_running(server: Server, callers: int, limit_s: float) -> None:
    """Wait, at most `limit_s`, until the server says the load's requests are in flight (its /metrics): a
    first one-caller rate taken before the load decodes beside it is no cold rate of a loaded card, and every
    later one would read as a loss."""
    if callers == 0:
        return
    deadline = time.monotonic() + limit_s
    async with server.client(timeout=10) as client:
        while time.monotonic() < deadline:
            try:
                reply = await bounded(client, "GET", "/metrics", deadline_s=10)
            except (OSError, TimeoutError, httpx.HTTPError):
                return
            if reply.status_code != 200:
                return  # a server without /metrics: the load had this long to start
            running = requests_in_flight(reply.body.decode("utf-8", errors="replace"))
            if running is None or running >= callers:
                return
            await asyncio.sleep(0.1)


async def one_caller_rate(server: Server, tokens: int, attempts: int = RATE_ATTEMPTS) -> float:
    """One caller's decode rate, as the reply says it (ChatResult.decode_tok_s). A reply that gives none is asked
    again, up to `attempts`: read as 0 into the series, it judged a healthy host collapsed."""
    conn = Connection(server)
    try:
        for _ in range(attempts):
            body = {"messages": LOAD_PROMPT, "max_tokens": tokens, "temperature": 1.0, "ignore_eos": True}
            r = await conn.chat(body)
            if r.status != 200:
                raise ThermalError(f"the one-caller decode request failed: {r.error or f'HTTP {r.status}'}")
            if (rate := r.decode_tok_s) is not None:
                return rate
    finally:
        await conn.close()
    raise ThermalError(f"no decode rate in {attempts} replies")


async def run_thermal(
    server: Server,
    ssh: asyncssh.SSHClientConnection | None,
    *,
    slots: int,
    seconds: float,
    interval_s: float,
    tokens: int,
    min_share: float,
    max_gpu_c: float,
    max_memory_c: float,
    min_samples: int = 3,
) -> tuple[ProbeResult, list[RatePoint], list[CardPoint]]:
    """The load on, a one-caller rate every `interval_s` for `seconds`, and at least `min_samples` of them
    however long they take; then judged by share and temperature."""
    started = time.monotonic()
    rates: list[RatePoint] = []
    cards: list[CardPoint] = []

    async def take_card() -> None:
        samples = await sample_card(ssh)
        for s in samples or []:
            cards.append(CardPoint(time.monotonic() - started, s))

    await take_card()
    load = _Load(server, max(slots - 1, 0), tokens)
    try:
        await load_running(server, load.count.callers, LOAD_WAIT_S)
        while True:
            rates.append(RatePoint(time.monotonic() - started, await one_caller_rate(server, tokens)))
            await take_card()
            left = seconds - (time.monotonic() - started)
            if left <= 0 and len(rates) >= min_samples:
                break
            await asyncio.sleep(min(interval_s, max(left, 0.0)))
    finally:
        await load.close()
    result = judge_thermal(rates, cards, min_share, max_gpu_c, max_memory_c, load.count)
    result.metrics["series"] = {
        "rates": [asdict(r) for r in rates],
        "cards": [{"t_s": c.t_s, **asdict(c.sample)} for c in cards],
    }
    return result, rates, cards


def plot(rates: list[RatePoint], cards: list[CardPoint], path: Path, title: str) -> None:
    """Temperature, clocks and decode rate over time, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    axes[0].plot([r.t_s for r in rates], [r.tokens_per_s for r in rates], "o-", color="tab:blue")
    axes[0].set_ylabel("decode, one caller\nunder the load (tok/s)")
    axes[0].set_ylim(bottom=0)
    for attr, label in (("gpu_c", "GPU"), ("memory_c", "memory")):
        points = [(c.t_s, getattr(c.sample, attr)) for c in cards if getattr(c.sample, attr) is not None]
        if points:
            axes[1].plot(*zip(*points, strict=True), ".-", label=label)
    axes[1].set_ylabel("temperature (C)")
    for attr, label in (("sm_mhz", "SM"), ("mem_mhz", "memory")):
        points = [(c.t_s, getattr(c.sample, attr)) for c in cards if getattr(c.sample, attr) is not None]
        if points:
            axes[2].plot(*zip(*points, strict=True), ".-", label=label)
    axes[2].set_ylabel("clock (MHz)")
    axes[2].set_xlabel("seconds")
    for ax in axes[1:]:
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "no nvidia-smi on this host", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
