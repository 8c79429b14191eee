"""A fleet install running beside the test session, as on a machine where `scripts/demo` left its gateway up:
a gateway on fleet.toml's own ports (8443, metrics 9465), its state and record in a private folder. Every test
chooses its own ports; this proves it does (a test on the shipped ports fails with "taken by another process")."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from tests.fleetkit import ROOT, write_config
from tests.helpers import processes_mentioning

FLEET = Path(sys.executable).with_name("fleet")  # .venv/bin/fleet beside .venv/bin/pytest
# what another install's commands must not inherit from the session that runs the tests
NOT_INHERITED = ("FLEET_CONFIG", "FLEET_DATABASE_URL", "FLEET_LOCALCLOUD_DIR", "FLEET_STATE_DIR", "FLEET_CACHE_DIR")


def shipped_ports() -> list[int]:
    gateway = tomllib.loads((ROOT / "fleet.toml").read_text())["gateway"]
    return [gateway["port"], gateway["metrics_port"]]


def held(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class InstallBeside:
    """`fleet gateway start` of the repo's fleet.toml in a state folder of its own; `stop` ends it and says
    what, if anything, it left behind."""

    def __init__(self) -> None:
        self.state = Path(tempfile.mkdtemp(prefix="fleet-beside-"))
        env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
        self.env = {**env, "FLEET_STATE_DIR": str(self.state), "FLEET_CONFIG": str(write_config(self.state))}
        self.pid: int | None = None

    def fleet(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(FLEET), *args], env=self.env, capture_output=True, text=True, timeout=120)

    def start(self) -> str:
        started = self.fleet("gateway", "start", "--json")
        if started.returncode != 0:
            shutil.rmtree(self.state, ignore_errors=True)
            raise RuntimeError(f"the install beside the tests did not start its gateway: {started.stdout}")
        self.pid = json.loads(started.stdout)["pid"]
        ports = shipped_ports()
        if not all(held(p) for p in ports):
            problems = self.stop()
            raise RuntimeError(f"the gateway beside the tests holds not all of {ports}: {problems}")
        return f"a fleet install runs beside the tests: its gateway (HAProxy pid {self.pid}) on {ports} ({self.state})"

    def stop(self) -> list[str]:
        """Stop its gateway: what is wrong afterwards (nothing, when all went)."""
        stopped = self.fleet("gateway", "stop", "--json")
        problems = []
        if stopped.returncode != 0 or json.loads(stopped.stdout or "{}") != {"stopped": self.pid}:
            problems.append(f"`fleet gateway stop` said {stopped.stdout.strip()} {stopped.stderr.strip()}")
        if self.pid is not None and Path(f"/proc/{self.pid}").exists():
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                problems.append(f"its HAProxy (pid {self.pid}) still runs")
        if left := processes_mentioning(self.state):
            problems.append(f"processes of it left running: {left}")
        if not problems:
            shutil.rmtree(self.state, ignore_errors=True)
        return problems
