"""The root of fleet's own errors: each says what went wrong in one line and carries the exit code the
command ends with (1 failed, 2 bad input). The CLI catches FleetError; anything else is a bug."""

from __future__ import annotations


class FleetError(Exception):
    exit_code = 1
    prefix = ""  # what the one-line message starts with ("marketplace", "plan", ...)


class BadInput(FleetError):
    """The user's input (a flag, a name, fleet.toml) is wrong: nothing was done."""

    exit_code = 2
