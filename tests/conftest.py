"""Shared fixtures: a real local cloud (server process, sshd hosts, hub) in a temporary directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from fleet.localcloud import control, procs, toolchain
from tests.helpers import processes_mentioning
from tests.install_beside import InstallBeside, held, shipped_ports
from tests.secrets_watch import SecretsWatch

BESIDE = pytest.StashKey[InstallBeside]()


def _say(config: pytest.Config, line: str) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    reporter.write_line(line) if reporter is not None else print(line, file=sys.stderr)


def pytest_sessionstart(session: pytest.Session) -> None:
    """The suite runs beside a running fleet install, as on a machine where `scripts/demo` left its gateway on
    fleet.toml's ports: started here on the controller alone (not in each xdist worker), unless those ports are
    held already, by an install that then plays the part."""
    config = session.config
    if hasattr(config, "workerinput"):
        return
    ports = shipped_ports()
    if any(held(p) for p in ports):
        _say(config, f"fleet.toml's gateway ports {ports} are held already: a running install plays the one beside")
        return
    beside = InstallBeside()
    _say(config, beside.start())
    config.stash[BESIDE] = beside


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The install beside stopped, and nothing it started left: else the session fails."""
    beside = session.config.stash.get(BESIDE, None)
    if beside is None:
        return
    del session.config.stash[BESIDE]
    problems = beside.stop()
    if problems:
        _say(session.config, "the install beside the tests: " + "; ".join(problems))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session", autouse=True)
def _state_of_its_own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Whatever a test leaves to fleet's default state directory lands in the session's, never in the home of
    whoever runs the tests."""
    before = os.environ.get("FLEET_STATE_DIR")
    os.environ["FLEET_STATE_DIR"] = str(tmp_path_factory.mktemp("state"))
    yield
    if before is None:
        os.environ.pop("FLEET_STATE_DIR", None)
    else:
        os.environ["FLEET_STATE_DIR"] = before


@pytest.fixture(scope="session", autouse=True)
def secrets_watch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecretsWatch]:
    """Around the whole session: no secret in a log, an output, a command line or the wrong file (see
    tests/secrets_watch.py); a leak fails the session at its end."""
    watch = SecretsWatch(tmp_path_factory.getbasetemp())
    watch.start()
    yield watch
    watch.stop()
    found = watch.findings()
    assert not found, "secrets where they must not be:\n" + "\n".join(found)


@pytest.fixture(scope="session")
def llama_server() -> Path:
    path = toolchain.llama_server_path()
    if path is None:
        pytest.fail("llama-server is not built: run scripts/build-llama-server (scripts/test does)")
    return path


@pytest.fixture(scope="session")
def ssh_keypair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    directory = tmp_path_factory.mktemp("ssh")
    key = directory / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "fleet-test", "-f", str(key)], check=True)
    return key, (directory / "id_ed25519.pub").read_text().strip()


class CloudHandle:
    def __init__(self, info: control.CloudInfo) -> None:
        self.info = info
        self.url = info.url
        self.key = info.api_key()
        self.headers = {"Authorization": f"Bearer {self.key}"}

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=30.0)

    def set_faults(self, faults: dict) -> None:
        httpx.put(f"{self.url}/admin/faults", json=faults, headers=self.headers, timeout=10).raise_for_status()

    def state(self) -> dict:
        import json

        return json.loads((self.info.state_dir / "state.json").read_text())

    def host_tokens(self) -> list[str]:
        return [i["token"] for i in self.state()["instances"].values()]


def _start(state_dir: Path, kind: bool = False, **kw: object) -> CloudHandle:
    info = control.start(state_dir, provision_delay_s=0.3, loading_delay_s=0.2, kind=kind, **kw)
    return CloudHandle(info)


def _kind(request: pytest.FixtureRequest) -> bool:
    """A test module gets the kind cloud (no rate limits, read lag, late keys or heartbeat gaps) only by
    saying why in a module-level `KIND_CLOUD = "..."`; everything else meets vast.ai's hardships."""
    reason = getattr(request.module, "KIND_CLOUD", None)
    if reason is not None:
        assert isinstance(reason, str) and len(reason) > 20, "KIND_CLOUD must say why the module needs it"
    return reason is not None


def _stop_and_check(handle: CloudHandle) -> None:
    try:
        tokens = handle.host_tokens()
    finally:  # a cloud whose state cannot be read is stopped all the same
        control.stop(handle.info.state_dir)
    leftovers = {t: procs.pids_with_marker(t) for t in tokens}
    assert not any(leftovers.values()), f"host processes left running: {leftovers}"
    assert processes_mentioning(handle.info.state_dir) == [], "processes of the local cloud left running"


@pytest.fixture(scope="module")
def cloud(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, llama_server: Path
) -> Iterator[CloudHandle]:
    """A local cloud for one test module; stopped (and checked for leftovers) afterwards."""
    handle = _start(tmp_path_factory.mktemp("localcloud"), _kind(request))
    try:
        yield handle
    finally:
        _stop_and_check(handle)


@pytest.fixture
def fresh_cloud(request: pytest.FixtureRequest, tmp_path: Path, llama_server: Path) -> Iterator[CloudHandle]:
    handle = _start(tmp_path / "localcloud", _kind(request))
    try:
        yield handle
    finally:
        _stop_and_check(handle)


@pytest.fixture
async def api(cloud: CloudHandle) -> AsyncIterator[httpx.AsyncClient]:
    async with cloud.client() as client:
        yield client


@pytest.fixture(scope="session")
def vastai_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("vastai-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VAST")}
    env.update(
        XDG_CONFIG_HOME=str(home / "config"),
        XDG_CACHE_HOME=str(home / "cache"),
        VASTAI_NO_UPDATE_CHECK="1",
        HOME=str(home),
    )
    return env


@pytest.fixture(scope="session")
def vastai_bin() -> str:
    path = shutil.which("vastai", path=str(Path(os.sys.executable).parent)) or shutil.which("vastai")
    if path is None:
        pytest.fail("the vastai CLI is not installed (pip install 'vastai==1.9.1')")
    return path


@pytest.fixture
def local_cloud_env(cloud: CloudHandle, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Point fleet at the module's local cloud, with no fault left over."""
    monkeypatch.setenv("FLEET_LOCALCLOUD_DIR", str(cloud.info.state_dir))
    cloud.set_faults({})
    yield
    cloud.set_faults({})


@pytest.fixture(scope="module")
def module_cloud_env(cloud: CloudHandle) -> Iterator[None]:
    """As local_cloud_env, for a module's own hosts (module-scoped fixtures that bring them up)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLEET_LOCALCLOUD_DIR", str(cloud.info.state_dir))
        cloud.set_faults({})
        yield
        cloud.set_faults({})


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A private PostgreSQL server (Debian's package) on a free loopback port, for this test session.

    Its data directory is a temporary one owned by the postgres user; it is stopped at the end by its
    own data directory (pg_ctl stop signals the PID in postmaster.pid).
    """
    import glob
    import tempfile

    from fleet.localcloud.network import free_port

    bins = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[4]))
    if not bins:
        pytest.fail("PostgreSQL is not installed: scripts/setup installs Debian's postgresql")
    pg_bin = bins[-1]
    root = tempfile.mkdtemp(prefix="fleet-pg-")
    shutil.chown(root, "postgres", "postgres")
    data, port = f"{root}/data", free_port()

    def as_postgres(*argv: str) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *argv], check=True, capture_output=True, timeout=120)

    as_postgres(f"{pg_bin}/initdb", "-D", data, "--auth=trust", "-U", "postgres", "-E", "UTF8")
    as_postgres(
        f"{pg_bin}/pg_ctl",
        "-D",
        data,
        "-l",
        f"{root}/log",
        "-w",
        "start",
        "-o",
        f"-p {port} -k {root} -c listen_addresses=127.0.0.1",
    )
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}"
    finally:
        as_postgres(f"{pg_bin}/pg_ctl", "-D", data, "-m", "fast", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server: str) -> str:
    """A fresh database on the session's PostgreSQL server."""
    import uuid

    from sqlalchemy import create_engine, text

    name = f"fleet_{uuid.uuid4().hex[:10]}"
    engine = create_engine(f"{postgres_server}/postgres", isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    engine.dispose()
    return f"{postgres_server}/{name}"
