"""A local host's network, as vast.ai's NAT gives it: a private address, and forwarders from random
public ports to the container's ports.

Each host gets its own loopback address (127.x.y.z, picked at random and checked free): the host's
processes bind their internal ports there, as inside a container's own network namespace. The only
way in that the API reveals is a mapping: a forwarder on the public address (127.0.0.1) at a random
external port, piping to the private address and the internal port. The SSH proxy (`ssh_host`,
`ssh_port`) is a second forwarder to the same sshd, on another address, as vast.ai's gateway is
another machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass

PUBLIC_HOST = "127.0.0.1"
PROXY_HOST = "127.0.0.2"  # vast.ai's SSH gateway is another address than the machine's public IP
MOVED_HOST = "127.0.0.3"  # the public address a machine on a dynamic one is handed next (fault address_change)
_PRIVATE_FIRST_OCTET = 127


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = PUBLIC_HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def private_address(rng: random.Random | None = None) -> str:
    """A loopback address no other host (of this cloud or another on the machine) is likely to use."""
    rng = rng or random.SystemRandom()
    while True:
        address = f"{_PRIVATE_FIRST_OCTET}.{rng.randint(64, 250)}.{rng.randint(0, 255)}.{rng.randint(2, 254)}"
        if _bindable(address, 22) or _bindable(address, 2222):
            return address


def internal_ssh_port(address: str) -> int:
    """The container's port 22 on its private address: 22 itself where this process may bind it."""
    return 22 if _bindable(address, 22) else free_port(address)


Traffic = Callable[[int, int], None]  # (bytes into the host, bytes out of it)


@dataclass(frozen=True)
class Mapping:
    listen_host: str
    listen_port: int
    target_host: str
    target_port: int


class Forwarder:
    """One TCP forwarder: accepts on (listen_host, listen_port), pipes each connection to the target."""

    def __init__(self, mapping: Mapping, traffic: Traffic | None = None) -> None:
        self.mapping = mapping
        self._traffic = traffic
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task] = set()

    async def start(self) -> None:
        m = self.mapping
        self._server = await asyncio.start_server(self._accept, m.listen_host, m.listen_port, reuse_address=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._pipes.add(task)
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(self.mapping.target_host, self.mapping.target_port)
            except OSError:
                # Nothing listens behind the mapping: the client sees the connection reset, as through NAT.
                writer.transport.abort()
                return
            try:
                down = (lambda n: self._traffic(n, 0)) if self._traffic else None
                up = (lambda n: self._traffic(0, n)) if self._traffic else None
                await asyncio.gather(_pipe(reader, up_writer, down), _pipe(up_reader, writer, up))
            finally:
                up_writer.close()
        except asyncio.CancelledError:
            # the mapping stops (its instance destroyed or stopped): the connection ends here, quietly (a handler
            # task that ends cancelled makes asyncio log a traceback for each)
            pass
        finally:
            writer.close()
            self._pipes.discard(task)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        for task in list(self._pipes):
            task.cancel()
        for task in list(self._pipes):
            with contextlib.suppress(BaseException):
                await task


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: Callable[[int], None] | None = None
) -> None:
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            if count is not None:
                count(len(data))
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            if writer.can_write_eof():
                writer.write_eof()
            else:
                writer.close()


class HostNetwork:
    """Every forwarder of one host; started when it runs, stopped when it stops or goes."""

    def __init__(self, mappings: list[Mapping], traffic: Traffic | None = None) -> None:
        self._forwarders = [Forwarder(m, traffic) for m in mappings]
        self.started = False

    async def start(self) -> None:
        for f in self._forwarders:
            try:
                await f.start()
            except OSError:
                await self.stop()  # the ones already listening let their ports go
                raise
        self.started = True

    async def stop(self) -> None:
        for f in self._forwarders:
            await f.stop()
        self.started = False
