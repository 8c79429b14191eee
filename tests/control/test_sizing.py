"""Sized to calls (issue 13): the pure decision on recorded states, and `fleet serve` keeping a target on the
strict local cloud (up from the pool first, the surplus drained, the pool refilled)."""

import json
import os
import subprocess
import sys

import pytest

from fleet.control.sizing import decide, keep
from fleet.core.config import Serve
from fleet.core.models import Host, HostState
from tests.fleetkit import fleet_for, settings_for, write_config


def host(name: str, usd_per_hour: float) -> Host:
    return Host(
        name=name, run_id="r", model="m", region="eu", provider_url="u", label=name, offer_id=1, machine_id=1,
        gpu_name="RTX 3090", num_gpus=1, gpu_ram_mb=24576, geolocation="SE", dph_total=usd_per_hour,
        inet_up_usd_per_gb=0.0, inet_down_usd_per_gb=0.0, effective_usd_per_hour=usd_per_hour,
    )  # fmt: skip


def test_from_nothing_it_brings_up_what_the_calls_need_at_the_profiles_slots():
    s = decide(Serve(model="m", region="eu", calls=10, headroom=0.2), [], in_flight=0, pool=0, slots=3)
    assert (s.target_callers, s.capacity, s.per_host, s.up, s.drain, s.refill) == (12, 0, 3, 4, (), 0)


def test_hosts_coming_up_count_and_measured_hosts_set_the_per_host_estimate():
    ready = [(host("a", 0.3), 4), (host("b", 0.3), 4)]
    s = decide(Serve(model="m", region="eu", calls=12, headroom=0.0), ready, in_flight=1, pool=0, slots=3)
    assert (s.capacity, s.per_host, s.up) == (8, 4, 0)  # 8 READY + 4 coming = 12
    s = decide(Serve(model="m", region="eu", calls=13, headroom=0.0), ready, in_flight=1, pool=0, slots=3)
    assert s.up == 1


def test_the_surplus_drains_dearest_per_caller_first_and_never_below_the_target():
    ready = [(host("cheap", 0.2), 4), (host("dear", 0.5), 4), (host("mid", 0.3), 4)]
    s = decide(Serve(model="m", region="eu", calls=8, headroom=0.0), ready, in_flight=0, pool=0, slots=4)
    assert s.drain == ("dear",) and s.up == 0
    assert decide(Serve(model="m", region="eu", calls=8), ready, in_flight=1, pool=0, slots=4).drain == ()


def test_no_call_target_sizes_nothing_and_the_pool_is_refilled_net_of_what_up_takes():
    ready = [(host("a", 0.3), 4)]
    s = decide(Serve(model="m", region="eu", calls=0, standby=2), ready, in_flight=0, pool=1, slots=4)
    assert (s.up, s.drain, s.refill) == (0, (), 1)
    s = decide(Serve(model="m", region="eu", calls=20, headroom=0.0, standby=2), ready, 0, pool=2, slots=4)
    assert (s.up, s.refill) == (4, 2)  # the two pool hosts go to serve; the pool is filled again


@pytest.fixture
def _local_cloud(local_cloud_env):
    yield


async def test_serve_keeps_a_target_up_from_the_pool_down_by_draining(_local_cloud, tmp_path):
    settings = settings_for(tmp_path)
    async with fleet_for(settings) as fleet:
        try:
            first = await keep(fleet, Serve(model="tiny", region="eu", calls=2, headroom=0.0, standby=1))
            assert (first.up, first.refill) == (2, 1) and len(first.done["up"]) == 2
            assert len(first.done["pooled"]) == 1
            states = sorted(h.state for h in fleet.record.hosts(states=(HostState.READY, HostState.STANDBY)))
            assert states == ["ready", "ready", "standby"]

            # one call more than READY holds: the pool host serves, and the pool is filled again
            more = await keep(fleet, Serve(model="tiny", region="eu", calls=3, headroom=0.0, standby=1))
            assert more.up == 1 and more.done["up_from_pool"] == first.done["pooled"]
            assert len(more.done["pooled"]) == 1

            fewer = await keep(fleet, Serve(model="tiny", region="eu", calls=1, headroom=0.0, standby=1))
            assert len(fewer.drain) == 2 and fewer.done["drained"] == list(fewer.drain)
            left = fleet.record.hosts(states=(HostState.READY, HostState.STANDBY))
            assert sorted(h.state for h in left) == ["ready", "standby"]
        finally:
            await fleet.destroy(None)


def test_serve_without_a_target_says_so_in_one_line(tmp_path):
    config = write_config(tmp_path, serve=None)
    cli = subprocess.run(
        [sys.executable, "-m", "fleet", "serve"],
        env={**os.environ, "FLEET_CONFIG": str(config)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 2 and "no serve target" in cli.stderr and len(cli.stderr.strip().splitlines()) == 1


def test_a_serve_target_for_an_unknown_profile_is_refused_naming_the_key(tmp_path):
    config = write_config(tmp_path, '\n[[serve]]\nmodel = "nope"\nregion = "eu"\ncalls = 2\n')
    cli = subprocess.run(
        [sys.executable, "-m", "fleet", "status"],
        env={**os.environ, "FLEET_CONFIG": str(config)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 2 and "serve.0.model: no model profile 'nope'" in cli.stderr, cli.stderr


def test_destroy_all_pauses_the_serve_targets_and_nothing_is_rented_until_resumed(tmp_path):
    """A daemon keeps a target of calls: `fleet destroy --all` alone would see it rent again at its next beat.
    destroy --all pauses the targets and says so; `fleet serve` then does nothing (what a daemon's beat runs),
    `fleet serve --resume` keeps them again; bad combinations are one-line errors."""
    config = write_config(tmp_path, '\n[[serve]]\nmodel = "tiny"\nregion = "eu"\ncalls = 2\n')
    env = {**os.environ, "FLEET_CONFIG": str(config)}

    def fleet(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "fleet", *args], env=env, capture_output=True, text=True, timeout=120
        )

    destroyed = fleet("destroy", "--all", "--yes")
    assert destroyed.returncode == 0, destroyed.stderr
    assert "the serve targets are paused" in destroyed.stdout and "fleet serve --resume" in destroyed.stdout
    kept = fleet("serve", "--json")
    assert kept.returncode == 0, kept.stderr
    [target] = json.loads(kept.stdout)
    assert target["paused_since"] and target["done"] == {"paused_since": target["paused_since"]}  # nothing rented
    assert "PAUSED since" in fleet("status").stdout
    resumed = fleet("serve", "--resume", "--json")
    assert resumed.returncode == 0 and json.loads(resumed.stdout) == {"paused_since": None}
    planned = fleet("serve", "--dry-run", "--json")
    [again] = json.loads(planned.stdout)
    assert again["paused_since"] is None and again["up"] > 0  # kept again: it would rent
    both = fleet("serve", "--pause", "--resume")
    assert both.returncode == 2 and "one at a time" in both.stderr
