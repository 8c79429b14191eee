"""The local cloud's errors, in the body shapes vast.ai answers them with."""

from __future__ import annotations

from typing import Any

# vast.ai's docs: "Some endpoints omit the boolean `success`. Some omit `error` and return only `msg` or
# `message`." Each error is answered in one of these shapes, by endpoint.
FULL = "full"  # {"success": false, "error": ..., "msg": ...}
NO_SUCCESS = "no_success"  # {"error": ..., "msg": ...}
MESSAGE_ONLY = "message_only"  # {"message": ...}
TEXT = "text"  # the words alone, as text/plain


class ApiError(Exception):
    """An error answered with vast.ai's body shape: {"success": false, "error": ..., "msg": ...}, or one of
    the sparser shapes some endpoints use."""

    def __init__(self, status: int, error: str, msg: str, shape: str = FULL, **extra: Any) -> None:
        super().__init__(msg)
        self.status = status
        self.shape = shape
        if shape == NO_SUCCESS:
            self.body: dict[str, Any] | str = {"error": error, "msg": msg, **extra}
        elif shape == MESSAGE_ONLY:
            self.body = {"message": msg}
        elif shape == TEXT:
            self.body = msg
        else:
            self.body = {"success": False, "error": error, "msg": msg, **extra}
