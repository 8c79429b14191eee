"""The `fleet` command: a thin skin over the library. Each command parses its arguments, makes one call into
the library (fleet/app.py's Fleet, or a controller), and renders what came back (render.py).

Exit codes: 0 ok, 1 failed, 2 bad input.
"""

from __future__ import annotations

import json
import sys

import typer
from typer.exceptions import Abort, Exit, TyperException

from fleet.cli import cloud, doctor, gateway, hosts, measure, offers, rotation

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
    "doctor": doctor.doctor_cmd,
}
for name, command in COMMANDS.items():
    app.command(name)(command)
for name, command in {"start": cloud.cloud_start, "stop": cloud.cloud_stop, "status": cloud.cloud_status}.items():
    cloud_app.command(name)(command)


def main() -> None:
    """The `fleet` command. Under `--json`, a usage error typer finds before any command runs (an option's value
    of the wrong type, an unknown option, a missing argument) is one line on stdout, `{"error": ...}`, and exit 2,
    as every error a command finds is: a script reads JSON whatever went wrong."""
    if "--json" not in sys.argv[1:]:
        app()
        return
    try:
        code = app(standalone_mode=False)
    except Exit as e:
        sys.exit(e.exit_code)
    except Abort:  # a confirmation declined, or no input left to answer it
        print(json.dumps({"error": "aborted"}))
        sys.exit(1)
    except TyperException as e:  # click's errors: a usage error exits 2
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        print(json.dumps({"error": message.splitlines()[0] if message else type(e).__name__}))
        sys.exit(getattr(e, "exit_code", 1))
    sys.exit(code if isinstance(code, int) else 0)
