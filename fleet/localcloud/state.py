"""The local cloud's settings and its state on disk: `state.json` (instances, SSH keys, charges, next ids),
written atomically and private, so `fleet` commands see the same instances across restarts.

A change is written within SAVE_DELAY_S, and before any answer of the API is sent (StateWriter): what a
client was shown is on disk, while the changes of many hosts booting at once share a write (at 1,000 hosts
the file is megabytes, and a write for each change took most of the cloud's CPU)."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.localcloud.billing import Charge
from fleet.localcloud.instances import Instance


@dataclass
class CloudSettings:
    """How the cloud behaves. The defaults are vast.ai's hardest documented forms (docs/vast-fidelity.md),
    with boot phases shortened from minutes to seconds. `kind` turns off the time-based hardships (rate
    limits, read lag, late SSH keys, heartbeat gaps) for tests that say why; the structure (NAT, SSH,
    environment, error shapes, money) never changes."""

    state_dir: Path
    offers_dir: Path
    llama_server: Path | None = None
    vllm_python: Path | None = None  # scripts/setup-vllm's environment: what a vLLM image's hosts run
    provision_delay_s: float = 0.6  # null -> scheduling -> created, a third each
    loading_delay_s: float = 1.0
    # seconds here for each second an image's pull takes at its machine's link (a 5 GB image at 128 Mbit/s: 5 min
    # on vast.ai, 3 s here)
    pull_time_scale: float = 0.01
    hub_bytes_per_s: int = 4 * 1024 * 1024  # per connection, like a CDN edge
    kind: bool = False
    # every host simulated (simboot.py), decoding as this model of the card's measured tables (cardmodel.py):
    # a thousand hosts on one machine. None (the default): real hosts
    simulated_card: str | None = None

    @property
    def read_lag_s(self) -> float:
        """How long a new instance stays invisible to show and list."""
        return 0.0 if self.kind else 3.0

    @property
    def key_lag_s(self) -> float:
        """How long after `running` the account's SSH keys reach the host (auth fails meanwhile)."""
        return 0.0 if self.kind else 1.5


@dataclass
class State:
    next_instance_id: int = 1001
    next_key_id: int = 1
    instances: dict[int, Instance] = field(default_factory=dict)
    ssh_keys: list[dict[str, Any]] = field(default_factory=list)
    charges: list[Charge] = field(default_factory=list)
    offer_overrides: dict[int, dict[str, Any]] = field(default_factory=dict)
    removed_offers: list[int] = field(default_factory=list)
    destroyed: list[int] = field(default_factory=list)  # ids that existed: show answers them as gone
    # the last row of some of those: show answers it with the statuses of a destroyed instance
    destroyed_rows: dict[int, dict[str, Any]] = field(default_factory=dict)
    # the account's environment variables (`vastai create env-var`): in every container it rents
    account_env: dict[str, str] = field(default_factory=dict)


def load_state(path: Path) -> State:
    if not path.exists():
        return State()
    raw = json.loads(path.read_text())
    return State(
        next_instance_id=raw["next_instance_id"],
        next_key_id=raw["next_key_id"],
        instances={int(k): Instance(**v) for k, v in raw["instances"].items()},
        ssh_keys=raw["ssh_keys"],
        charges=[Charge(**c) for c in raw["charges"]],
        offer_overrides={int(k): v for k, v in raw.get("offer_overrides", {}).items()},
        removed_offers=raw.get("removed_offers", []),
        destroyed=raw.get("destroyed", []),
        destroyed_rows={int(k): v for k, v in raw.get("destroyed_rows", {}).items()},
        account_env=raw.get("account_env", {}),
    )


def save_state(path: Path, s: State) -> None:
    raw = {
        "next_instance_id": s.next_instance_id,
        "next_key_id": s.next_key_id,
        "instances": {str(k): vars(v) for k, v in s.instances.items()},
        "ssh_keys": s.ssh_keys,
        "charges": [vars(c) for c in s.charges],
        "offer_overrides": {str(k): v for k, v in s.offer_overrides.items()},
        "removed_offers": s.removed_offers,
        "destroyed": s.destroyed,
        "destroyed_rows": {str(k): v for k, v in s.destroyed_rows.items()},
        "account_env": s.account_env,
    }
    write_json_atomic(path, raw)


SAVE_DELAY_S = 0.2


class StateWriter:
    """Writes the state once for the changes marked since its last write: at the latest SAVE_DELAY_S after
    the first of them, or at once on `flush` (before an answer is sent, at shutdown). Without a running
    event loop, a change is written at once."""

    def __init__(self, path: Path, state: State) -> None:
        self.path, self.state = path, state
        self._pending: asyncio.TimerHandle | None = None
        self._dirty = False

    def mark(self) -> None:
        self._dirty = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        if self._pending is None:
            self._pending = loop.call_later(SAVE_DELAY_S, self.flush)

    def flush(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        if self._dirty:
            self._dirty = False
            save_state(self.path, self.state)


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        # json.dumps, compact: json's C encoder (json.dump, or an indent, takes its pure-Python path: 4.5 times the
        # CPU, and at 1,000 hosts most of the cloud's)
        f.write(json.dumps(data, sort_keys=True, separators=(",", ":")))
    os.replace(tmp, path)
