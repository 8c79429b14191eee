"""The local cloud's errors, in the body shape vast.ai answers them with."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error answered with vast.ai's body shape: {"success": false, "error": ..., "msg": ...}."""

    def __init__(self, status: int, error: str, msg: str, **extra: Any) -> None:
        super().__init__(msg)
        self.status = status
        self.body = {"success": False, "error": error, "msg": msg, **extra}
