"""A simulated host's SSH side (issue 48): the commands fleet sends a host, answered in one process as the
image's host scripts answer them, so that fleet's own bring-up, probes and health checks run unchanged against
many hosts that cost a few kilobytes each.

What it plays, and how it differs from a real host (hosts.py) on purpose:
- an SSH server (asyncssh) on the host's private address: root alone, by an authorized public key; the
  platform's host key until `announce_key()`, which plays onstart's `fleet-host-key` (the key's line on the
  console, then the key presented), as the image does after sshd has started;
- its disk is a table of paths: a pulled model is its size alone (fleet-pull asks the hub for the size and copies
  nothing, so no traffic is billed), small files (the TLS key, certificate, API key, template) their bytes;
- fleet-port-check, fleet-tls, fleet-put, stat, tail, the template put, `kill -0` and the memory read answer
  as the scripts do, with the same exit statuses and error lines;
- fleet-serve starts simserver's llama-server over TLS with the installed certificate and the key from stdin,
  on the host's service address; its slots and context from `-np` and `-c`, its decode from the card model;
- nvidia-smi is not found, as on every local host of a machine without a card.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import datetime as dt
import functools
import hashlib
import itertools
import posixpath
import re
import shlex
import ssl
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import asyncssh
import httpx
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fleet.localcloud.cardmodel import CardModel
from fleet.localcloud.simserver import SimulatedServer

NONCE = re.compile(r"[A-Za-z0-9]+")
MEMORY_SCRIPT = (
    'grep -E "^(MemTotal|MemAvailable):" /proc/meminfo; grep "^VmRSS:" "/proc/$(cat "$1")/status" 2>/dev/null; true'
)
TEMPLATE_PUT = 'mkdir -p "$1" && chmod 700 "$1" && cat > "$2"'
ALIVE = 'kill -0 "$(cat "$1")"'
CHARS_PER_TOKEN = 4
PIDS = itertools.count(4000)  # the PIDs fleet-serve prints, unique in this process
Handler = Callable[["SimulatedHost", list[str], asyncssh.SSHServerProcess], Awaitable[int]]


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    pkcs8 = serialization.PrivateFormat.PKCS8
    return key.private_bytes(serialization.Encoding.PEM, pkcs8, serialization.NoEncryption())


@dataclass
class SimulatedHost:
    name: str
    address: str  # its private address: sshd and the service listen there
    ssh_port: int
    card: CardModel
    mem_total_kib: int = 64 << 20
    platform_key: asyncssh.SSHKey = field(default_factory=lambda: asyncssh.generate_private_key("ssh-ed25519"))
    fleet_key: asyncssh.SSHKey = field(default_factory=lambda: asyncssh.generate_private_key("ssh-ed25519"))
    authorized: set[str] = field(default_factory=set)  # the account's public keys, as "ssh-ed25519 AAAA..."
    console: list[str] = field(default_factory=list)  # what the marketplace's logs show of the machine
    files: dict[str, bytes | int] = field(default_factory=dict)  # HOME-relative path -> bytes, or a size
    _acceptor: asyncssh.SSHAcceptor | None = None
    _server: tuple[int, web.AppRunner] | None = None  # (pid, its runner)

    async def start(self) -> None:
        """sshd with the platform's key."""
        self._acceptor = await asyncssh.create_server(
            lambda: _Session(self),
            self.address,
            self.ssh_port,
            server_host_keys=[self.platform_key],
            process_factory=self._run,
            encoding="utf-8",
            keepalive_interval=0,
        )

    def announce_key(self) -> str:
        """onstart's fleet-host-key: the host's own key on the console, then presented (sshd told by SIGHUP)."""
        public = self.fleet_key.export_public_key().decode().split()[:2]
        line = " ".join(public)
        self.console.append(f"fleet-host-key: {line}")
        self.platform_key = self.fleet_key  # written over the platform's key file: a restart presents it too
        assert self._acceptor is not None
        self._acceptor.update(server_host_keys=[self.fleet_key])
        return line

    async def stop(self) -> None:
        """Everything the machine runs ends (its disk stays)."""
        await self._stop_server()
        if self._acceptor is not None:
            self._acceptor.close()
            await self._acceptor.wait_closed()
            self._acceptor = None

    @property
    def serving(self) -> bool:
        return self._server is not None

    async def _run(self, process: asyncssh.SSHServerProcess) -> None:
        command = process.command or ""
        try:
            argv = shlex.split(command)
        except ValueError:
            argv = []
        handler = _COMMANDS.get(argv[0]) if argv else None
        if handler is None:
            process.stderr.write(f"sh: 1: {argv[0] if argv else command}: not found\n")
            process.exit(127)
            return
        try:
            status = await handler(self, argv[1:], process)
        except (asyncssh.Error, BrokenPipeError, ConnectionError):
            status = 1  # fleet went away
        process.exit(status)

    def _read(self, path: str) -> bytes | int | None:
        return self.files.get(posixpath.normpath(path))

    def _write(self, path: str, data: bytes | int) -> None:
        self.files[posixpath.normpath(path)] = data

    async def _stop_server(self) -> None:
        if self._server is not None:
            _, runner = self._server
            self._server = None
            await runner.cleanup()


class _Session(asyncssh.SSHServer):
    def __init__(self, host: SimulatedHost) -> None:
        self._host = host

    def begin_auth(self, username: str) -> bool:
        return True

    def password_auth_supported(self) -> bool:
        return False

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        shown = " ".join(key.export_public_key().decode().split()[:2])
        return username == "root" and shown in self._host.authorized


def _error(process: asyncssh.SSHServerProcess, line: str, status: int) -> int:
    process.stderr.write(f"error: {line}\n")
    return status


async def _port_check(host: SimulatedHost, args: list[str], process: asyncssh.SSHServerProcess) -> int:
    """A self-signed certificate on stdout, then one HTTPS answer of the nonce at the port (openssl s_server
    -WWW -naccept 1), for at most SECONDS."""
    if len(args) < 2:
        process.stderr.write("usage: fleet-port-check PORT NONCE [SECONDS]\n")
        return 2
    port, nonce, seconds = int(args[0]), args[1], float(args[2]) if len(args) > 2 else 30.0
    if not NONCE.fullmatch(nonce):
        return _error(process, "the nonce is letters and digits", 2)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fleet-port-check")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    answered = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 10)
            found = request.split()[1].decode(errors="replace").lstrip("/") if len(request.split()) > 1 else ""
            ok = found == nonce
            writer.write(b"HTTP/1.0 200 ok\r\nContent-type: text/plain\r\n\r\n" + nonce.encode() if ok else
                         b"HTTP/1.0 404 Not Found\r\n\r\n")  # fmt: skip
            await writer.drain()
        except (OSError, TimeoutError, ssl.SSLError):
            pass
        finally:
            answered.set()
            writer.close()

    context = _context(pem, _pem_key(key))
    listener = await asyncio.start_server(answer, host.address, port, ssl=context)
    process.stdout.write(pem.decode())
    try:
        await asyncio.wait_for(answered.wait(), seconds)
    except TimeoutError:
        pass
    finally:
        listener.close()
    return 0


def _context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as tmp:  # the ssl module loads a chain from files alone
        (Path(tmp) / "cert.pem").write_bytes(cert_pem)
        (Path(tmp) / "key.pem").write_bytes(key_pem)
        context.load_cert_chain(str(Path(tmp) / "cert.pem"), str(Path(tmp) / "key.pem"))
    return context


async def _tls(host: SimulatedHost, args: list[str], process: asyncssh.SSHServerProcess) -> int:
    if len(args) != 2 or args[0] not in ("request", "install"):
        process.stderr.write("usage: fleet-tls request|install RUN_DIR\n")
        return 2
    key_path = posixpath.join(args[1], "tls.key")
    if args[0] == "request":
        if not isinstance(host._read(key_path), bytes):
            host._write(key_path, _pem_key(ec.generate_private_key(ec.SECP256R1())))
        key = serialization.load_pem_private_key(host._read(key_path), None)  # type: ignore[arg-type]
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fleet-host")])
        request = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, hashes.SHA256())  # type: ignore[arg-type]
        process.stdout.write(request.public_bytes(serialization.Encoding.PEM).decode())
        return 0
    given = (await process.stdin.read()).encode()[:16384]
    try:
        cert = x509.load_pem_x509_certificate(given)
    except ValueError:
        return _error(process, "what came on stdin is not a certificate", 3)
    key_pem = host._read(key_path)
    if not isinstance(key_pem, bytes):
        return _error(process, "the certificate is not for this host's key", 3)
    key = serialization.load_pem_private_key(key_pem, None)
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(serialization.Encoding.PEM, public) != key.public_key().public_bytes(
        serialization.Encoding.PEM, public
    ):
        return _error(process, "the certificate is not for this host's key", 3)
    host._write(posixpath.join(args[1], "tls.pem"), given)
    return 0


@functools.cache
def _hub_tls() -> ssl.SSLContext:
    """One TLS context for every pull: one each, loading the system's CAs, was a tenth of the cloud's CPU."""
    return ssl.create_default_context()


async def _pull(host: SimulatedHost, args: list[str], process: asyncssh.SSHServerProcess) -> int:
    """fleet-pull URL SHA256 DEST CONNECTIONS: the file's size from the hub (HEAD), its progress, then `ok`."""
    if len(args) != 4:
        process.stderr.write("usage: fleet-pull URL SHA256 DEST CONNECTIONS\n")
        return 2
    url, sha256, dest = args[0], args[1], args[2]
    try:
        async with httpx.AsyncClient(timeout=30, verify=_hub_tls()) as client:
            head = await client.head(url)
        size = int(head.headers["content-length"])
        head.raise_for_status()
    except (httpx.HTTPError, KeyError, ValueError) as e:
        return _error(process, f"aria2c failed for {dest}: {type(e).__name__}", 1)
    process.stdout.write(f"progress 0\nprogress {size}\n")
    host._write(dest, size)
    process.stdout.write(f"ok {sha256} {size}\n")
    return 0


async def _put(host: SimulatedHost, args: list[str], process: asyncssh.SSHServerProcess) -> int:
    if len(args) != 2:
        process.stderr.write("usage: fleet-put DEST SHA256\n")
        return 2
    try:
        data = base64.b64decode((await process.stdin.read()).strip(), validate=True)
    except binascii.Error:
        return _error(process, "what came on stdin is not base64", 3)
    if hashlib.sha256(data).hexdigest() != args[1]:
        return _error(process, f"sha256 mismatch for {args[0]}", 3)
    host._write(args[0], data)
    process.stdout.write(f"ok {args[1]} {len(data)}\n")
    return 0


async def _stat(host: SimulatedHost, args: list[str], process: asyncssh.SSHServerProcess) -> int:
    if args[:2] != ["-c", "%s"] or len(args) != 3:
        process.stderr.write("stat: only -c %s FILE is played here\n")
        return 1
    found = host._read(args[2])
    if found is None:
        process.stderr.write(f"stat: cannot statx '{args[2]}': No such file or directory\n")
        return 1
    process.stdout.write(f"{found if isinstance(found, int) else len(found)}\n")
    return 0


async def _tail(host: SimulatedHost, args: list[str], process: asyncssh.SSHServerProcess) -> int:
    found = host._read(args[-1]) if args else None
    if not isinstance(found, bytes):
        process.stderr.write(f"tail: cannot open '{args[-1] if args else ''}' for reading: No such file or directory\n")
        return 1
    lines = found.decode(errors="replace").splitlines()[-int(args[1]) if args[:1] == ["-n"] else -10 :]
    process.stdout.write("".join(f"{line}\n" for line in lines))
    return 0


async def _sh(host: SimulatedHost, args: list[str], process: asyncssh.SSHServerProcess) -> int:
    """`sh -c SCRIPT sh ARGS...`: the scripts fleet sends, each played by its exact text."""
    if len(args) < 2 or args[0] != "-c":
        process.stderr.write("sh: only -c SCRIPT is played here\n")
        return 2
    script, params = args[1], args[3:]
    if script == TEMPLATE_PUT and len(params) == 2:
        host._write(params[1], (await process.stdin.read()).encode())
        return 0
    if script == ALIVE and len(params) == 1:
        return 0 if host.serving and host._read(params[0]) is not None else 1
    if script == MEMORY_SCRIPT and len(params) == 1:
        free = host.mem_total_kib // 2
        process.stdout.write(f"MemTotal:       {host.mem_total_kib} kB\nMemAvailable:   {free} kB\n")
        if host.serving and host._read(params[0]) is not None:
            process.stdout.write("VmRSS:\t  1843200 kB\n")
        return 0
    process.stderr.write("sh: this script is not played by a simulated host\n")
    return 2


def _flag(args: list[str], *names: str, default: str | None = None) -> str | None:
    for i, arg in enumerate(args[:-1]):
        if arg in names:
            return args[i + 1]
    return default


async def _serve(host: SimulatedHost, args: list[str], process: asyncssh.SSHServerProcess) -> int:
    """fleet-serve RUN_DIR -- ARGS: any running server stopped, the key from stdin, the server started."""
    if len(args) < 2 or args[1] != "--":
        process.stderr.write("usage: fleet-serve RUN_DIR -- LLAMA_SERVER_ARGS...\n")
        return 2
    run_dir, server_args = args[0], args[2:]
    await host._stop_server()
    key = (await process.stdin.readline()).rstrip("\n")
    if not key:
        return _error(process, "no API key on stdin", 2)
    host._write(posixpath.join(run_dir, "api-key"), f"{key}\n".encode())
    cert, tls_key = (host._read(_flag(server_args, "--ssl-cert-file") or ""),
                     host._read(_flag(server_args, "--ssl-key-file") or ""))  # fmt: skip
    log = posixpath.join(run_dir, "llama-server.log")
    if not isinstance(cert, bytes) or not isinstance(tls_key, bytes):
        host._write(log, b"error: no certificate and key to serve HTTPS with\n")
        process.stdout.write("0\n")
        return 0  # as llama-server exiting at once: the liveness check finds it gone
    slots = int(_flag(server_args, "-np", "--parallel", default="1") or 1)
    ctx = int(_flag(server_args, "-c", "--ctx-size", default="4096") or 4096)
    # a simulated token is one character, a real one about four: a slot holds in characters what it holds in tokens
    per_slot = max(1, ctx // slots) * CHARS_PER_TOKEN
    server = SimulatedServer(card=host.card, api_key=key, slots=slots, ctx_per_slot=per_slot,
                             model=_flag(server_args, "-a", "--alias", default="simulated") or "simulated")  # fmt: skip
    runner = web.AppRunner(server.app(), keepalive_timeout=60)
    await runner.setup()
    port = int(_flag(server_args, "--port", default="8080") or 8080)
    await web.TCPSite(runner, host.address, port, ssl_context=_context(cert, tls_key)).start()
    pid = next(PIDS)
    host._server = (pid, runner)
    host._write(posixpath.join(run_dir, "llama-server.pid"), f"{pid}\n".encode())
    host._write(log, f"main: server is listening on https://{host.address}:{port}\n".encode())
    process.stdout.write(f"{pid}\n")
    return 0


async def _stop(host: SimulatedHost, args: list[str], process: asyncssh.SSHServerProcess) -> int:
    await host._stop_server()
    if args:
        host.files.pop(posixpath.normpath(posixpath.join(args[0], "llama-server.pid")), None)
    return 0


_COMMANDS: dict[str, Handler] = {
    "fleet-port-check": _port_check,
    "fleet-tls": _tls,
    "fleet-pull": _pull,
    "fleet-put": _put,
    "fleet-serve": _serve,
    "fleet-stop-server": _stop,
    "stat": _stat,
    "tail": _tail,
    "sh": _sh,
}
