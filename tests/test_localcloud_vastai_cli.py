"""The official vastai CLI (1.9.1), pointed at the local cloud, searches, creates, shows and destroys."""

import json
import subprocess
import time

from tests.helpers import host_processes


def vastai(vastai_bin, env, cloud, *args: str) -> subprocess.CompletedProcess:
    run_env = {**env, "VAST_URL": cloud.url}
    return subprocess.run(
        [vastai_bin, "--url", cloud.url, "--api-key", cloud.key, *args],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def test_vastai_cli_search_create_show_destroy(cloud, vastai_bin, vastai_env, ssh_keypair):
    query = (
        "reliability > 0.98 cuda_vers >= 12.8 direct_port_count >= 2 inet_down_cost <= 0.05 "
        "geolocation in [SE,DE,NL,PL,CZ,FI,FR,IT,ES,BE]"
    )
    found = vastai(vastai_bin, vastai_env, cloud, "search", "offers", query, "-o", "dph", "--raw")
    assert found.returncode == 0, found.stderr
    offers = json.loads(found.stdout)
    assert offers, found.stderr
    assert all(o["geolocation"][-2:] in {"SE", "DE", "NL", "PL", "CZ", "FI", "FR", "IT", "ES", "BE"} for o in offers)
    assert all(o["reliability"] > 0.98 and o["direct_port_count"] >= 2 for o in offers)
    assert [o["dph_total"] for o in offers] == sorted(o["dph_total"] for o in offers)
    # the offers that fail one filter each are not there
    assert not any(o["inet_down_cost"] > 0.05 or o["cuda_max_good"] < 12.8 for o in offers)

    key = vastai(vastai_bin, vastai_env, cloud, "create", "ssh-key", ssh_keypair[1])
    assert key.returncode == 0 and "success" in key.stdout, key.stderr

    created = vastai(
        vastai_bin,
        vastai_env,
        cloud,
        "create",
        "instance",
        str(offers[0]["id"]),
        "--image",
        "fleet/llama-server:test",
        "--disk",
        "20",
        "--env",
        "-e MODE=test -p 70000:70000",
        "--label",
        "fleet:cli",
        "--ssh",
        "--direct",
        "--raw",
    )
    assert created.returncode == 0, created.stderr
    instance_id = json.loads(created.stdout)["new_contract"]

    deadline = time.monotonic() + 20
    while True:
        shown = vastai(vastai_bin, vastai_env, cloud, "show", "instance", str(instance_id), "--raw")
        assert shown.returncode == 0, shown.stderr
        row = json.loads(shown.stdout)
        if row["actual_status"] == "running" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert row["actual_status"] == "running" and row["label"] == "fleet:cli"
    assert dict(row["extra_env"])["MODE"] == "test"  # the SDK turned the pairs into a dict

    listed = vastai(vastai_bin, vastai_env, cloud, "show", "instances", "--raw")
    assert instance_id in [i["id"] for i in json.loads(listed.stdout)]
    url = vastai(vastai_bin, vastai_env, cloud, "ssh-url", str(instance_id))
    assert url.stdout.strip() == f"ssh://root@127.0.0.1:{row['ssh_port']}"

    token = cloud.state()["instances"][str(instance_id)]["token"]
    destroyed = vastai(vastai_bin, vastai_env, cloud, "destroy", "instance", str(instance_id), "-y")
    assert destroyed.returncode == 0, destroyed.stderr
    gone = vastai(vastai_bin, vastai_env, cloud, "show", "instance", str(instance_id))
    assert "not found" in gone.stdout + gone.stderr
    assert host_processes(cloud.info.state_dir, instance_id, token) == []
