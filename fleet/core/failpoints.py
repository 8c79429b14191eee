"""Named points where a test makes fleet crash, to prove a crash anywhere leaves nothing billing unseen.

`FLEET_CRASH_AT=after_create` makes the process SIGKILL itself when it reaches that point, as a power
cut or an OOM kill would: no `finally`, no cleanup. Unset (always, outside tests), reaching a point does
nothing. The points: after_intent (the host row written), create_sent (the request leaves),
create_answered (an instance bought, its id not yet recorded), mid_pull, mid_destroy (the destroy call
answered, the bill not yet closed), mid_stop (a standby host's stop answered, not yet STANDBY), and
after_<phase> for every bring-up phase (after_create, after_boot, after_connect, after_pull, after_start,
after_probes).
"""

from __future__ import annotations

import os
import signal

ENV = "FLEET_CRASH_AT"


def reach(point: str) -> None:
    if os.environ.get(ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)
