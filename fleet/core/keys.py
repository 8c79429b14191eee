"""fleet's own key material on the operator's machine: the SSH identity it reaches hosts with, made on
first use beside the database, private to its owner."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import asyncssh

from fleet.core.files import write_private, write_public


@dataclass(frozen=True)
class SshKey:
    private: Path
    public: str


def ensure_key(path: Path) -> SshKey:
    """fleet's own SSH key (ed25519, private file 0600 from its first byte), made on first use; two
    processes making it at once agree on one."""
    if not path.exists():
        key = asyncssh.generate_private_key("ssh-ed25519", comment="fleet")
        write_private(path, key.export_private_key())
    public = asyncssh.read_private_key(str(path)).export_public_key().decode().strip()
    public_path = Path(str(path) + ".pub")
    if not public_path.exists() or public_path.read_text().strip() != public:
        write_public(public_path, (public + "\n").encode())
    return SshKey(path, public)
