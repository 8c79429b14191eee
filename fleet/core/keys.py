"""fleet's own key material on the operator's machine: the SSH identity it reaches hosts with, made on
first use beside the database, private to its owner."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import asyncssh


@dataclass(frozen=True)
class SshKey:
    private: Path
    public: str


def ensure_key(path: Path) -> SshKey:
    """fleet's own SSH key (ed25519, private file 0600), made on first use."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    if not path.exists():
        key = asyncssh.generate_private_key("ssh-ed25519", comment="fleet")
        key.write_private_key(str(path))
        path.chmod(0o600)
        key.write_public_key(str(path) + ".pub")
    public = Path(str(path) + ".pub").read_text().strip()
    return SshKey(path, public)
