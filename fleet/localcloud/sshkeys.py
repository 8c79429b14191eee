"""The account's SSH keys, as vast.ai keeps them: a key added to the account reaches instances made after it
(the platform's init installs them); a key attached to one instance reaches it at once; a deleted key stays
listed with `deleted_at`; an account that never had one answers the listing with a 404."""

from __future__ import annotations

import re
import time
from typing import Any

from fleet.localcloud.apierror import MESSAGE_ONLY, TEXT, ApiError
from fleet.localcloud.hosts import LocalHost
from fleet.localcloud.instances import Instance
from fleet.localcloud.simboot import SimulatedLocalHost
from fleet.localcloud.state import State

SSH_KEY = re.compile(r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-\S+) [A-Za-z0-9+/=]+( .*)?$")


class SshKeys:
    """The part of the Cloud that keeps the account's SSH keys."""

    state: State

    def save(self) -> None:
        raise NotImplementedError

    def host_for(self, inst: Instance) -> LocalHost | SimulatedLocalHost:
        raise NotImplementedError

    def _visible(self, inst: Instance, now: float) -> bool:
        raise NotImplementedError

    def add_ssh_key(self, body: Any) -> dict[str, Any]:
        key = body.get("ssh_key") if isinstance(body, dict) else None
        if not isinstance(key, str) or not key.strip():
            raise ApiError(400, "invalid_args", "No ssh key provided")
        if not SSH_KEY.match(key.strip()):
            raise ApiError(400, "invalid_args", "Invalid ssh key")
        entry = {
            "id": self.state.next_key_id,
            "user_id": 1,
            "public_key": key.strip(),
            "key": key.strip(),
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "deleted_at": None,
        }
        self.state.next_key_id += 1
        self.state.ssh_keys.append(entry)
        self.save()
        return entry

    def attach_ssh_key(self, instance_id: int, body: Any) -> None:
        """Put a key on one instance (vast.ai's POST /instances/{id}/ssh/: an instance_write permission, where
        an account key needs user_write); a running host gets it at once, a booting one from its init."""
        inst = self.state.instances.get(instance_id)
        if inst is None or not self._visible(inst, time.time()):  # writes lag a create as reads do
            raise ApiError(404, "not_found", "Not Found", shape=TEXT)
        key = body.get("ssh_key") if isinstance(body, dict) else None
        if not isinstance(key, str) or not SSH_KEY.match(key.strip()):
            raise ApiError(400, "invalid_args", "Invalid ssh key")
        if key.strip() not in inst.authorized_keys:
            inst.authorized_keys.append(key.strip())
            self.save()
        if inst.status == "running" and inst.ssh_mode:
            self.host_for(inst).install_keys(inst.authorized_keys)

    def ssh_keys(self) -> list[dict[str, Any]]:
        """The account's keys, deleted ones with their `deleted_at`; an account that never had one: 404."""
        if not self.state.ssh_keys:
            raise ApiError(404, "not_found", "No SSH keys found for this account.")
        return self.state.ssh_keys

    def delete_ssh_key(self, key_id: int) -> None:
        key = next((k for k in self.state.ssh_keys if k["id"] == key_id and not k.get("deleted_at")), None)
        if key is None:
            raise ApiError(404, "not_found", f"ssh key {key_id} not found", shape=MESSAGE_ONLY)
        key["deleted_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.save()
