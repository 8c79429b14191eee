#!/usr/bin/env python3
"""`fleet up` to READY from the standby pool against a cold bring-up, side by side on the strict local cloud.

The model is a generated random-weight GGUF of SIZE (fleet/localcloud/bigmodels.py), served by the real
llama-server from the local hub, whose per-connection cap is set so that the pull takes what a real link
takes: CAP per connection x 8 aria2c connections. Each round: a cold `fleet up` (rent, boot, pull, sha256,
load, probes), destroyed; then `fleet standby` (not timed) and a `fleet up` that takes the pool host (start,
boot, reconnect, sha256 of the kept file, load, probes). Prints each round and the ratio of the medians.
Target: standby at most 0.2x cold.
Then, from the offers the profile passes (the catalogue's raw vast.ai offers, priced for the profile's
disk): what a standby host costs an hour against a running one.
Usage: .venv/bin/python bench/standby.py [--rounds N]
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

from fleet.control.up import UpRequest
from fleet.core import config
from fleet.economics import offers as offer_rules
from fleet.localcloud import bigmodels, control
from tests.fleetkit import fleet_for, settings_for, with_variant

# 1.45 GB: 12 layers of a 2048-wide decoder (FFN 16384), Q8_0
SHAPE = bigmodels.DenseShape("standby-bench", 12, 2048, 16, 8, 128, 16384, 4096, 10000.0)
CAP = 4 * 1024 * 1024  # bytes/s per connection: 8 connections give 32 MiB/s, ~270 Mbit/s
REPO, FILE = "fleet-local/bench-models", "standby-bench-Q8_0.gguf"


async def one_round(settings: config.Settings) -> tuple[float, float]:
    async with fleet_for(settings) as fleet:
        started = time.monotonic()
        cold = await fleet.up(UpRequest("big", "eu"))
        cold_s = time.monotonic() - started
        assert cold.ready and not cold.attempts[0].resumed, cold.failures
        await fleet.destroy(None)
        parked = await fleet.up(UpRequest("big", "eu", standby=True))
        assert parked.ready, parked.failures
        started = time.monotonic()
        warm = await fleet.up(UpRequest("big", "eu"))
        warm_s = time.monotonic() - started
        assert warm.ready and warm.attempts[0].resumed, warm.failures
        await fleet.destroy(None)
    return cold_s, warm_s


async def main(rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        models = tmp / "models"
        bigmodels.write_dense(SHAPE, models / FILE)
        size = (models / FILE).stat().st_size
        os.environ["FLEET_LOCALCLOUD_DIR"] = str(tmp / "cloud")
        control.start(tmp / "cloud", hub_bytes_per_s=CAP, publish={REPO: models}, timeout_s=120)
        try:
            base = settings_for(tmp)
            tiny = base.models["tiny"]
            big = tiny.files[0].model_copy(update={"repo": REPO, "file": FILE, "sha256": None})
            settings = with_variant(base, "big", files=[big], on_up=["smoke"], disk_gb=20)
            times = [await one_round(settings) for _ in range(rounds)]
            async with fleet_for(settings) as fleet:
                funnel = await fleet.offers("big", "eu")
        finally:
            control.stop(tmp / "cloud")

    print(f"model {SHAPE.name}: {size / 1e9:.2f} GB; hub cap {CAP / 2**20:g} MiB/s per connection x 8 connections")
    print(f"{'round':<7}{'cold s':>9}{'standby s':>11}{'ratio':>8}")
    for i, (cold_s, warm_s) in enumerate(times, 1):
        print(f"{i:<7}{cold_s:>9.1f}{warm_s:>11.1f}{warm_s / cold_s:>8.3f}")
    cold_m, warm_m = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
    ratio = warm_m / cold_m
    print(f"median: cold {cold_m:.1f} s, from standby {warm_m:.1f} s: {ratio:.3f}x (target <= 0.2x)")

    pairs = [(offer_rules.storage_price_per_hour(o), o.dph_total, o) for o in funnel.passed]
    shares = [s / d for s, d, _ in pairs if d > 0]
    print(f"\nstandby vs running, per hour, over the {len(pairs)} offers the profile passes (disk {20} GB):")
    for s, d, o in sorted(pairs, key=lambda p: p[1])[:5]:
        print(f"  {o.gpu_name:<10} {o.geolocation:<16} standby ${s:.4f}/h  running ${d:.4f}/h  ({s / d:.3%})")
    print(f"  median standby/running: {statistics.median(shares):.3%}")
    if ratio > 0.2:
        raise SystemExit(1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    asyncio.run(main(args.rounds))
