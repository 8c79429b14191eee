"""scripts/lib/cache-lock.sh, the lock under which scripts/build-llama-server, scripts/setup-vllm and
bench/gpu/pack make what they cache: two runs at once make it once, a killed run's leftovers are made again."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HELPER = ROOT / "scripts" / "lib" / "cache-lock.sh"

# a caller as the scripts are: `set -e`, the helper sourced, a maker that notes each run, then takes its time
CALLER = """#!/usr/bin/env bash
set -euo pipefail
. "$HELPER"
maker() {
  echo "$BASHPID" >> "$RUNS"
  touch "$1/begun-$BASHPID"
  sleep "$SLEEP"
  [ -z "${FAIL:-}" ] || exit 3
  echo made > "$1/result"
}
cache_make $MODE "$DIR" test-maker maker
cat "$DIR/result"
"""


class Callers:
    def __init__(self, tmp: Path, mode: str) -> None:
        self.script = tmp / "caller"
        self.script.write_text(CALLER)
        self.script.chmod(0o755)
        self.dir, self.runs, self.mode = tmp / "cache" / "thing", tmp / "runs", mode
        self.started: list[subprocess.Popen] = []

    def start(self, sleep: float = 0, **env: str) -> subprocess.Popen:
        process = subprocess.Popen(
            [str(self.script)],
            env={
                **os.environ,
                "HELPER": str(HELPER),
                "RUNS": str(self.runs),
                "DIR": str(self.dir),
                "MODE": self.mode,
                "SLEEP": str(sleep),
                **env,
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.started.append(process)
        return process

    def makers_run(self) -> int:
        return len(self.runs.read_text().split()) if self.runs.exists() else 0

    def wait_makers(self, count: int) -> None:
        deadline = time.monotonic() + 20
        while self.makers_run() < count:
            assert time.monotonic() < deadline, f"{count} makers never began"
            time.sleep(0.02)

    def end_all(self) -> None:
        for process in self.started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()


@pytest.fixture(params=["", "--in-place"], ids=["renamed", "in-place"])
def callers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callers]:
    made = Callers(tmp_path, request.param)
    try:
        yield made
    finally:
        made.end_all()


def contents(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def test_two_runs_at_once_make_it_once_and_the_second_waits_then_reuses(callers):
    first = callers.start(sleep=1.5)
    callers.wait_makers(1)
    second = callers.start()
    (out1, err1), (out2, err2) = first.communicate(timeout=30), second.communicate(timeout=30)
    assert first.returncode == 0 and second.returncode == 0, err1 + err2
    assert out1 == out2 == "made\n"  # both read the complete result
    assert callers.makers_run() == 1
    assert "test-maker: waiting for another test-maker" in err2 and "waiting" not in err1
    assert len(err2.strip().splitlines()) == 1
    assert {n for n in contents(callers.dir) if not n.startswith("begun-")} == {"result", ".complete"}
    assert not callers.dir.with_name("thing.tmp").exists()
    # a third run finds it stamped: nothing made, nothing waited for
    third = callers.start(sleep=5)
    out3, err3 = third.communicate(timeout=30)
    assert third.returncode == 0 and out3 == "made\n" and err3 == "" and callers.makers_run() == 1


@pytest.mark.parametrize("end", ["killed", "failed"])
def test_what_a_killed_or_failed_maker_left_is_wiped_and_made_again(callers, end):
    if end == "killed":
        first = callers.start(sleep=60)
        callers.wait_makers(1)
        os.killpg(first.pid, signal.SIGKILL)  # the caller and its maker, as a killed setup
        first.communicate(timeout=30)
    else:
        first = callers.start(FAIL="1")
        first.communicate(timeout=30)
        assert first.returncode == 3  # the maker's failure ends its caller
    [left] = [d for d in (callers.dir, callers.dir.with_name("thing.tmp")) if d.exists()]
    assert ".complete" not in contents(left) and "result" not in contents(left)
    again = callers.start()
    out, err = again.communicate(timeout=30)
    assert again.returncode == 0 and out == "made\n", err
    assert callers.makers_run() == 2
    second_maker = callers.runs.read_text().split()[1]
    assert contents(callers.dir) == {f"begun-{second_maker}", "result", ".complete"}  # the first's wiped
    assert not callers.dir.with_name("thing.tmp").exists()
