"""What must hold after any crash, race or storm, read from the two books: the local cloud's own state
(every instance it ever created, its charges, what still runs) and fleet's record (a SQLite file).

Used by the reliability tests and by bench/chaos.py."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from fleet.localcloud import procs


@dataclass
class Findings:
    leaked: list[int] = field(default_factory=list)  # instances the marketplace still runs
    duplicates: list[str] = field(default_factory=list)  # labels (intents) that bought more than one instance
    lost: list[int] = field(default_factory=list)  # instances the marketplace made that no host row knows
    open_bills: list[str] = field(default_factory=list)  # hosts whose bill is still open
    wrong_costs: list[str] = field(default_factory=list)  # closed costs far from what the marketplace charged
    processes: list[int] = field(default_factory=list)  # host processes left running

    def clean(self) -> bool:
        return not any(vars(self).values())


def cloud_books(state_dir: Path) -> dict:
    return json.loads((state_dir / "state.json").read_text())


def record_hosts(database: Path) -> list[dict]:
    with sqlite3.connect(database) as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT * FROM hosts")]


def settled(state_dir: Path, databases: list[Path], *, cost_slack_s: float = 180.0) -> Findings:
    """Compare the books once everything is supposed to be over (after reconcile and destroy --all)."""
    books = cloud_books(state_dir)
    hosts = [h for d in databases if d.exists() for h in record_hosts(d)]
    found = Findings()
    found.leaked = sorted(int(i) for i in books["instances"])
    by_label: dict[str, list[int]] = {}
    for charge in books["charges"]:
        by_label.setdefault(charge["label"] or "", []).append(charge["instance_id"])
    # one instance may have several charges (running, stopped for the standby pool, running again): a label
    # bought twice is one with more than one instance
    found.duplicates = sorted(label for label, ids in by_label.items() if label and len(set(ids)) > 1)
    known = {h["instance_id"] for h in hosts if h["instance_id"] is not None}
    found.lost = sorted(c["instance_id"] for c in books["charges"] if c["instance_id"] not in known)
    found.open_bills = sorted(h["name"] for h in hosts if h["destroyed_at"] is None)
    charges: dict[int, list[dict]] = {}
    for c in books["charges"]:
        charges.setdefault(c["instance_id"], []).append(c)
    for h in hosts:
        mine = charges.get(h["instance_id"])
        if not mine or any(c["end"] is None for c in mine) or h["accrued_usd"] is None:
            continue
        true_cost = sum(charged(c) for c in mine)
        if abs(h["accrued_usd"] - true_cost) > h["dph_total"] * cost_slack_s / 3600:
            found.wrong_costs.append(f"{h['name']}: recorded ${h['accrued_usd']:.5f}, charged ${true_cost:.5f}")
    found.processes = host_processes(state_dir)
    return found


def charged(charge: dict) -> float:
    """What one charge of the cloud's books came to: hours at its rate, or bytes at the offer's $/GB."""
    if charge.get("kind") == "bandwidth":
        return (charge["bytes_down"] * charge["usd_per_gb_down"] + charge["bytes_up"] * charge["usd_per_gb_up"]) / 1e9
    return charge["dph_total"] * (charge["end"] - charge["start"]) / 3600


def host_processes(state_dir: Path) -> list[int]:
    """Every process of any host of this cloud, live or destroyed: those carrying a host marker whose working
    directory is under the cloud's hosts/, and those whose command line names it (sshd names its config)."""
    hosts_dir = str((state_dir / "hosts").resolve())
    marker = f"{procs.MARKER}=".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            marked = any(v.startswith(marker) for v in (entry / "environ").read_bytes().split(b"\0"))
            cwd = str((entry / "cwd").resolve()) if marked else ""
        except OSError:
            continue
        if hosts_dir.encode() in cmdline or (marked and cwd.startswith(hosts_dir)):
            found.append(int(entry.name))
    return sorted(found)
