"""The gateway's bad input: one line and exit 2 (JSON under --json), nothing started, nothing written; and
what reaches HAProxy's admin socket or its configuration is checked word by word."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.core import config
from fleet.engines import registry
from fleet.gateway.observed import ObservedError, parse_observed
from fleet.gateway.runtime import RuntimeApiError, checked, parse_servers_state, parse_table
from fleet.gateway.targets import address_of
from tests.fleetkit import write_config


def fleet_cli(config_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fleet", *args],
        env={**os.environ, "FLEET_CONFIG": str(config_path), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def gateway_config(tmp: Path, **sections: object) -> Path:
    """The repo's fleet.toml with the record and the gateway's directory in `tmp` (and `sections` laid over)."""
    return write_config(tmp, **{**sections, "gateway": {"directory": f"{tmp}/gw", **sections.get("gateway", {})}})


def test_start_without_a_serve_target_says_so_and_starts_nothing(tmp_path):
    path = gateway_config(tmp_path, serve=None)
    result = fleet_cli(path, "gateway", "start", "--json")
    assert result.returncode == 2 and "no [[serve]] table" in json.loads(result.stdout)["error"]
    assert not (tmp_path / "gw" / "haproxy.pid").exists()


def test_an_overflow_without_its_key_is_refused_before_haproxy_starts(tmp_path):
    path = gateway_config(tmp_path, gateway={"overflow": {"url": "https://localhost:9/v1", "key_env": "NO_SUCH_KEY_X"}})
    result = fleet_cli(path, "gateway", "start")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "set NO_SUCH_KEY_X" in result.stderr
    assert not (tmp_path / "gw" / "haproxy.pid").exists()


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ('[gateway.overflow]\nurl = "http://api.example.com/v1"\n', "an https:// URL"),
        ('[gateway.overflow]\nurl = "https://api.example.com/v1?x=1"\n', "an https:// URL"),
        ('[gateway.overflow]\nkey_env = "lower; rm -rf /"\n', "key_env"),
        ('[gateway]\nlisten = "example.com"\n', "an IP address"),
        ('[gateway]\nnames = ["bad name\\nline"]\n', "a DNS name or an IP address"),
        ('[gateway]\npeers = ["a=10.0.0.1:1000 extra"]\npeer_name = "a"\n', "NAME=ADDRESS:PORT"),
        ('[gateway]\npeers = ["a=10.0.0.1:1000"]\npeer_name = "b"\n', "name this instance among gateway.peers"),
        ("[gateway]\nmetrics_port = 8443\n", "taken by another gateway endpoint"),
        ("[gateway]\nmax_body_kb = 100000\n", "max_body_kb"),
        ('[gateway.cache_groups]\nclinic = ["alice", "bad name"]\n', "not an agent's name"),
        ('[gateway.cache_groups]\nclinic = ["alice"]\nlab = ["alice"]\n', "one at most"),
        ('[gateway.cache_groups]\n"two words" = ["alice"]\n', "a group's name"),
    ],
)
def test_bad_gateway_settings_are_refused_naming_the_key(tmp_path, extra, says):
    text = (Path(__file__).resolve().parents[2] / "fleet.toml").read_text()
    section = extra.split("\n", 1)[0]
    if section == "[gateway]":
        text = text.replace("[gateway]\n", extra, 1)
        # the shipped table's own keys of the same name are dropped, so that TOML reads one
        for line in extra.splitlines()[1:]:
            key = line.split(" =", 1)[0]
            text = "\n".join(t for t in text.splitlines() if not t.startswith(f"{key} =") or t == line) + "\n"
    else:
        text += "\n" + extra
    (tmp_path / "fleet.toml").write_text(text)
    with pytest.raises(config.ConfigError) as e:
        registry.load(tmp_path / "fleet.toml")
    assert says in str(e.value) and "\n" not in str(e.value)


def test_agent_names_are_checked_and_a_revoke_of_nobody_is_exit_2(tmp_path):
    path = gateway_config(tmp_path)
    bad = fleet_cli(path, "gateway", "key", "add", "bad name;", "--json")
    assert bad.returncode == 2 and "an agent's name is letters" in json.loads(bad.stdout)["error"]
    added = fleet_cli(path, "gateway", "key", "add", "alice", "--json")
    assert added.returncode == 0
    key = json.loads(added.stdout)["key"]
    twice = fleet_cli(path, "gateway", "key", "add", "alice", "--json")
    assert twice.returncode == 2 and "has a key already" in json.loads(twice.stdout)["error"]
    listed = fleet_cli(path, "gateway", "key", "list", "--json")
    assert [k["name"] for k in json.loads(listed.stdout)] == ["alice"] and key not in listed.stdout
    nobody = fleet_cli(path, "gateway", "key", "revoke", "nobody", "--json")
    assert nobody.returncode == 2 and "no live key" in json.loads(nobody.stdout)["error"]
    # the record keeps the key's hash alone
    import sqlite3

    with sqlite3.connect(tmp_path / "fleet.db") as db:
        rows = db.execute("SELECT name, sha256 FROM agent_keys").fetchall()
    assert len(rows) == 1 and rows[0][0] == "alice" and key not in repr(rows) and len(rows[0][1]) == 64


def test_nothing_from_the_record_or_a_host_adds_a_command_to_haproxys_socket():
    assert checked("set", "server", "calls_t0/s1", "state", "ready") == "set server calls_t0/s1 state ready"
    for bad in ("ready; shutdown sessions", "a\nb", "a b", "", "x" * 600, "k\x00"):
        with pytest.raises(RuntimeApiError):
            checked("add", "map", "/f", bad)
    # a host's URL reaches HAProxy as an IP and a port, or not at all
    assert address_of("https://10.0.0.7:41234") == ("10.0.0.7", 41234)
    for url in ("https://evil.example.com:443", "http://10.0.0.7:80", "https://10.0.0.7", "https://10.0.0.7:1;x"):
        assert address_of(url) is None


def test_haproxys_answers_are_read_strictly():
    state = (
        "1\n# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_iweight "
        "srv_time_since_last_change srv_check_status srv_check_result srv_check_health srv_check_state "
        "srv_agent_state bk_f_forced_id srv_f_forced_id srv_fqdn srv_port\n"
        "3 calls_t0 1 s0 - 2 8 1 1 5 15 3 4 6 0 0 0 - 0\n"
    )
    (server,) = parse_servers_state(state)
    assert (server.name, server.admin_state, server.in_maintenance) == ("s0", 8, False)
    with pytest.raises(RuntimeApiError):
        parse_servers_state(state.replace(" 8 1 1 ", " eight 1 1 "))
    table = parse_table("# table: calls_t0\n0x1: key=call-1 use=0 exp=10 server_id=2 server_key=s1\nnoise\n")
    assert table == {"call-1": {"use": "0", "exp": "10", "server_id": "2", "server_key": "s1"}}


def test_what_the_observe_filter_counted_is_read_strictly_and_its_quantiles_interpolated():
    text = "le 10 25 50\ncalls_t0 s1 4 110.000 1 1 2 0 3 2 300 20 5\ncalls_t1 s0 0 0.000 0 0 0 0 0 0 0 0\n\n"
    first, idle = parse_observed(text)
    assert (first.answered, idle.answered) == (5, None)  # the second line is an older filter's, without it
    assert (first.backend, first.slot, first.buckets, first.warm_turns, first.warm_turns_cached) == (
        "calls_t0",
        1,
        (1, 1, 2, 0),
        3,
        2,
    )
    # 4 answers: one under 10 ms, one in 10-25, two in 25-50
    assert first.first_content_ms(0.25) == 10.0
    assert first.first_content_ms(0.5) == 25.0
    assert first.first_content_ms(0.95) == pytest.approx(25 + 25 * (3.8 - 2) / 2)
    assert first.cached_share == pytest.approx(2 / 3)
    assert idle.first_content_ms(0.5) is None and idle.cached_share is None
    slow = parse_observed("le 10 25\ncalls_t0 s2 1 900.000 0 0 1 0 0 0 0\n")[0]
    assert slow.first_content_ms(0.5) == 25.0  # past the last bound: the last bound, never a guess beyond it
    for bad in (
        "",
        "calls_t0 s1 1 1 1 0 0 0 0 0 0\n",  # no bucket line
        "le 25 10\n",  # bounds that do not rise
        "le 10 25\ncalls_t0 s1 1 1.0 1 0 0 0 0 0\n",  # a field short
        "le 10 25\ncalls_t0 x1 1 1.0 1 0 0 0 0 0 0\n",  # not a slot
        "le 10 25\ncalls_t0 s1 2 1.0 1 0 0 0 0 0 0\n",  # buckets that do not add up to the count
        "le 10 25\ncalls_t0 s1 1 1.0 1 0 0 1 2 0 0\n",  # more cached than warm turns
        "le 10 25\ncalls_t0 s1 1 1.0 1 0 0 1 one 0 0\n",  # not a number
        "le 10 25\ncalls_t0 s1 2 1.0 1 1 0 0 0 0 0 1\n",  # fewer answered than timed
        "le 10 25\ncalls_t0 s1 1 1.0 1 0 0 0 0 0 0 0 9\n",  # a field too many
    ):
        with pytest.raises(ObservedError):
            parse_observed(bad)


async def test_haproxy_starts_from_a_folder_too_deep_for_a_unix_socket_path(tmp_path):
    """A Unix socket's path holds 108 bytes: a gateway folder deep in a long path keeps its admin socket in
    a private folder of this user's instead, and HAProxy starts, answers and stops."""
    from fleet.core.tls import ensure_ca
    from fleet.gateway import process
    from fleet.gateway.files import GatewayCa, files_for, runtime_dir
    from fleet.gateway.runtime import Runtime
    from fleet.gateway.targets import targets
    from tests.fleetkit import settings_for
    from tests.gateway.test_gateway import free_port

    deep = tmp_path / ("a-rather-long-folder-name-" * 4) / "gateway"
    base = settings_for(tmp_path)
    settings = base.model_copy(
        update={
            "serve": [config.Serve(model="tiny", region="eu")],
            "gateway": base.gateway.model_copy(update={"directory": str(deep), "port": free_port(), "metrics_port": 0}),
        }
    )
    files = files_for(settings)
    assert len(str(deep / "admin.sock")) > 108 and files.socket.parent == runtime_dir()
    assert oct(runtime_dir().stat().st_mode & 0o777) == "0o700"
    pid = await process.start(files, settings, targets(settings), GatewayCa.of(ensure_ca(tmp_path / "tls", "test CA")))
    try:
        stats = await Runtime(files.socket).stats()
        assert any(r["pxname"] == "calls_t0" for r in stats)
    finally:
        assert await process.stop(files) == pid
    assert process.running_pid(files) is None and not files.socket.exists()


async def test_an_haproxy_without_the_observe_filter_reports_nothing_observed_and_takes_hosts_still(tmp_path):
    """A gateway an older fleet started has no `fleet metrics` or `fleet forget` on its admin socket: status
    shows nothing observed, and a sync that forgets a slot's counts goes on."""
    import signal

    from fleet.gateway.process import haproxy_binary
    from fleet.gateway.runtime import Runtime
    from tests.gateway.test_gateway import free_port

    socket_path = tmp_path / "admin.sock"
    (tmp_path / "old.cfg").write_text(
        f"global\n  stats socket {socket_path} mode 600 level admin\n"
        "defaults\n  mode http\n  timeout connect 1s\n  timeout client 5s\n  timeout server 5s\n"
        f"frontend fe\n  bind 127.0.0.1:{free_port()}\n  http-request return status 200\n"
    )
    started = subprocess.run(
        [haproxy_binary(), "-D", "-p", str(tmp_path / "pid"), "-f", str(tmp_path / "old.cfg")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert started.returncode == 0, started.stderr
    pid = int((tmp_path / "pid").read_text().split()[0])
    try:
        runtime = Runtime(socket_path)
        assert await runtime.observed() == []
        (answer,) = await runtime.run(checked("fleet", "forget", "calls_t0", "s1"))
        assert "Unknown command" in answer  # said, not raised: the sync goes on
    finally:
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            if not Path(f"/proc/{pid}").exists():
                break
            await asyncio.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists()


async def test_a_gateway_folder_another_user_made_is_refused_and_nothing_starts(tmp_path):
    """Security round four: prepare() made the folder with exist_ok and chmod 0700; a folder another uid made
    first (as root, the chmod succeeds on it) left that user free to swap the Lua, the maps or the certificate
    HAProxy reads. It is refused, in one line, before anything is written or started."""
    from fleet.core.config import ConfigError
    from fleet.core.tls import ensure_ca
    from fleet.gateway import process
    from fleet.gateway.files import GatewayCa, files_for
    from fleet.gateway.targets import targets
    from tests.fleetkit import settings_for
    from tests.gateway.test_gateway import free_port

    base = settings_for(tmp_path)
    taken = tmp_path / "gw"
    taken.mkdir()
    os.chown(taken, 65534, 65534)  # nobody's
    settings = base.model_copy(
        update={
            "serve": [config.Serve(model="tiny", region="eu")],
            "gateway": base.gateway.model_copy(
                update={"directory": str(taken), "port": free_port(), "metrics_port": 0}
            ),
        }
    )
    files = files_for(settings)
    try:
        with pytest.raises(ConfigError, match="not a folder of this user's") as refused:
            await process.start(
                files, settings, targets(settings), GatewayCa.of(ensure_ca(tmp_path / "tls", "test CA"))
            )
    finally:
        await process.stop(files)  # an HAProxy started in spite of the folder is ended here, never left running
    assert "\n" not in str(refused.value)
    assert list(taken.iterdir()) == [] and process.running_pid(files) is None
    assert taken.stat().st_uid == 65534 and taken.stat().st_mode & 0o777 == 0o755  # untouched


@pytest.mark.parametrize(
    ("gateway", "host", "signed_by"),
    [
        ({}, "localhost", "fleet"),
        ({"listen": "0.0.0.0"}, "localhost", "fleet"),
        ({"listen": "10.0.0.5"}, "10.0.0.5", "fleet"),
        ({"listen": "0.0.0.0", "names": ["voice.example.com", "10.0.0.5"]}, "voice.example.com", "fleet"),
        ({"names": ["fd00::5"]}, "[fd00::5]", "fleet"),
        ({"acme": {"domain": "voice.example.com"}, "names": ["other.example.com"]}, "voice.example.com", "acme"),
        ({"certificate_file": "/x.pem", "key_file": "/x.key", "names": ["gw.example.com"]}, "gw.example.com", "own"),
    ],
)
def test_the_gateways_url_names_what_its_certificate_holds_and_who_signs_it(tmp_path, gateway, host, signed_by):
    """Round two of the clients' review: with [gateway.acme], status printed https://localhost:PORT and fleet's
    CA file, which the ACME certificate neither names nor comes from."""
    from fleet.control.gateway import door_host, signer

    settings = registry.load(gateway_config(tmp_path, gateway=gateway))
    assert (door_host(settings), signer(settings)) == (host, signed_by)


def test_every_refusal_goes_into_haproxys_configuration_as_is():
    from fleet.gateway import answers

    refusals = [v for v in vars(answers).values() if isinstance(v, answers.Refusal)]
    refusals += [answers.too_large(192), answers.not_served("tiny")]
    assert len(refusals) > 10
    for refusal in refusals:
        assert "'" not in refusal.message and "\\" not in refusal.message and '"' not in refusal.message, refusal
