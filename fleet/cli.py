"""The `fleet` command: a thin skin over the library. Parse, call one function, render.

Exit codes: 0 ok, 1 failed, 2 bad input.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from fleet.localcloud import control

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Keep rented GPU hosts serving llama-server.")
cloud_app = typer.Typer(no_args_is_help=True, help="The local cloud: a vast.ai-compatible marketplace on this machine.")
app.add_typer(cloud_app, name="cloud")

out = Console()
err = Console(stderr=True)

StateDir = Annotated[
    Path | None,
    typer.Option(
        "--state-dir",
        help="The local cloud's state directory (default: $FLEET_LOCALCLOUD_DIR or ~/.local/state/fleet/localcloud).",
    ),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]


def fail(message: str, code: int = 1) -> None:
    err.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(code)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


@cloud_app.command("start")
def cloud_start(
    state_dir: StateDir = None,
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1 (0: any free port).")] = 0,
    json_output: JsonFlag = False,
) -> None:
    """Start the local cloud (no-op when it already runs)."""
    directory = state_dir or control.default_state_dir()
    try:
        info = control.start(directory, port=port)
    except control.CloudControlError as e:
        fail(str(e))
    status = control.status(directory)
    if json_output:
        print_json(status)
    else:
        out.print(f"local cloud at {info.url} (pid {info.pid}); API key in {info.api_key_file}")


@cloud_app.command("stop")
def cloud_stop(state_dir: StateDir = None, json_output: JsonFlag = False) -> None:
    """Stop the local cloud: every host's processes end; instances stay recorded."""
    directory = state_dir or control.default_state_dir()
    stopped = control.stop(directory)
    if json_output:
        print_json({"stopped": stopped})
    else:
        out.print("local cloud stopped" if stopped else "local cloud was not running")


@cloud_app.command("status")
def cloud_status(state_dir: StateDir = None, json_output: JsonFlag = False) -> None:
    """Where the local cloud listens, where its API key is, and how many instances it has."""
    status = control.status(state_dir or control.default_state_dir())
    if json_output:
        print_json(status)
        return
    table = Table(show_header=False)
    for key, value in status.items():
        table.add_row(key, str(value))
    out.print(table)


if __name__ == "__main__":
    app()
