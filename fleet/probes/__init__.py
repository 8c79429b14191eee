"""Probes: each returns a typed ProbeResult with its evidence, and a pure verdict function behind it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ProbeResult:
    name: str
    passed: bool
    diagnosis: str
    metrics: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
