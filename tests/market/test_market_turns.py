"""The install's one budget of marketplace calls (fleet/core/marketpace.py) on a real SQLite file: a call in
flight holds its endpoint for every process, the next call starts its interval after the answer, a process that
died mid-call holds it only until its hold runs out, and a per-minute quota counts starts. The times are given,
not read from a clock: the answers are exact."""

import subprocess
import sys
import time

import pytest

from fleet.core.marketpace import IN_FLIGHT_POLL_S, claim_turn, release_turn
from fleet.core.record import Record, open_database

KEY = "list http://127.0.0.1:1"


def check_turns(record: Record) -> None:
    token, wait = claim_turn(record, KEY, 1.1, 0, now=1000.0, hold_s=30.0)
    assert token is not None and wait == 0.0
    # another process while the call is in flight: asked to look again soon, not given the turn
    assert claim_turn(record, KEY, 1.1, 0, now=1000.05, hold_s=30.0) == (None, IN_FLIGHT_POLL_S)
    # the answer came 0.9 s after the send (a busy machine, a slow server): the interval runs from there
    release_turn(record, KEY, token, 1.1, now=1000.9)
    other, wait = claim_turn(record, KEY, 1.1, 0, now=1001.1, hold_s=30.0)
    assert other is None and wait == pytest.approx(0.9)
    later, wait = claim_turn(record, KEY, 1.1, 0, now=1002.0, hold_s=30.0)
    assert later is not None and wait == 0.0

    # its process died mid-call: the turn stays held until the hold runs out, then another takes it
    assert claim_turn(record, KEY, 1.1, 0, now=1031.0, hold_s=30.0)[0] is None
    taken, _ = claim_turn(record, KEY, 1.1, 0, now=1032.5, hold_s=30.0)
    assert taken is not None
    # the dead call's answer arriving after all frees nothing of the new holder's turn
    release_turn(record, KEY, later, 1.1, now=1032.6)
    assert claim_turn(record, KEY, 1.1, 0, now=1034.0, hold_s=30.0) == (None, IN_FLIGHT_POLL_S)

    # ten searches a minute: the eleventh waits for the first to leave the minute
    search = "search http://127.0.0.1:1"
    for i in range(10):
        token, wait = claim_turn(record, search, 0.0, 10, now=2000.0 + i, hold_s=30.0)
        assert token is not None, i
        release_turn(record, search, token, 0.0, now=2000.0 + i + 0.5)
    assert claim_turn(record, search, 0.0, 10, now=2010.0, hold_s=30.0) == (None, pytest.approx(50.0))
    assert claim_turn(record, search, 0.0, 10, now=2060.01, hold_s=30.0)[0] is not None


def test_turns_at_the_marketplace_on_sqlite(tmp_path):
    check_turns(Record(open_database(tmp_path / "fleet.db")))


HOLDER = """
import sys, time
from pathlib import Path
from fleet.core.marketpace import claim_turn
from fleet.core.record import Record, open_database
token, _ = claim_turn(Record(open_database(Path(sys.argv[1]))), sys.argv[2], 1.1, 0, time.time(), 30.0)
assert token is not None
print("holding", flush=True)
time.sleep(60)
"""


def test_a_turn_held_by_a_killed_process_blocks_until_its_hold_runs_out(tmp_path):
    """A process SIGKILLed mid-call never gives its turn back: the others wait for it (the marketplace may still be
    answering it), but only for as long as the hold, never for ever."""
    path = tmp_path / "fleet.db"
    record = Record(open_database(path))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), KEY], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    finally:
        holder.kill()
        holder.wait()
    now = time.time()
    assert claim_turn(record, KEY, 1.1, 0, now=now, hold_s=30.0) == (None, IN_FLIGHT_POLL_S)
    token, wait = claim_turn(record, KEY, 1.1, 0, now=now + 31.2, hold_s=30.0)
    assert token is not None and wait == 0.0
