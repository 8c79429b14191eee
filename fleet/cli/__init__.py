"""The `fleet` command: a thin skin over the library. Each command parses its arguments, makes one call into
the library (fleet/app.py's Fleet, or a controller), and renders what came back (render.py).

Exit codes: 0 ok, 1 failed, 2 bad input.
"""

from __future__ import annotations

import typer

from fleet.cli import cloud, gateway, hosts, measure, offers, rotation

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Keep rented GPU hosts serving llama-server.")
cloud_app = typer.Typer(no_args_is_help=True, help="The local cloud: a vast.ai-compatible marketplace on this machine.")
app.add_typer(cloud_app, name="cloud")
app.add_typer(gateway.app, name="gateway")

COMMANDS = {
    "offers": offers.offers_cmd,
    "plan": offers.plan_cmd,
    "up": hosts.up_cmd,
    "standby": hosts.standby_cmd,
    "status": hosts.status_cmd,
    "serve": hosts.serve_cmd,
    "report": measure.report_cmd,
    "machines": measure.machines_cmd,
    "endpoints": hosts.endpoints_cmd,
    "destroy": hosts.destroy_cmd,
    "probe": measure.probe_cmd,
    "bench": measure.bench_cmd,
    "health": rotation.health_cmd,
    "reprice": rotation.reprice_cmd,
    "daemon": rotation.daemon_cmd,
    "reconcile": rotation.reconcile_cmd,
}
for name, command in COMMANDS.items():
    app.command(name)(command)
for name, command in {"start": cloud.cloud_start, "stop": cloud.cloud_stop, "status": cloud.cloud_status}.items():
    cloud_app.command(name)(command)
