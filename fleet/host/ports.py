"""Before a pull is paid for: the service port the marketplace lists for a host must lead to that host. Some
machines list ports that lead nowhere (SkyPilot meets direct ports listed and unreachable); found after the
pull, that cost the pull's time and its traffic. So, over the pinned SSH session, the host answers one HTTPS
request on its service port with a nonce (`fleet-port-check`, under a certificate made for this check and
read back over SSH), and fleet asks for it from outside, through the listed address and port. A port that
leads to another host fails the same way: that host has neither the certificate nor the nonce."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import ssl
import time

import asyncssh

from fleet.core.errors import FleetError
from fleet.host.remote import RemoteError, lines_of, start_process

MAX_ANSWER = 4096


class PortUnreachable(FleetError):
    """The listed service port does not lead to the host."""

    prefix = "port check"


async def check_service_port(
    conn: asyncssh.SSHClientConnection, address: str, port: int, container_port: int, timeout_s: float
) -> None:
    """The host's answer on `container_port`, read at `address`:`port`; PortUnreachable when it never comes."""
    nonce = secrets.token_hex(16)
    deadline = time.monotonic() + timeout_s
    process = await start_process(conn, ["fleet-port-check", str(container_port), nonce, str(int(timeout_s))], None)
    try:
        certificate = await asyncio.wait_for(_certificate(process), timeout_s)
        context = ssl.create_default_context(cadata=certificate)
        context.check_hostname = False  # trusted: the one certificate the host just made, read over SSH
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                answer = await asyncio.wait_for(_ask(address, port, nonce, context), 10.0)
            except ssl.SSLCertVerificationError:
                raise PortUnreachable(
                    f"the listed service port {address}:{port} answers with another certificate: it leads elsewhere"
                ) from None
            except (OSError, ssl.SSLError, TimeoutError, asyncio.IncompleteReadError) as e:
                last = f"{type(e).__name__}: {e}"[:200]
                await asyncio.sleep(0.3)  # the host's listener may not be up yet
                continue
            if answer.startswith(b"HTTP/1.0 200") and answer.endswith(nonce.encode()):
                return
            raise PortUnreachable(f"{address}:{port} answered, but not with this host's nonce")
        raise PortUnreachable(
            f"the listed service port {address}:{port} (the host's {container_port}) does not lead to the host "
            f"within {timeout_s:g}s ({last})"
        )
    except (RemoteError, TimeoutError) as e:
        raise PortUnreachable(f"the host's port check did not start: {e or 'no certificate'}") from None
    finally:
        process.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(process.wait_closed(), 5.0)


async def _certificate(process: asyncssh.SSHClientProcess) -> str:
    lines: list[str] = []
    async for line in lines_of(process.stdout, "fleet-port-check"):
        lines.append(line)
        if line.strip() == "-----END CERTIFICATE-----":
            return "\n".join(lines) + "\n"
        if len(lines) > 100:
            break
    raise RemoteError("fleet-port-check printed no certificate")


async def _ask(address: str, port: int, nonce: str, context: ssl.SSLContext) -> bytes:
    reader, writer = await asyncio.open_connection(address, port, ssl=context)
    try:
        writer.write(f"GET /{nonce} HTTP/1.0\r\n\r\n".encode())
        await writer.drain()
        answer = await reader.read(MAX_ANSWER)
        while len(answer) < MAX_ANSWER and (more := await reader.read(MAX_ANSWER - len(answer))):
            answer += more
        return answer.strip()
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
