#!/usr/bin/env python3
"""How much of `fleet up --model tiny --region eu` is fleet's own code, and how --count 4 scales.

Runs side by side in one process against a fresh local cloud in a temporary directory:
1. `up` with --count 1: wall time, split into waiting on the marketplace, SSH, the pull and the
   server (timed where fleet awaits them) and the rest, which is fleet's own code;
2. `up` with --count 4: wall time against --count 1.
Targets: fleet's own share under 10% of the wall time; --count 4 within 1.5x of --count 1.
The cloud is the kind one (no rate limits or read lag): this measures fleet's own code; what vast.ai's
create interval and read lag cost is bench/api_calls.py's subject.
Usage: .venv/bin/python bench/up_overhead.py [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.context import Waits
from fleet.control.up import UpRequest
from fleet.localcloud import control
from tests.fleetkit import fleet_for, settings_for


async def one_up(tmp: Path, count: int) -> tuple[float, dict[str, float]]:
    async with fleet_for(settings_for(tmp)) as fleet:
        fleet.waits = Waits()
        started = time.perf_counter()
        result = await fleet.up(UpRequest("tiny", "eu", count=count))
        wall = time.perf_counter() - started
        if len(result.ready) != count:
            raise SystemExit(f"up --count {count} brought up {len(result.ready)}: {result.failures}")
        waits = dict(fleet.waits.seconds)
        await fleet.destroy(None)
    return wall, waits


async def main(rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        os.environ["FLEET_LOCALCLOUD_DIR"] = str(tmp / "cloud")
        control.start(tmp / "cloud", kind=True)
        try:
            singles, quads, shares = [], [], []
            breakdown: dict[str, list[float]] = {}
            for i in range(rounds):
                wall, waits = await one_up(tmp / f"r{i}a", 1)
                singles.append(wall)
                waited = sum(waits.values())
                shares.append((wall - waited) / wall)
                for kind, seconds in waits.items():
                    breakdown.setdefault(kind, []).append(seconds)
                wall4, _ = await one_up(tmp / f"r{i}b", 4)
                quads.append(wall4)
        finally:
            control.stop(tmp / "cloud")

    one, four = statistics.median(singles), statistics.median(quads)
    own = statistics.median(shares)
    print(f"fleet up --model tiny --region eu, local cloud, {rounds} rounds (medians)")
    print(f"  --count 1 wall time          {one:7.2f} s")
    for kind, values in sorted(breakdown.items()):
        print(f"    waiting on {kind:<12}     {statistics.median(values):7.2f} s")
    print(f"    fleet's own code           {own * one:7.2f} s")
    print(f"  fleet's own share            {own * 100:6.1f} %   (target < 10 %)")
    print(f"  --count 4 wall time          {four:7.2f} s")
    print(f"  --count 4 / --count 1        {four / one:7.2f} x   (target <= 1.5 x)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args().rounds))
