"""`fleet cloud start|stop|status`: the local cloud, a vast.ai-compatible marketplace on this machine."""

from __future__ import annotations

from typing import Annotated

import typer

from fleet.cli import render
from fleet.cli.common import JsonFlag, StateDir, fail
from fleet.localcloud import control


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
        render.print_json(status)
    else:
        render.out.print(f"local cloud at {info.url} (pid {info.pid}); API key in {info.api_key_file}")


def cloud_stop(state_dir: StateDir = None, json_output: JsonFlag = False) -> None:
    """Stop the local cloud: every host's processes end; instances stay recorded."""
    directory = state_dir or control.default_state_dir()
    stopped = control.stop(directory)
    if json_output:
        render.print_json({"stopped": stopped})
    else:
        render.out.print("local cloud stopped" if stopped else "local cloud was not running")


def cloud_status(state_dir: StateDir = None, json_output: JsonFlag = False) -> None:
    """Where the local cloud listens, where its API key is, and how many instances it has."""
    status = control.status(state_dir or control.default_state_dir())
    if json_output:
        render.print_json(status)
        return
    render.pairs(status)
