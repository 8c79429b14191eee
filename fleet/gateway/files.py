"""Where a gateway instance keeps its files (one folder, private): HAProxy's configuration, pid file and
admin socket, the slots' internal doors, the endpoints' certificate, the maps it reads keys from, the
/v1/models answers."""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import os
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from cryptography import x509

from fleet.core import paths
from fleet.core.config import ConfigError, Settings
from fleet.core.files import write_public
from fleet.core.tls import CertificateAuthority, load_certificate, peer_tls_name, sign_peer, sign_server

SOCKET_PATH_MAX = 90  # of a Unix socket's 108 bytes: HAProxy adds ".<pid>.tmp" while it binds
CERTIFICATE_DAYS = 90
RENEW_WITHIN = dt.timedelta(days=30)


@dataclass(frozen=True)
class GatewayCa:
    """fleet's CA as a gateway needs it: its certificate always (hosts and peers are verified against it), its
    key only to sign a certificate the gateway was given none of (`signer` is asked then, and only then: a
    gateway's machine given its certificates needs no CA key)."""

    certificate_path: Path
    signer: Callable[[], CertificateAuthority]

    @classmethod
    def of(cls, ca: CertificateAuthority) -> GatewayCa:
        return cls(ca.certificate_path, lambda: ca)


@dataclass(frozen=True)
class GatewayFiles:
    directory: Path

    @property
    def config(self) -> Path:
        return self.directory / "haproxy.cfg"

    @property
    def pidfile(self) -> Path:
        return self.directory / "haproxy.pid"

    @property
    def access_log(self) -> Path:
        return self.directory / "access.log"  # a line a request: who, which call (hashed), where, how it went

    @property
    def errors(self) -> Path:
        return self.directory / "haproxy.err"  # what HAProxy said of itself since it last started

    @property
    def socket(self) -> Path:
        """HAProxy's admin socket: in the folder, unless its path would not fit a Unix socket's 108 bytes
        (HAProxy binds it under a longer temporary name first); then in a private folder of this user's
        under the runtime directory."""
        beside = self.directory / "admin.sock"
        if len(str(beside).encode()) <= SOCKET_PATH_MAX:
            return beside
        return runtime_dir() / f"gateway-{self.tag}.sock"

    @property
    def doors(self) -> Path:
        """The folder of the slots' internal doors (a Unix socket each, mode 600, that only this user's HAProxy
        reaches): beside the rest, unless a door's path would not fit a Unix socket; then a private folder
        of this user's under the runtime directory. Never an abstract socket: those have no permissions."""
        beside = self.directory / "doors"
        if len(str(beside / "t99-9999.sock").encode()) <= SOCKET_PATH_MAX:
            return beside
        return runtime_dir() / f"gateway-{self.tag}"

    def door(self, target_index: int, slot: int) -> Path:
        return self.doors / f"t{target_index}-{slot}.sock"

    @property
    def pem(self) -> Path:
        return self.directory / "endpoint.pem"  # certificate chain and key, as HAProxy reads them

    @property
    def peer_pem(self) -> Path:
        # the peers' door's certificate chain and key: fleet's CA alone vouches for it, for this peer's name
        return self.directory / "peer.pem"

    @property
    def agent_map(self) -> Path:
        return self.directory / "agent-keys.map"  # sha256 of a key -> the agent's name

    @property
    def host_map(self) -> Path:
        return self.directory / "host-keys.map"  # empty on disk: the hosts' keys live in HAProxy's memory

    @property
    def name_map(self) -> Path:
        return self.directory / "host-names.map"  # a slot's section -> the name its host's certificate holds

    @property
    def acme_map(self) -> Path:
        # an HTTP-01 challenge's token -> its answer, while fleet's issuance asks: empty on disk, filled and
        # emptied over the admin socket by certbot's hooks (acmehook.py)
        return self.directory / "acme-challenges.map"

    @property
    def cache_groups_map(self) -> Path:
        return self.directory / "cache-groups.map"  # an agent -> "group/NAME" of the cache group it shares

    @property
    def calls_map(self) -> Path:
        # a backend's door (calls_tN/sS) -> the calls its host holds in conversation: admission.lua loads it from
        # its own folder, so the name is fixed
        return self.directory / "host-calls.map"

    @property
    def lua(self) -> Path:
        return self.directory / "admission.lua"

    @property
    def observe_lua(self) -> Path:
        return self.directory / "observe.lua"

    def models(self, index: int) -> Path:
        return self.directory / f"models-t{index}.json"

    def model(self, index: int) -> Path:
        return self.directory / f"model-t{index}.json"

    @property
    def tag(self) -> str:
        """Tells this instance's internal sockets apart from another's on the same machine."""
        return hashlib.sha256(str(self.directory.resolve()).encode()).hexdigest()[:10]


def runtime_dir() -> Path:
    """A folder of this user's alone, with a short path, for sockets: $XDG_RUNTIME_DIR/fleet, else
    /tmp/fleet-UID (checked: a folder, not a link, this user's, no one else's to read or enter)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(base) / "fleet" if base else Path(tempfile.gettempdir()) / f"fleet-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700, parents=bool(base))
    _check_private(folder)
    return folder


def _check_private(folder: Path) -> None:
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ConfigError(f"{folder}: not a private folder of this user's (mode 0700): the gateway's sockets go there")


def _check_own(folder: Path) -> None:
    """The gateway's folder is this user's own, not a link: a folder another user made first (its mode made 0700
    by root's chmod all the same) would let that user swap the Lua, the maps and the certificate HAProxy reads."""
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ConfigError(
            f"{folder}: not a folder of this user's (owner uid {info.st_uid}): the gateway's configuration, keys and "
            "certificate go there; remove it or name another in [gateway] directory"
        )


def files_for(settings: Settings) -> GatewayFiles:
    directory = settings.gateway.directory
    return GatewayFiles(Path(os.path.expanduser(directory)) if directory else paths.state_dir() / "gateway")


def prepare(files: GatewayFiles, settings: Settings, ca: GatewayCa) -> None:
    """The folder, its certificate (the user's, or one fleet's CA signs), the Lua (admission, observation), the
    maps' empty files."""
    files.directory.mkdir(parents=True, exist_ok=True)
    _check_own(files.directory)
    files.directory.chmod(0o700)
    with contextlib.suppress(FileExistsError):
        files.doors.mkdir(mode=0o700)
    _check_private(files.doors)
    for lua in (files.lua, files.observe_lua):
        write_public(lua, resources.files("fleet.gateway").joinpath(lua.name).read_bytes())
    for map_file in (files.agent_map, files.host_map, files.name_map, files.calls_map, files.acme_map):
        write_public(map_file, b"")
    groups = settings.gateway.cache_groups
    write_public(
        files.cache_groups_map,
        "".join(f"{agent} group/{group}\n" for group, agents in groups.items() for agent in agents).encode(),
    )
    certificates(files, settings, ca)


def certificates(files: GatewayFiles, settings: Settings, ca: GatewayCa) -> list[Path]:
    """The agents' door's certificate and, with peers, the peers' door's: those given read again, those fleet
    makes signed anew when they near their end (or their names changed). The files whose bytes changed."""
    before = {p: p.read_bytes() for p in (files.pem, files.peer_pem) if p.exists()}
    _certificate(files, settings, ca)
    if settings.gateway.peers:
        _peer_certificate(files, settings, ca)
    return [p for p in (files.pem, files.peer_pem) if p.exists() and before.get(p) != p.read_bytes()]


def endpoint_names(settings: Settings) -> list[str]:
    listen = settings.gateway.listen
    unspecified = listen in ("0.0.0.0", "::")
    return ["localhost", "127.0.0.1", *([] if unspecified else [listen]), *settings.gateway.names]


def _certificate(files: GatewayFiles, settings: Settings, ca: GatewayCa) -> None:
    given = _given(settings, "certificate_file", "key_file")
    if given is not None:
        write_pem(files.pem, *given)
        return
    names = endpoint_names(settings)
    domain = settings.gateway.acme.domain
    if domain:
        # the ACME CA's certificate, once it gave one, stays (acme.py renews it); until then, a provisional one
        served = load_certificate(files.pem)
        authority = load_certificate(ca.certificate_path)
        if served is not None and authority is not None and served.issuer != authority.subject:
            return
        names = [domain, *names]
    if _still_good(files.pem, names, ca):
        return
    key, certificate = sign_server(ca.signer(), names, CERTIFICATE_DAYS)
    write_pem(files.pem, certificate, key)


def _peer_certificate(files: GatewayFiles, settings: Settings, ca: GatewayCa) -> None:
    """The certificate this gateway shows its peers, and with which it connects to theirs: its peer name in
    fleet's own domain, for serving and for connecting; no host's certificate holds such a name or may connect."""
    given = _given(settings, "peer_certificate_file", "peer_key_file")
    if given is not None:
        write_pem(files.peer_pem, *given)
        return
    name = peer_tls_name(settings.gateway.peer_name)
    if _still_good(files.peer_pem, [name], ca):
        return
    key, certificate = sign_peer(ca.signer(), settings.gateway.peer_name, CERTIFICATE_DAYS)
    write_pem(files.peer_pem, certificate, key)


def _given(settings: Settings, certificate_key: str, key_key: str) -> tuple[bytes, bytes] | None:
    """A certificate chain and key the configuration names (both, or neither), read; None when it names none."""
    certificate_file, key_file = getattr(settings.gateway, certificate_key), getattr(settings.gateway, key_key)
    if not (certificate_file or key_file):
        return None
    if not (certificate_file and key_file):
        raise ConfigError(f"{settings.source}: gateway.{certificate_key} and gateway.{key_key} go together")
    try:
        return (
            Path(os.path.expanduser(certificate_file)).read_bytes(),
            Path(os.path.expanduser(key_file)).read_bytes(),
        )
    except OSError as e:
        raise ConfigError(f"{settings.source}: gateway.{certificate_key}: {e.filename}: {e.strerror}") from None


def write_pem(path: Path, chain: bytes, key: bytes) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(chain.rstrip(b"\n") + b"\n" + key)
    os.replace(partial, path)


def _still_good(pem: Path, names: list[str], ca: GatewayCa) -> bool:
    certificate, authority = load_certificate(pem), load_certificate(ca.certificate_path)
    if certificate is None or authority is None or certificate.issuer != authority.subject:
        return False
    if certificate.not_valid_after_utc - dt.datetime.now(dt.UTC) < RENEW_WITHIN:
        return False
    try:
        alt = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    held = {str(v) for v in alt.get_values_for_type(x509.IPAddress)} | set(alt.get_values_for_type(x509.DNSName))
    return set(names) <= held
