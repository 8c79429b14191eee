#!/usr/bin/env python3
"""Where a running process's main thread spends its time, by sampling its stack, two ways:
- perf (`--perf SECONDS`): the thread's stacks at a fixed rate while it runs on a CPU, unwound from each sample's
  copy of the stack (DWARF: llama.cpp's builds keep no frame pointers). The process is never stopped. It counts
  time on a CPU only: a thread asleep in a wait is not sampled, so the table also gives how much of the wall
  time the thread ran. bench/gpu/pack carries Debian's perf to the GPU machines.
- a debugger: attaches at random moments, prints thread 1's backtrace and leaves (gdb, or cuda-gdb where that
  is all there is). Each attach stops the process for a fraction of a second, which moves when the next step
  runs but not where a random moment finds the thread; on a busy server the pauses can make it drop a client.

Prints, for the functions seen most, the share of samples whose stack holds them (inclusive) and the share where
they are the innermost frame (exclusive).

Usage: python bench/stacks.py PID [--samples 40] [--depth 40] [--perf SECONDS]
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

# "#3  0x00007f... in server_context_impl::update_slots() () from /x/libllama-server-impl.so" or "#0  func (...)"
FRAME = re.compile(r"^#\d+\s+(?:0x[0-9a-f]+ in )?(?P<rest>.+)$")
PLACE = re.compile(r" (?:from|at) \S+$")


def frame_name(line: str) -> str | None:
    """The function of one backtrace line, its arguments' values taken off (the last balanced parentheses)."""
    if not (m := FRAME.match(line)):
        return None
    return strip_parameters(PLACE.sub("", m["rest"]).rstrip())


@dataclass
class Profile:
    samples: int = 0
    inclusive: Counter[str] = field(default_factory=Counter)
    exclusive: Counter[str] = field(default_factory=Counter)
    on_cpu: float | None = None  # perf: the share of the wall time the thread ran (its samples against the rate's)

    def count(self, frames: list[str]) -> None:
        """One sample's stack, innermost frame first."""
        self.samples += 1
        self.exclusive[frames[0]] += 1
        self.inclusive.update(set(frames))

    def table(self, rows: int = 30) -> str:
        ran = f", on a CPU {self.on_cpu:.0%} of the time (perf)" if self.on_cpu is not None else ""
        lines = [f"{self.samples} samples of the main thread's stack{ran}", "",
                 "| function | in the stack | innermost |", "| --- | ---: | ---: |"]  # fmt: skip
        for name, n in self.inclusive.most_common(rows):
            lines.append(f"| `{name}` | {n / self.samples:.0%} | {self.exclusive[name] / self.samples:.0%} |")
        return "\n".join(lines)


def short(name: str) -> str:
    """A C++ frame's name kept readable in a table: no parameter list, templates' arguments elided, a
    std::function's frame named by the lambda it calls."""
    name = strip_parameters(name).replace("(anonymous namespace)::", "")
    if name.startswith("std::_Function_handler<") and (m := re.search(r", (.*)>::_M_invoke$", name)):
        name = m[1]  # e.g. server_context_impl::post_decode(int, int)::{lambda(server_slot&)#4}
    name = re.sub(r"\([^()]*\)(?=::)", "", name)  # an enclosing function's parameters
    while re.search(r"<[^<>]*>", name):
        name = re.sub(r"<[^<>]*>", "", name)
    name = re.sub(r"^void ", "", name)
    return name if len(name) <= 110 else name[:107] + "..."


def strip_parameters(name: str) -> str:
    """`name` without its last balanced parentheses when it ends with them (a function's parameter list)."""
    if not name.endswith(")"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0:
            return name[:i].rstrip()
    return name


def debugger() -> str:
    for program in ("gdb", "cuda-gdb"):
        if found := shutil.which(program):
            return found
    raise SystemExit("stacks: neither gdb nor cuda-gdb is on PATH")


def backtrace(gdb: str, pid: int, depth: int) -> list[str]:
    """Thread 1's frames, innermost first; [] when the attach failed."""
    argv = [gdb, "-p", str(pid), "-batch", "-nx", "-ex", "set pagination off", "-ex", "thread 1", "-ex", f"bt {depth}"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False).stdout
    except subprocess.TimeoutExpired:
        return []
    return [name for line in out.splitlines() if (name := frame_name(line))]


def sample(pid: int, samples: int, depth: int = 40, budget_s: float = 90.0) -> Profile:
    """Up to `samples` stacks, taken over `budget_s` at most (cuda-gdb may take seconds to attach)."""
    gdb = debugger()
    profile = Profile()
    deadline = time.monotonic() + budget_s
    for _ in range(samples):
        if time.monotonic() > deadline:
            break
        time.sleep(random.uniform(0.05, 0.3))  # no rhythm that could lock onto the server's steps
        if frames := [short(name) for name in backtrace(gdb, pid, depth)]:
            profile.count(frames)
    return profile


PERF_RATE = 499  # samples a second: not a multiple of a step's likely period


def perf_sample(pid: int, seconds: float) -> Profile:
    """The main thread (its id is the process's) sampled by perf for `seconds` while it runs."""
    perf = shutil.which("perf")
    if perf is None:
        raise SystemExit("stacks: perf is not on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/perf.data"
        record = [perf, "record", "-q", "-F", str(PERF_RATE), "--call-graph", "dwarf,32768", "-t", str(pid), "-o", data,
                  "--", "sleep", str(seconds)]  # fmt: skip
        if (done := subprocess.run(record, capture_output=True, text=True, check=False)).returncode != 0:
            raise SystemExit(f"stacks: perf record failed: {done.stderr.strip()[-500:]}")
        script = subprocess.run([perf, "script", "-i", data, "-F", "tid,ip,sym"], capture_output=True, text=True)
    profile = stacks_of(script.stdout)
    profile.on_cpu = profile.samples / (PERF_RATE * seconds)
    return profile


def stacks_of(perf_script: str) -> Profile:
    """`perf script -F tid,ip,sym` output: a sample's line, then a line per frame (address, function), innermost
    first, then a blank line."""
    profile = Profile()
    for block in perf_script.split("\n\n"):
        frames = [short(parts[1]) for line in block.splitlines()[1:] if len(parts := line.split(None, 1)) == 2]
        if frames := [f for f in frames if f != "[unknown]"]:
            profile.count(frames)
    return profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pid", type=int)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--depth", type=int, default=40)
    parser.add_argument("--perf", type=float, default=0, help="sample with perf for this many seconds instead")
    args = parser.parse_args()
    print((perf_sample(args.pid, args.perf) if args.perf else sample(args.pid, args.samples, args.depth)).table())


if __name__ == "__main__":
    main()
