"""One bring-up attempt of a host (a new rent, or a start from the standby pool): the report `fleet up`
prints and the `attempts` row the record keeps, opened with the intent and closed with its outcome."""

from __future__ import annotations

from dataclasses import dataclass

from fleet.context import Context
from fleet.core.models import Attempt, Host


@dataclass
class AttemptReport:
    host: str
    offer_id: int
    machine_id: int
    gpu_name: str
    geolocation: str
    dph_total: float
    inet_usd_per_gb: float
    outcome: str
    phase: str | None = None
    reason: str | None = None
    seconds: float = 0.0
    resumed: bool = False  # a host of the standby pool started again, not a new rent

    @classmethod
    def of(cls, host: Host, resumed: bool = False) -> AttemptReport:
        """A report of a bring-up of `host` (its offer's fields are on it), ready until it fails."""
        inet = max(host.inet_up_usd_per_gb, host.inet_down_usd_per_gb)
        return cls(host.name, host.offer_id, host.machine_id, host.gpu_name, host.geolocation, host.dph_total, inet,
                   outcome="ready", resumed=resumed)  # fmt: skip


def attempt_row(run_id: str, host: Host) -> Attempt:
    """The attempts row of one bring-up of `host`; its host_id is set by Record.reserve for a host not yet
    written."""
    return Attempt(
        run_id=run_id,
        host_id=host.id,
        model=host.model,
        offer_id=host.offer_id,
        machine_id=host.machine_id,
        dph_total=host.dph_total,
        inet_usd_per_gb=max(host.inet_up_usd_per_gb, host.inet_down_usd_per_gb),
    )


def end_attempt(ctx: Context, host: Host, phase: str | None, reason: str | None) -> None:
    """Close the host's latest attempt: failed in `phase`, or ready when there is none."""
    assert host.id is not None
    ctx.record.close_attempt(host.id, "failed" if phase else "ready", phase, reason)
