"""A local host: a directory, a real OpenSSH sshd on a loopback port, and the image's host scripts.

The layout mirrors a container: `root/` is the home and working directory of every SSH session,
`bin/` holds llama-server, aria2c and the host scripts (first on PATH), `etc/` the sshd config,
host keys (made by the image's own `fleet-host-init` at first start) and authorized keys.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from fleet.localcloud import procs
from fleet.localcloud.toolchain import REPO_ROOT

HOST_SCRIPTS = REPO_ROOT / "images" / "llama-server" / "host"
SSHD = "/usr/sbin/sshd"
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class HostError(RuntimeError):
    """The local machine could not provide a host (missing sshd, no port, ...)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass
class LocalHost:
    directory: Path
    token: str
    ssh_port: int
    llama_server: Path | None
    listen_host: str = "127.0.0.1"
    roots: list[int] = field(default_factory=list)  # PIDs this object spawned (sshd, onstart)

    @property
    def root(self) -> Path:
        return self.directory / "root"

    @property
    def etc(self) -> Path:
        return self.directory / "etc"

    @property
    def log_dir(self) -> Path:
        return self.directory / "log"

    def prepare(self, env: dict[str, str], authorized_keys: list[str]) -> None:
        """Lay out the host directory: PATH, environment, sshd config, authorized keys."""
        if not Path(SSHD).exists():
            raise HostError(f"{SSHD} not found: install Debian's openssh-server")
        for d in (self.root, self.etc, self.log_dir, self.directory / "bin"):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        bin_dir = self.directory / "bin"
        for script in HOST_SCRIPTS.iterdir():
            _link(script, bin_dir / script.name)
        aria2c = shutil.which("aria2c")
        if aria2c:
            _link(Path(aria2c), bin_dir / "aria2c")
        if self.llama_server:
            _link(self.llama_server, bin_dir / "llama-server")

        full_env = {
            "PATH": f"{bin_dir}:{BASE_PATH}",
            "HOME": str(self.root),
            "FLEET_LISTEN_HOST": self.listen_host,
            procs.MARKER: self.token,
            **env,
        }
        lines = [f"export {k}={shlex.quote(v)}" for k, v in full_env.items() if _env_name_ok(k)]
        _write_private(self.etc / "environment", "\n".join(lines) + "\n")
        session = self.directory / "bin" / "session"
        _write_private(
            session,
            "#!/bin/sh\n"
            "# Every SSH session of this host starts here, with the container's environment.\n"
            f". {shlex.quote(str(self.etc / 'environment'))}\n"
            'cd "$HOME"\n'
            'if [ -n "${SSH_ORIGINAL_COMMAND:-}" ]; then exec /bin/sh -c "$SSH_ORIGINAL_COMMAND"; fi\n'
            "exec /bin/sh -l\n",
        )
        os.chmod(session, 0o700)
        _write_private(self.etc / "authorized_keys", "".join(k.strip() + "\n" for k in authorized_keys))
        _write_private(
            self.etc / "sshd_config",
            "\n".join(
                [
                    f"Port {self.ssh_port}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {self.etc / 'ssh_host_ed25519_key'}",
                    f"PidFile {self.directory / 'sshd.pid'}",
                    f"AuthorizedKeysFile {self.etc / 'authorized_keys'}",
                    "StrictModes no",
                    "UsePAM no",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PermitRootLogin prohibit-password",
                    "AllowUsers root",
                    f"ForceCommand {session}",
                    "PrintMotd no",
                    "PrintLastLog no",
                    "MaxStartups 100:30:200",
                    "MaxSessions 50",
                    "ClientAliveInterval 30",
                    "",
                ]
            ),
        )

    def _spawn(self, argv: list[str], log_name: str, extra_env: dict[str, str]) -> int:
        env = {
            "PATH": f"{self.directory / 'bin'}:{BASE_PATH}",
            "HOME": str(self.root),
            procs.MARKER: self.token,
            **extra_env,
        }
        with (self.log_dir / log_name).open("ab") as log:
            process = subprocess.Popen(
                argv,
                cwd=self.root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.roots.append(process.pid)
        return process.pid

    def start_sshd(self, timeout_s: float = 10.0) -> int:
        """Run the image's entry point (host keys at first start, then sshd); wait for the port."""
        pid = self._spawn(
            [str(HOST_SCRIPTS / "fleet-host-init")],
            "sshd.log",
            {
                "FLEET_SSHD_CONFIG": str(self.etc / "sshd_config"),
                "FLEET_HOST_KEY_DIR": str(self.etc),
            },
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if port_open("127.0.0.1", self.ssh_port):
                return pid
            time.sleep(0.05)
        raise HostError(f"sshd did not listen on port {self.ssh_port}; see {self.log_dir / 'sshd.log'}")

    def run_onstart(self, script: str) -> int:
        """Run the create call's onstart script in the host's environment, detached."""
        path = self.directory / "onstart.sh"
        _write_private(path, script)
        env_file = shlex.quote(str(self.etc / "environment"))
        return self._spawn(["/bin/sh", "-c", f". {env_file}; exec /bin/sh {shlex.quote(str(path))}"], "onstart.log", {})

    def host_public_key(self) -> str | None:
        path = self.etc / "ssh_host_ed25519_key.pub"
        return path.read_text().strip() if path.exists() else None

    def sshd_pid(self) -> int | None:
        """The host's sshd, from its PID file, if that PID still runs this host's sshd config."""
        try:
            pid = int((self.directory / "sshd.pid").read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return None
        return pid if str(self.etc / "sshd_config").encode() in cmdline else None

    def _roots(self) -> list[int]:
        sshd = self.sshd_pid()
        return [*self.roots, *([sshd] if sshd else [])]

    def processes(self) -> list[int]:
        return procs.host_pids(self.token, self._roots())

    def stop(self) -> int:
        """End every process of the host; return how many there were."""
        return procs.end_host_processes(self.token, self._roots())

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


def _env_name_ok(name: str) -> bool:
    return name.replace("_", "a").isalnum() and not name[0].isdigit()


def _link(target: Path, link: Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
