"""The order the test modules are handed to pytest-xdist's workers: longest first.

Each worker holds a module whole (`--dist loadfile`: a module shares its local cloud), and takes the next one
when it is nearly done. Handed out longest first, no long module starts last and keeps one worker busy while
the others stand idle (xdist's own order, by the number of tests in a module, ended quiet runs with two
minutes of idle cores). The times are measured ones (tests/module-seconds.txt); a module not listed counts as
the median, a stale list costs only time.

`python -m tests.schedule LOG` prints the list afresh from the log of `scripts/test --durations=0`.
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import Counter
from pathlib import Path

import pytest

SECONDS_FILE = Path(__file__).with_name("module-seconds.txt")
HEADER = """\
# Each test module's time (setup, call, teardown) in a quiet run of scripts/test on 2 cores: the order the
# modules are handed to the workers, longest first (tests/schedule.py). Refresh it from a run's log:
#   scripts/test --durations=0 > run.log; .venv/bin/python -m tests.schedule run.log > tests/module-seconds.txt
"""
DURATION = re.compile(r"^([0-9.]+)s (?:setup|call|teardown) +(\S+?)::")


def module_seconds(text: str) -> dict[str, float]:
    """The `seconds module` lines of the list (comments and blank lines skipped)."""
    seconds = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            value, module = line.split()
            seconds[module] = float(value)
    return seconds


def longest_first(items: list[pytest.Item], seconds: dict[str, float]) -> None:
    """Sort `items` in place by their module's time, longest first; a module's own tests keep their order."""
    unknown = statistics.median(seconds.values()) if seconds else 0.0
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], unknown))


def from_durations(log: str) -> dict[str, float]:
    """Each module's time summed from pytest's `--durations=0` report."""
    totals: Counter[str] = Counter()
    for line in log.splitlines():
        if found := DURATION.match(line):
            totals[found[2]] += float(found[1])
    return dict(totals)


if __name__ == "__main__":
    measured = from_durations(Path(sys.argv[1]).read_text())
    if not measured:
        sys.exit(f"{sys.argv[1]}: no durations in it (run scripts/test --durations=0)")
    print(HEADER, end="")
    for module, value in sorted(measured.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"{round(value)} {module}")
