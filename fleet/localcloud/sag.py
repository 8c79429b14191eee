"""A decode sag (a hot card, emulated): a host's llama-server stopped for a share of every period, from a thread
of its own. Run from the cloud's event loop, a stop waited for that loop: while the loop was held up (a busy
machine, a large state write) the host ran unstopped, and a thermal probe's sample taken then read full speed
(run 27 of the suite beside a CPU hog read a sagging host at 0.86 of its cold rate)."""

from __future__ import annotations

import threading
import time

from fleet.localcloud import procs

MAKEUP_S = 1.0  # the longest stop added to make up for a late wakeup


class DutyCycle:
    """Stops `pids` for `share` of each period, from the first `set` until `stop`. The loop that knows the share
    and the host's processes updates them with `set`; the cycle itself never waits for that loop."""

    def __init__(self, period_s: float) -> None:
        self._period_s = period_s
        self._lock = threading.Lock()
        self._pids: list[int] = []
        self._share = 0.0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def set(self, pids: list[int], share: float) -> None:
        with self._lock:
            self._pids, self._share = list(pids), share
        if self._thread is None:
            self._done.clear()
            self._thread = threading.Thread(target=self._run, name="decode-sag", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Ends the cycle, if one runs, with every process running; a later `set` starts it again."""
        if self._thread is not None:
            self._done.set()
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        owed = 0.0  # the stopped time a late wakeup still owes
        while not self._done.is_set():
            with self._lock:
                pids, share = self._pids, self._share
            began = time.monotonic()
            procs.pause(pids)
            try:
                self._done.wait(self._period_s * share + owed)
            finally:
                procs.resume(pids)
            stopped = time.monotonic() - began
            self._done.wait(self._period_s * (1 - share))
            owed = min(MAKEUP_S, max(0.0, owed + share * (time.monotonic() - began) - stopped))
