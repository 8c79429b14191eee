"""The secrets scan around the whole test session: no vast.ai API key, llama-server key, private key or Hugging
Face token in any log, any command's captured output, the command line of any process, or a database where
it does not belong; databases and key files private to their owner.

While the session runs, a thread reads every process's command line (and a local cloud host's environment)
twice a second, asks every host's llama-server once, as anyone on the network could, for /slots in clear
and over TLS without the key (neither may answer), and every `fleet` command
run through subprocess.run has its output kept. At the end the secrets are gathered from where the session
made them (each local cloud's api_key file, every llama-server key derived from a fleet database's nonces and
the secret beside it, every private key file: SSH, CA, hosts' TLS keys, the tokens tests register) and looked
for everywhere. A fleet database must hold no llama-server key: only the endpoints file carries them.
"""

from __future__ import annotations

import socket
import sqlite3
import ssl
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from fleet.core.apikeys import host_api_key

MAX_SCAN_BYTES = 64 * 1024 * 1024
# where a secret lives, by design: the marketplace's keys, fleet's SSH key, the secret the hosts' keys derive
# from, fleet's CA key, a host's TLS key (on the host alone)
KEY_FILES = ("api_key", "vast_api_key", "id_ed25519", "id_ed25519.pub", "host-api-keys", "ca.key", "tls.key")
PEM_KEYS = ("id_ed25519", "ca.key", "tls.key")
HOST_MARK = b"FLEET_HOST_KEY_DIR="  # in the environment of every process of a local cloud's host


class SecretsWatch:
    def __init__(self, basetemp: Path) -> None:
        self.basetemp = basetemp
        self.registered: set[str] = set()
        self.command_lines: set[bytes] = set()
        self.host_environs: set[bytes] = set()  # the environment of every process a local cloud's host ran
        # a host of a local cloud this session started: its key directory lies under the session's folder
        self._host_mark = HOST_MARK + str(basetemp).encode()
        self.host_servers: set[tuple[int, tuple[str, int]]] = set()  # hosts' llama-servers checked, by PID
        self.served_in_clear: list[str] = []
        self.host_servers_seen: set[int] = set()
        self.outputs: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch_processes, daemon=True, name="secrets-watch")
        self._real_run = subprocess.run

    def register(self, secret: str) -> None:
        """A secret a test made up (a Hugging Face token) that must appear nowhere it should not."""
        self.registered.add(secret)

    def start(self) -> None:
        self._thread.start()
        watch = self

        def run(*args: Any, **kwargs: Any) -> subprocess.CompletedProcess:
            result = watch._real_run(*args, **kwargs)
            argv = args[0] if args else kwargs.get("args", [])
            if "fleet.cli" in " ".join(map(str, argv)) and kwargs.get("capture_output"):
                watch.outputs.append(f"{result.stdout}{result.stderr}")
            return result

        subprocess.run = run  # type: ignore[assignment]

    def _watch_processes(self) -> None:
        while not self._stop.is_set():
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    try:
                        self.command_lines.add((entry / "cmdline").read_bytes())
                        environ = (entry / "environ").read_bytes()
                    except OSError:
                        continue
                    if self._host_mark in environ:
                        self.host_environs.add(environ)
                        self._check_host_server(int(entry.name), self._cmdline_of(entry))
            time.sleep(0.5)

    @staticmethod
    def _cmdline_of(entry: Path) -> list[str]:
        try:
            return (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            return []

    def _check_host_server(self, pid: int, argv: list[str]) -> None:
        """Once a host's llama-server answers: it serves nothing in clear, and /slots to no one without the key."""
        if not any(a.endswith("llama-server") for a in argv) or "--host" not in argv or "--port" not in argv:
            return
        where = (argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1]))
        self.host_servers_seen.add(pid)
        if (pid, where) in self.host_servers:
            return
        try:
            with socket.create_connection(where, timeout=2) as plain:
                plain.sendall(b"GET /slots HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
                said = plain.recv(64)
            if said.startswith((b"HTTP/1.1 2", b"HTTP/1.0 2")):
                self.served_in_clear.append(f"a host's server at {where} answered plain HTTP: {said[:30]!r}")
            if said.startswith(b"HTTP/"):  # a server a test started in clear on purpose, and it kept /slots closed
                self.host_servers.add((pid, where))
                return
            context = ssl.create_default_context()
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # whoever it is: is /slots open?
            with socket.create_connection(where, timeout=2) as tcp, context.wrap_socket(tcp) as tls:
                tls.sendall(b"GET /slots HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
                said = tls.recv(64)
            if said.startswith((b"HTTP/1.1 2", b"HTTP/1.0 2")):
                self.served_in_clear.append(f"a host's server at {where} gave /slots without the key")
        except (OSError, ssl.SSLError):
            return  # not answering yet (loading), or gone: looked at again on the next pass
        self.host_servers.add((pid, where))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        subprocess.run = self._real_run  # type: ignore[assignment]

    # ---- the scan ----------------------------------------------------------------------------
    def secrets(self) -> dict[str, set[str]]:
        vast = {p.read_text().strip() for p in self.basetemp.rglob("api_key") if p.is_file()}
        llama: set[str] = set()
        for database in self.basetemp.rglob("fleet.db"):
            secret_file = database.parent / "secret" / "host-api-keys"
            secret = secret_file.read_bytes() if secret_file.is_file() else None
            try:
                with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
                    for name, nonce, clear in db.execute("SELECT name, api_key_nonce, api_key FROM hosts"):
                        if clear:
                            llama.add(clear)
                        if nonce and secret:
                            llama.add(host_api_key(secret, name, nonce))
            except sqlite3.Error:
                continue
        private = set()
        for key in (p for name in PEM_KEYS for p in self.basetemp.rglob(name) if p.is_file()):
            body = [ln for ln in key.read_text().splitlines() if ln and not ln.startswith("-----")]
            private |= {ln for ln in body[1:] if len(ln) >= 40}  # the first line is the same in every key
        return {"vast.ai API key": vast, "llama-server key": llama, "private key": private, "token": self.registered}

    def findings(self) -> list[str]:
        kinds = self.secrets()
        everything = {(kind, s) for kind, values in kinds.items() for s in values if len(s) >= 16}
        not_in_endpoints = {(k, s) for k, s in everything if k != "llama-server key"}
        found: list[str] = []
        for path in self.basetemp.rglob("*"):
            if not path.is_file() or path.is_symlink() or path.stat().st_size > MAX_SCAN_BYTES:
                continue
            name = path.name
            if name in KEY_FILES or name.startswith("api-key"):
                continue  # where a secret lives, by design (modes checked below)
            data = path.read_bytes()
            for kind, secret in not_in_endpoints if name == "endpoints.json" else everything:
                if secret.encode() in data:
                    found.append(f"{kind} in {path}")
        for line in self.command_lines:
            for kind, secret in everything:
                if secret.encode() in line:
                    found.append(f"{kind} on a command line: {line[:80]!r}")
        found.extend(self.served_in_clear)
        if self.host_servers_seen and not self.host_servers:
            found.append(f"{len(self.host_servers_seen)} hosts' servers ran and none answered the check")
        for environ in self.host_environs:
            for kind, secret in everything:
                if kind != "llama-server key" and secret.encode() in environ:
                    found.append(f"{kind} in a host's environment")
        for output in self.outputs:
            for kind, secret in everything:
                if kind != "llama-server key" and secret in output:
                    found.append(f"{kind} in a command's output: {output[:80]!r}")
        for path in [
            *self.basetemp.rglob("fleet.db"),
            *self.basetemp.rglob("id_ed25519"),
            *self.basetemp.rglob("api_key"),
            *(p for name in ("host-api-keys", *PEM_KEYS) for p in self.basetemp.rglob(name)),
        ]:
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode & 0o077:
                found.append(f"{path} is readable by others (mode {oct(mode)})")
        return sorted(set(found))
