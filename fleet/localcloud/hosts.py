"""A local host: a directory, a real OpenSSH sshd on a loopback port, and the image's host scripts.

The layout mirrors a container: `root/` is the home and working directory of every SSH session,
`bin/` holds llama-server, aria2c and the host scripts (first on PATH), `etc/` the sshd config,
host keys (made by the image's own `fleet-host-init` at first start) and authorized keys.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from fleet.localcloud import disks, procs, toolchain
from fleet.localcloud.toolchain import REPO_ROOT

HOST_SCRIPTS = REPO_ROOT / "images" / "llama-server" / "host"
VLLM_HOST_SCRIPTS = REPO_ROOT / "images" / "vllm" / "host"  # over the shared ones, as images/vllm/Dockerfile
WRITE_MANIFEST = REPO_ROOT / "images" / "llama-server" / "write-image-manifest"  # as the images' builds run it
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class HostError(RuntimeError):
    """The local machine could not provide a host (missing sshd, no port, ...)."""


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass
class LocalHost:
    """One rented host. The platform (the local cloud) lays it out, makes its SSH host keys, starts its
    sshd on the host's private address, installs the account's keys and runs the onstart script, as
    vast.ai's init does for the ssh launch modes; the image's own ENTRYPOINT runs only in the
    entrypoint (args) mode."""

    directory: Path
    token: str
    private_ip: str
    ssh_port: int  # sshd's port on the private address (the container's port 22)
    llama_server: Path | None
    frozen_server: bool = False  # fault: the host's llama-server stops itself before it even starts
    stale_image: bool = False  # fault: the machine boots its stale copy of the image's tag (a script differs)
    disk_bytes: int | None = None  # what the container may write: its disk allocation less its image (disks.py)
    engine: str = "llama-server"  # what its image serves (toolchain.image_engine)
    vllm_python: Path | None = None  # the vLLM image's python3: scripts/setup-vllm's environment
    # what this object spawned (sshd, onstart): PID and start time, since an ended root's PID is soon another's
    roots: list[tuple[int, str]] = field(default_factory=list)

    @property
    def root(self) -> Path:
        return self.directory / "root"

    @property
    def etc(self) -> Path:
        return self.directory / "etc"

    @property
    def log_dir(self) -> Path:
        return self.directory / "log"

    @property
    def manifest(self) -> Path:
        """The image's manifest, where the image keeps it (/usr/local/share/fleet beside /usr/local/bin)."""
        return self.directory / "share" / "fleet" / "image.sha256"

    @property
    def bin_dir(self) -> Path:
        return self.directory / "bin"

    def base_env(self) -> dict[str, str]:
        """What every process of the host has: the image's PATH, HOME, the host's network and marker.

        FLEET_LISTEN_HOST is the host's own address: what 0.0.0.0 is inside a container's network
        namespace (the image's scripts default to 0.0.0.0). FLEET_HOST_KEY_DIR and FLEET_SSHD_PID_FILE are
        where this host's sshd keeps what a container's keeps in /etc/ssh and /run/sshd.pid; FLEET_CONSOLE is
        what a container's /proc/1/fd/1 is, the console its logs hold (logs.py)."""
        env = {
            "PATH": f"{self.bin_dir}:{BASE_PATH}",
            "HOME": str(self.root),
            "FLEET_LISTEN_HOST": self.private_ip,
            "FLEET_HOST_KEY_DIR": str(self.etc),
            "FLEET_SSHD_PID_FILE": str(self.directory / "sshd.pid"),
            "FLEET_CONSOLE": str(self.log_dir / "console.log"),
            "TMUX_TMPDIR": str(self.directory / "tmux"),
            procs.MARKER: self.token,
        }
        if self.engine == "vllm":
            # the CPU build's image: a KV cache of 1 GiB (unset, it takes most of the machine's memory), and
            # its caches and temporary files inside the host
            cache = self.root / ".cache"
            env |= {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CACHE_ROOT": str(cache / "vllm"),
                "TORCHINDUCTOR_CACHE_DIR": str(cache / "torchinductor"),
                "TMPDIR": str(self.directory / "tmp"),
            }
        return env

    def prepare(self) -> None:
        """Lay out the host directory: PATH, the SSH session's environment, the sshd config."""
        if not Path(toolchain.sshd_path()).exists():
            raise HostError(f"{toolchain.sshd_path()} not found: install Debian's openssh-server")
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.disk_bytes is not None:
            try:
                disks.attach(self.directory, self.root, self.disk_bytes)
            except (disks.DiskError, OSError) as e:
                raise HostError(f"its disk could not be made: {e}") from None
        for d in (self.root, self.root / ".ssh", self.etc, self.log_dir, self.bin_dir, self.directory / "tmux"):
            d.mkdir(parents=True, exist_ok=True)
        (self.directory / "tmp").mkdir(exist_ok=True)
        os.chmod(self.directory, 0o700)
        for script in HOST_SCRIPTS.iterdir():
            _link(script, self.bin_dir / script.name)
        if self.engine == "vllm":
            for script in VLLM_HOST_SCRIPTS.iterdir():
                _link(script, self.bin_dir / script.name)
            if self.vllm_python is not None:
                wrapper = self.bin_dir / "python3"
                wrapper.unlink(missing_ok=True)
                _write_private(wrapper, f'#!/bin/sh\nexec {shlex.quote(str(self.vllm_python))} "$@"\n')
                os.chmod(wrapper, 0o700)
        # nvidia-smi: on a GPU machine the container runtime mounts the driver's tools into every container.
        # ssh-keygen and openssl: the image ships them (fleet-host-key and fleet-tls call them); a machine that
        # keeps them off the system's PATH (the GPU bench carries its own) still gives them to its hosts.
        for program in ("nvidia-smi", "ssh-keygen", "openssl"):
            found = shutil.which(program)
            if found:
                _link(Path(found), self.bin_dir / program)
        # A host's downloads leave from its own address (on vast.ai, its machine's public IP): the hub knows
        # whose link a pull runs on, and the cloud bills its traffic.
        aria2c = shutil.which("aria2c")
        if aria2c:
            wrapper = self.bin_dir / "aria2c"
            wrapper.unlink(missing_ok=True)
            _write_private(
                wrapper,
                f'#!/bin/sh\nexec {shlex.quote(aria2c)} --interface={shlex.quote(self.private_ip)} "$@"\n',
            )
            os.chmod(wrapper, 0o700)
        if self.llama_server and self.frozen_server:
            wrapper = self.bin_dir / "llama-server"
            wrapper.unlink(missing_ok=True)
            _write_private(wrapper, f'#!/bin/sh\nkill -STOP $$\nexec {shlex.quote(str(self.llama_server))} "$@"\n')
            os.chmod(wrapper, 0o700)
        elif self.llama_server and self.engine == "llama-server":
            _link(self.llama_server, self.bin_dir / "llama-server")
        if self.stale_image:  # an older build of the tag: its own fleet-serve, its own manifest
            stale = self.bin_dir / "fleet-serve"
            text = stale.read_text()
            stale.unlink()
            _write_private(stale, text + "# an older build of this image\n")
            os.chmod(stale, 0o700)
        write_manifest(self.bin_dir, self.manifest)

        # An SSH session gets the image's environment only: the create call's env is not in it
        # (vast.ai's docs: export it to /etc/environment from onstart to see it there).
        lines = [f"export {k}={shlex.quote(v)}" for k, v in self.base_env().items()]
        _write_private(self.etc / "session-environment", "\n".join(lines) + "\n")
        session = self.bin_dir / "session"
        _write_private(
            session,
            "#!/bin/sh\n"
            "# Every SSH session of this host starts here, with the image's environment.\n"
            f". {shlex.quote(str(self.etc / 'session-environment'))}\n"
            'cd "$HOME"\n'
            'if [ -n "${SSH_ORIGINAL_COMMAND:-}" ]; then exec /bin/sh -c "$SSH_ORIGINAL_COMMAND"; fi\n'
            "# An interactive login lands in tmux, as on vast.ai, unless ~/.no_auto_tmux exists.\n"
            'if [ ! -e "$HOME/.no_auto_tmux" ] && command -v tmux >/dev/null 2>&1; then\n'
            "  exec tmux new-session -A -s ssh_tmux\n"
            "fi\n"
            "exec /bin/sh -l\n",
        )
        os.chmod(session, 0o700)
        _write_private(
            self.etc / "sshd_config",
            "\n".join(
                [
                    f"Port {self.ssh_port}",
                    f"ListenAddress {self.private_ip}",
                    f"HostKey {self.etc / 'ssh_host_ed25519_key'}",
                    f"PidFile {self.directory / 'sshd.pid'}",
                    f"AuthorizedKeysFile {self.root / '.ssh' / 'authorized_keys'}",
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

    def _spawn(
        self, argv: list[str], log_name: str, env: dict[str, str], overrides: dict[str, str] | None = None
    ) -> int:
        with (self.log_dir / log_name).open("ab") as log:
            process = subprocess.Popen(
                argv,
                cwd=self.root,
                env={**env, **self.base_env(), **(overrides or {})},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        started = procs.identity(process.pid)
        if started is not None:  # one already gone has nothing below it to end
            self.roots.append((process.pid, started))
        return process.pid

    def _wait_sshd(self, pid: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if port_open(self.private_ip, self.ssh_port):
                return pid
            time.sleep(0.05)
        raise HostError(f"sshd did not listen on {self.private_ip}:{self.ssh_port}; see {self.log_dir / 'sshd.log'}")

    def start_platform_sshd(self, timeout_s: float = 10.0) -> int:
        """The platform's init (ssh launch modes): host keys at first start, then sshd."""
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege separation directory
        key = self.etc / "ssh_host_ed25519_key"
        if not key.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "", "-f", str(key)], check=True)
        pid = self._spawn([toolchain.sshd_path(), "-D", "-e", "-f", str(self.etc / "sshd_config")], "sshd.log", {})
        return self._wait_sshd(pid, timeout_s)

    def start_entrypoint(self, env: dict[str, str], timeout_s: float = 10.0) -> int:
        """The image's ENTRYPOINT (entrypoint launch mode): fleet-host-init makes host keys, runs sshd."""
        pid = self._spawn(
            [str(HOST_SCRIPTS / "fleet-host-init")],
            "sshd.log",
            {
                **env,
                "FLEET_SSHD": toolchain.sshd_path(),
                "FLEET_SSHD_CONFIG": str(self.etc / "sshd_config"),
                "FLEET_HOST_KEY_DIR": str(self.etc),
            },
        )
        return self._wait_sshd(pid, timeout_s)

    def new_host_key(self) -> None:
        """A new SSH host key, and sshd restarted on it (a re-imaged machine, or someone in the middle)."""
        key = self.etc / "ssh_host_ed25519_key"
        key.unlink(missing_ok=True)
        Path(str(key) + ".pub").unlink(missing_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "", "-f", str(key)], check=True)
        pid = self.sshd_pid()
        if pid:
            os.kill(pid, signal.SIGHUP)  # sshd re-executes itself and reads its host key again

    def announce_another_key(self) -> None:
        """A key no sshd of this host holds, announced on its console as fleet-host-key announces the host's."""
        with tempfile.TemporaryDirectory() as tmp:
            key = Path(tmp) / "key"
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "", "-f", str(key)], check=True)
            public = " ".join(Path(str(key) + ".pub").read_text().split()[:2])
        with (self.log_dir / "console.log").open("a") as console:
            console.write(f"fleet-host-key: {public}\n")

    def install_keys(self, authorized_keys: list[str]) -> None:
        _write_private(self.root / ".ssh" / "authorized_keys", "".join(k.strip() + "\n" for k in authorized_keys))

    def run_onstart(self, script: str, env: dict[str, str], foreign_key: bool = False) -> int:
        """Run the create call's onstart script (as /root/onstart.sh) with the container's environment.
        `foreign_key`: the host key it installs never reaches sshd, which goes on presenting the platform's
        (someone else answers the host's SSH)."""
        path = self.root / "onstart.sh"
        _write_private(path, script)
        decoy = self.directory / "decoy"
        overrides = {"FLEET_HOST_KEY_DIR": str(decoy), "FLEET_SSHD_PID_FILE": str(decoy / "none")}
        if foreign_key:
            decoy.mkdir(exist_ok=True)
        return self._spawn(["/bin/sh", str(path)], "onstart.log", env, overrides if foreign_key else None)

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
        return [*(pid for pid, started in self.roots if procs.identity(pid) == started), *([sshd] if sshd else [])]

    def processes(self) -> list[int]:
        return procs.host_pids(self.token, self._roots())

    def stop(self) -> int:
        """End every process of the host; return how many there were."""
        return procs.end_host_processes(self.token, self._roots())

    def shut_down(self) -> None:
        """End every process of the host and let go of its disk (kept for a later boot)."""
        self.stop()
        disks.detach(self.root)

    def remove(self) -> None:
        self.shut_down()
        shutil.rmtree(self.directory, ignore_errors=True)


def write_manifest(bin_dir: Path, out: Path) -> None:
    """The image's manifest of the programs in `bin_dir`, written as the image's build writes it."""
    subprocess.run([str(WRITE_MANIFEST), str(bin_dir), str(out)], check=True, capture_output=True, timeout=60)


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
