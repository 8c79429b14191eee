"""The synthetic voice call (data/call.json) that the cache probe and `fleet bench` replay."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any


@dataclass(frozen=True)
class Call:
    system: str
    tools: list[dict[str, Any]]
    user_turns: list[str]

    def with_system_chars(self, chars: int) -> Call:
        """The same call with the system prompt cut to `chars` characters (at a line end where possible)."""
        if chars >= len(self.system):
            return self
        cut = self.system.rfind("\n", 0, chars)
        return Call(self.system[: cut if cut > chars // 2 else chars], self.tools, self.user_turns)


@cache
def load_call() -> Call:
    raw = json.loads(resources.files("fleet.probes").joinpath("data/call.json").read_text())
    return Call(raw["system"], raw["tools"], raw["user_turns"])
