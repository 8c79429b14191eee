"""A simulated host (simhost.py) behind the face the boot gives a real one (hosts.LocalHost), so that the local
cloud rents, boots, stops and destroys it as any other: the setting `simulated_card` (never the default) makes
every host of the cloud one of these (issue 48: a thousand hosts on one machine).

The boot calls a host's steps from worker threads (`asyncio.to_thread`); a simulated host's SSH and HTTPS
servers live on the cloud's own event loop, so each step is run there and waited for. What it does not play:
the image's entrypoint (the args launch mode: fleet rents in the ssh modes), processes (the faults that pause
or count a host's processes find none), and the bytes of a pull (no traffic is billed for them)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncssh

from fleet.localcloud.cardmodel import CardModel
from fleet.localcloud.hosts import HostError
from fleet.localcloud.simhost import SimulatedHost


class SimulatedLocalHost:
    def __init__(self, directory: Path, private_ip: str, ssh_port: int, card: CardModel) -> None:
        self.directory = directory
        self.host = SimulatedHost(directory.name, private_ip, ssh_port, card)
        self._loop = asyncio.get_running_loop()  # made by the boot, on the cloud's loop
        self._started: set[asyncio.Task] = set()  # steps started from the loop itself, held until they end

    @property
    def console(self) -> Path:
        """Where the marketplace's logs read the machine's console (logs.py), as for a real host."""
        return self.directory / "log" / "console.log"

    def _on_loop(self, step: Callable[[], Awaitable[None]]) -> None:
        """`step` run on the cloud's loop: waited for from a worker thread; from the loop itself (a shutdown),
        started and left to run, since nothing may block the loop."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            task = self._loop.create_task(step())  # type: ignore[arg-type]
            self._started.add(task)
            task.add_done_callback(self._started.discard)
        else:
            asyncio.run_coroutine_threadsafe(step(), self._loop).result(timeout=60)  # type: ignore[arg-type]

    def prepare(self) -> None:
        self.console.parent.mkdir(parents=True, exist_ok=True)
        self.console.touch()

    def start_platform_sshd(self) -> int:
        self._on_loop(self.host.start)
        return 0

    def start_entrypoint(self, env: dict[str, str]) -> int:
        raise HostError("a simulated host runs in the ssh launch modes alone (runtype ssh_direc or ssh_proxy)")

    def install_keys(self, authorized_keys: list[str]) -> None:
        self.host.authorized = {" ".join(k.split()[:2]) for k in authorized_keys if k.strip()}

    def run_onstart(self, script: str, env: dict[str, str], foreign_key: bool = False) -> int:
        """Of an onstart script, what fleet's does: `fleet-host-key` (the host's own key announced, then
        presented); under `foreign_key` sshd never takes it, as with the fault on a real host."""
        if "fleet-host-key" in script.split() and not foreign_key:
            self._announce()
        return 0

    def _announce(self) -> None:
        async def announce() -> None:
            line = self.host.announce_key()
            with self.console.open("a") as out:
                out.write(f"fleet-host-key: {line}\n")

        self._on_loop(announce)

    def new_host_key(self) -> None:
        """Fault host_key_change: a new key of its own, announced and presented."""
        self.host.fleet_key = asyncssh.generate_private_key("ssh-ed25519")
        self._announce()

    def announce_another_key(self) -> None:
        """Fault forged_host_key: someone else's key on the console before onstart's."""
        other = " ".join(asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().split()[:2])
        with self.console.open("a") as out:
            out.write(f"fleet-host-key: {other}\n")

    def stop(self) -> int:
        self._on_loop(self.host.stop)
        return 0

    def shut_down(self) -> None:
        self.stop()

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)
