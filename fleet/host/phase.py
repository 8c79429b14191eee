"""A phase of a bring-up that failed, and whom to blame."""

from __future__ import annotations

from fleet.core.errors import FleetError


class PhaseFailed(FleetError):
    """A phase of a bring-up failed: destroy the instance and try the next offer. `blacklist`: the machine
    is to blame (not the marketplace's answer), so it is not tried again for a while. `retry` false: the
    software or the profile is to blame (the server build, the template, the flags), so every other
    machine would fail the same: the bring-up stops instead of renting the next offer."""

    def __init__(self, phase: str, reason: str, *, blacklist: bool = True, retry: bool = True) -> None:
        super().__init__(f"{phase}: {reason}")
        self.phase = phase
        self.reason = reason
        self.blacklist = blacklist
        self.retry = retry


class DiskFull(PhaseFailed):
    """The host's disk filled (the image did not fit, or the weights after it). The profile's disk_gb or the
    image's size may be to blame as much as the machine, which blames none; two machines filling alike show it
    is the profile's (one machine's word alone never stops a bring-up)."""

    def __init__(self, phase: str, reason: str) -> None:
        super().__init__(phase, reason, blacklist=False)
