"""`fleet gateway`: the agents' one HTTPS endpoint per [[serve]] target (start, stop, status) and their keys
(key add, list, revoke)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from fleet.app import open_fleet
from fleet.cli import render
from fleet.cli.common import ConfigPath, JsonFlag, load_settings, reporter, run_async
from fleet.control import gateway

app = typer.Typer(
    no_args_is_help=True, help="The agents' one endpoint: HAProxy in front of the hosts, driven by fleet."
)
key_app = typer.Typer(no_args_is_help=True, help="The agents' keys to the gateway (kept hashed).")
app.add_typer(key_app, name="key")


def _run(config_path: Any, json_output: bool, work: Any) -> Any:
    settings = load_settings(config_path)

    async def go() -> Any:
        async with open_fleet(settings, reporter(json_output)) as fleet:
            return await work(fleet)

    return run_async(go)


@app.command("start")
def start_cmd(json_output: JsonFlag = False, config_path: ConfigPath = None) -> None:
    """Start the gateway (HAProxy, one HTTPS endpoint per serve target) and put the READY hosts behind it.
    Idempotent; `fleet daemon` keeps it (restarted if it dies, every change applied)."""
    shown = _run(config_path, json_output, gateway.start)
    render.print_json(shown) if json_output else _show(shown)


@app.command("stop")
def stop_cmd(
    grace: Annotated[float, typer.Option("--grace", help="Seconds the calls in flight get to finish.")] = 0.0,
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """Stop the gateway: its HAProxy ended, its ports closed."""
    pid = _run(config_path, json_output, lambda fleet: gateway.stop(fleet, grace))
    if json_output:
        render.print_json({"stopped": pid})
    else:
        render.line(f"gateway stopped (HAProxy pid {pid})" if pid else "no gateway was running")


@app.command("status")
def status_cmd(json_output: JsonFlag = False, config_path: ConfigPath = None) -> None:
    """Each target's URL, its hosts (state, streams now, limit) and its count of calls."""
    shown = _run(config_path, json_output, gateway.status)
    render.print_json(shown) if json_output else _show(shown)


@app.command("peer-certificate")
def peer_certificate_cmd(
    name: Annotated[str, typer.Argument(help="The peer's name, as gateway.peer_name on its machine.")],
    out: Annotated[Path, typer.Option("--out", help="The folder the certificate and key are written to.")],
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """Sign a gateway peer's certificate with fleet's CA, here where its key is: the peer's machine then runs
    its gateway with gateway.peer_certificate_file and peer_key_file set, and no CA key of its own."""

    async def work(fleet: Any) -> Any:
        return gateway.peer_certificate(fleet, name, out)

    made = _run(config_path, json_output, work)
    if json_output:
        render.print_json(made)
    else:
        render.line(f"peer {name}: certificate {made['certificate_file']}, key {made['key_file']} (0600)")


@key_app.command("add")
def key_add_cmd(
    name: Annotated[str, typer.Argument(help="The agent's name (letters, digits, _ . @ -).")],
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """Make a key for an agent. It is printed once: fleet keeps its hash alone."""
    key = _run(config_path, json_output, lambda fleet: gateway.add_key(fleet, name))
    if json_output:
        render.print_json({"name": name, "key": key})
    else:
        render.line(key)


@key_app.command("list")
def key_list_cmd(json_output: JsonFlag = False, config_path: ConfigPath = None) -> None:
    """The agents' keys: names and dates (the keys themselves are not kept)."""

    async def work(fleet: Any) -> Any:
        return gateway.list_keys(fleet)

    keys = _run(config_path, json_output, work)
    if json_output:
        render.print_json(keys)
        return
    for k in keys:
        state = f"revoked {k['revoked_at'][:19]}" if k["revoked_at"] else "live"
        render.line(f"{k['name']:<24} added {k['created_at'][:19]}  {state}")


@key_app.command("revoke")
def key_revoke_cmd(
    name: Annotated[str, typer.Argument(help="The agent whose key ends.")],
    json_output: JsonFlag = False,
    config_path: ConfigPath = None,
) -> None:
    """Revoke an agent's key: this machine's gateway refuses it at once."""
    count = _run(config_path, json_output, lambda fleet: gateway.revoke_key(fleet, name))
    if json_output:
        render.print_json({"name": name, "revoked": count})
    else:
        render.line(f"revoked {name}'s key")


def _show(status: dict[str, Any]) -> None:
    state = f"running (HAProxy pid {status['pid']})" if status["running"] else "not running"
    trust = {
        "acme": "an ACME CA's certificate: agents verify it with their system's trust store",
        "own": "your certificate: agents verify it with your CA",
    }.get(status["signed_by"], f"verify with {status['ca_file']}")
    render.line(f"gateway: {state}; {len(status['agents'])} agent key(s); {trust}")
    render.line(f"  check a client's trust: {status['tls_check']}")
    for t in status["targets"]:
        calls = ", ".join(f"{k} {v}" for k, v in sorted(t["calls"].items())) or "none yet"
        render.line(f"  {t['model']} in {t['region']}: {t['base_url']}  (model {t['alias']!r}; requests: {calls})")
        for h in t["hosts"]:
            render.line(
                f"    slot {h['slot']:<3} {h['host'] or '-':<32} {h['status']:<10} {h['streams']}/{h['limit']} streams"
                f"  {_felt(h)}"
            )


def _felt(host: dict[str, Any]) -> str:
    """What the agents felt on a host: first content p50/p95 and the warm turns that hit its cache."""
    if host["first_content_p50_ms"] is None:
        first = "first content: no answer yet"
    else:
        first = f"first content p50 {host['first_content_p50_ms']:.0f} ms, p95 {host['first_content_p95_ms']:.0f} ms"
    share = host["warm_turns_cached_share"]
    cache = f"; {host['warm_turns_cached']}/{host['warm_turns']} warm turns cached" if share is not None else ""
    return first + cache
