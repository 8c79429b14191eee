#!/usr/bin/env python3
"""Marketplace API calls and 429s per host that `fleet up` brings up, on the strict local cloud.

Runs side by side in one process against a fresh local cloud with vast.ai's rate limits, read lag,
late SSH keys and heartbeat gaps on (the default): `up --count 1`, then `up --count 4`, each on its
own database and each destroyed afterwards. Counts come from fleet's own client (every request,
including retries) and from the cloud (every 429 it answered).
Target: at most 40 calls per host, no failed bring-up.
Usage: .venv/bin/python bench/api_calls.py
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.control.up import UpRequest
from fleet.localcloud import control
from fleet.market.pacing import Counters
from tests.fleetkit import fleet_for, settings_for

TARGET_CALLS_PER_HOST = 40


def _diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


async def one_up(tmp: Path, count: int, cloud: control.CloudInfo) -> dict[str, object]:
    async with fleet_for(settings_for(tmp)) as fleet:
        counters: Counters = fleet.market.pacer.counters
        calls0, limited0, waited0 = dict(counters.calls), dict(counters.rate_limited), counters.waited_s
        served0 = _cloud_429s(cloud)
        started = time.monotonic()
        result = await fleet.up(UpRequest("tiny", "eu", count=count))
        wall = time.monotonic() - started
        calls, limited = _diff(counters.calls, calls0), _diff(counters.rate_limited, limited0)
        waited = counters.waited_s - waited0
        answered_429 = _cloud_429s(cloud) - served0
        destroy0 = counters.total_calls()
        await fleet.destroy(None)
        destroy_calls = counters.total_calls() - destroy0
    return {
        "count": count,
        "ready": len(result.ready),
        "failed_attempts": sum(1 for a in result.attempts if a.outcome != "ready"),
        "calls": calls,
        "rate_limited": limited,
        "answered_429": answered_429,
        "paced_s": waited,
        "wall_s": wall,
        "destroy_calls": destroy_calls,
    }


def _cloud_429s(cloud: control.CloudInfo) -> int:
    headers = {"Authorization": f"Bearer {cloud.api_key()}"}
    return int(httpx.get(f"{cloud.url}/admin/stats", headers=headers, timeout=10).json()["rate_limited"])


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        os.environ["FLEET_LOCALCLOUD_DIR"] = str(tmp / "cloud")
        cloud = control.start(tmp / "cloud")
        try:
            runs = [await one_up(tmp / "one", 1, cloud), await one_up(tmp / "four", 4, cloud)]
        finally:
            control.stop(tmp / "cloud")

    print("fleet up --model tiny --region eu on the strict local cloud (vast.ai's rate limits, read lag, heartbeats)")
    header = f"{'':<10}{'READY':>7}{'calls':>7}{'calls/host':>12}{'429s':>6}{'paced s':>9}{'wall s':>8}  by endpoint"
    print(header)
    worst = 0.0
    for run in runs:
        calls = sum(run["calls"].values())  # type: ignore[union-attr]
        per_host = calls / max(int(run["count"]), 1)  # type: ignore[arg-type]
        worst = max(worst, per_host)
        endpoints = ", ".join(f"{k} {v}" for k, v in sorted(run["calls"].items()))  # type: ignore[union-attr]
        print(
            f"--count {run['count']:<2}{run['ready']:>7}{calls:>7}{per_host:>12.1f}{run['answered_429']:>6}"
            f"{run['paced_s']:>9.1f}{run['wall_s']:>8.1f}  {endpoints}"
        )
    print(f"destroy afterwards: {runs[0]['destroy_calls']} calls (--count 1), {runs[1]['destroy_calls']} (--count 4)")
    failed = sum(int(r["failed_attempts"]) for r in runs) + sum(int(r["count"]) - int(r["ready"]) for r in runs)
    print(
        f"worst calls per host: {worst:.1f} (target <= {TARGET_CALLS_PER_HOST}); failed bring-ups: {failed} (target 0)"
    )


if __name__ == "__main__":
    asyncio.run(main())
