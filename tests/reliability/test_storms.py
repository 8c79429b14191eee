"""API storms on the strict local cloud: a third of the requests answered 429 or 5xx, and a create whose
answer comes too late. `fleet up --count 3` still ends with three READY hosts and no intent that bought
twice; the retries are bounded and each is in the log; the create that timed out is followed by a lookup
by label, never by a second create."""

import os
import re
import subprocess
import sys

from tests.fleetkit import write_config
from tests.reliability.invariants import cloud_books, record_hosts, settled

API = ["/api/v0/", "/api/v1/"]


def test_a_storm_of_429s_5xx_and_a_late_create_still_brings_up_three(fresh_cloud, tmp_path):
    cloud = fresh_cloud
    write_config(tmp_path, provider={"request_timeout_s": 3, "create_timeout_s": 3}, timeouts={"instance_visible": 10})
    cloud.set_faults(
        {
            "rate_limit": {"share": 0.15, "paths": API},
            "server_error": {"share": 0.15, "paths": API, "status": 502},
            "slow": {"count": 1, "paths": ["/api/v0/asks"], "delay_s": 6.0},  # the first create answers too late
        }
    )
    env = {
        **os.environ,
        "FLEET_CONFIG": str(tmp_path / "fleet.toml"),
        "FLEET_LOCALCLOUD_DIR": str(cloud.info.state_dir),
    }
    up = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "up", "--model", "tiny", "--region", "eu", "--count", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    cloud.set_faults({})
    assert up.returncode == 0, up.stderr
    hosts = record_hosts(tmp_path / "fleet.db")
    assert len([h for h in hosts if h["state"] == "ready"]) == 3

    retries = re.findall(r"retry (\d+)/(\d+)", up.stderr)
    assert retries, up.stderr  # retried, and said so
    assert all(int(n) <= int(most) for n, most in retries)  # bounded

    late = [h for h in hosts if "ReadTimeout" in (h["failure_reason"] or "")]
    assert late, [(h["name"], h["failure_reason"]) for h in hosts]  # the create that answered too late ...
    books = cloud_books(cloud.info.state_dir)
    for host in late:  # ... had bought an instance, found by its label and destroyed; not bought again
        bought = [c for c in books["charges"] if c["label"] == host["label"]]  # its disk, GPU, traffic: one instance
        assert {c["instance_id"] for c in bought} == {host["instance_id"]} and all(c["end"] is not None for c in bought)

    done = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "destroy", "--all", "--yes"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    findings = settled(cloud.info.state_dir, [tmp_path / "fleet.db"])
    assert findings.clean(), findings
