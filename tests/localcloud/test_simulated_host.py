"""The simulated host's SSH side (issue 48): fleet's own bring-up steps, from the first connection to a server
answering over verified TLS, run unchanged against it, and it refuses what a real host refuses."""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from fleet.core import tls
from fleet.core.keys import ensure_key
from fleet.host import certificate, ops
from fleet.host.ports import check_service_port
from fleet.host.remote import HostKeyMismatch, RemoteError, connect, run, run_streaming
from fleet.localcloud.cardmodel import CardModel
from fleet.localcloud.network import free_port, private_address
from fleet.localcloud.simhost import SimulatedHost
from fleet.probes.runner import run_probes
from fleet.probes.server import Server
from tests.fleetkit import settings_for

CARD = CardModel("test", ((1, 2000.0), (4, 4000.0)))
SERVICE_PORT = 18080


@asynccontextmanager
async def simulated_host(tmp_path, authorized: bool = True) -> AsyncIterator[tuple[SimulatedHost, object]]:
    key = ensure_key(tmp_path / "fleet_ed25519")
    host = SimulatedHost("sim-1", private_address(), free_port(), CARD)
    if authorized:
        host.authorized.add(" ".join(key.public.split()[:2]))
    await host.start()
    try:
        yield host, key
    finally:
        await host.stop()


async def test_fleets_bring_up_steps_run_unchanged_on_a_simulated_host(tmp_path):
    settings = settings_for(tmp_path)
    profile = settings.profile("tiny")
    ca = tls.ensure_ca(tmp_path / "tls", "fleet test CA")
    async with simulated_host(tmp_path) as (host, key):
        # the platform's key until onstart announces the host's own, which is then the only one taken
        conn, platform = await connect(host.address, host.ssh_port, key, None, 10)
        conn.close()
        announced = host.announce_key()
        assert platform != announced and host.console == [f"fleet-host-key: {announced}"]
        with pytest.raises(HostKeyMismatch):
            await connect(host.address, host.ssh_port, key, platform, 2)
        conn, presented = await connect(host.address, host.ssh_port, key, announced, 10)
        assert presented == announced
        async with conn:
            await check_service_port(conn, host.address, SERVICE_PORT, SERVICE_PORT, 10)
            not_after = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
            await certificate.install(conn, ca, host.address, host.name, not_after)
            files = {"main": "models/tiny-llama-bytes.gguf"}
            server = Server(
                f"https://{host.address}:{SERVICE_PORT}",
                api_key="k" * 43,
                tls=tls.client_context(ca.certificate_path),
                tls_name=tls.host_tls_name(host.name),
            )
            await ops.start_server(conn, profile, SERVICE_PORT, files, server, 10, chat_template="{{ x }}")
            assert await ops.server_alive(conn, profile)
            memory = await ops.read_memory(conn, profile, 10)
            assert memory.server_rss_mib is not None and memory.available_mib < memory.total_mib
            [smoke] = await run_probes(["smoke"], server, profile, settings, None)
            assert smoke.passed, smoke.diagnosis
            assert host.files["fleet-run/chat-template.jinja"] == b"{{ x }}"
            assert host.files["fleet-run/api-key"] == b"k" * 43 + b"\n"
            # a second start replaces the first server; the key it was given is the only one taken
            await ops.start_server(conn, profile, SERVICE_PORT, files, server, 10)
            async with server.client(timeout=5) as client:
                assert (await client.get("/props")).status_code == 200
            async with server.without_key().client(timeout=5) as client:
                assert (await client.get("/props")).status_code == 401
            await run(conn, ["fleet-stop-server", "fleet-run"], timeout_s=10)
            assert not await ops.server_alive(conn, profile)
            assert (await ops.read_memory(conn, profile, 10)).server_rss_mib is None
            # the thermal probe's query: no card on a simulated host, as on every local host of this machine
            found = await conn.run("nvidia-smi --query-gpu=temperature.gpu --format=csv", check=False)
            assert found.exit_status == 127


async def test_a_pull_reads_the_hubs_size_and_keeps_it_as_the_files(tmp_path):
    body = b"x" * 12345

    async def head(request: web.Request) -> web.Response:
        return web.Response(body=body)

    app = web.Application()
    app.router.add_get("/f.gguf", head)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    sha = hashlib.sha256(body).hexdigest()
    try:
        async with simulated_host(tmp_path) as (host, key):
            conn, _ = await connect(host.address, host.ssh_port, key, None, 10)
            async with conn:
                progress: list[str] = []
                url = f"http://127.0.0.1:{port}/f.gguf"
                last = await run_streaming(conn, ["fleet-pull", url, sha, "models/f.gguf", "4"], progress.append)
                assert last == f"ok {sha} {len(body)}" and progress[:2] == ["progress 0", f"progress {len(body)}"]
                assert (await run(conn, ["stat", "-c", "%s", "models/f.gguf"], timeout_s=10)).stdout.strip() == "12345"
                with pytest.raises(RemoteError, match="No such file"):
                    await run(conn, ["stat", "-c", "%s", "models/other.gguf"], timeout_s=10)
                with pytest.raises(RemoteError, match="error: aria2c failed"):
                    await run_streaming(conn, ["fleet-pull", url + "x", sha, "models/g.gguf", "4"], progress.append)
    finally:
        await runner.cleanup()


async def test_a_simulated_host_refuses_what_a_real_one_refuses(tmp_path):
    async with simulated_host(tmp_path, authorized=False) as (host, key):
        with pytest.raises(RemoteError, match="PermissionDenied"):
            await connect(host.address, host.ssh_port, key, None, 1.5)
        host.authorized.add(" ".join(key.public.split()[:2]))
        conn, _ = await connect(host.address, host.ssh_port, key, None, 10)
        async with conn:
            for argv, stdin, error in [
                (["fleet-serve", "fleet-run", "--", "-m", "m.gguf"], "\n", "fleet-serve exited 2: error: no API key"),
                (["fleet-tls", "install", "fleet-run"], "not a certificate", "exited 3: error: what came on stdin"),
                (["fleet-put", "models/a", "0" * 64], "aGVsbG8=", "exited 3: error: sha256 mismatch"),
                (["fleet-port-check", "18080", "not-a-nonce!"], None, "exited 2: error: the nonce is letters"),
                (["rm", "-rf", "/"], None, "rm exited 127"),
                (["sh", "-c", "cat /etc/shadow"], None, "sh exited 2"),
            ]:
                with pytest.raises(RemoteError, match=error):
                    await run(conn, argv, stdin=stdin, timeout_s=10)
            # a certificate for another key is refused, as the image's fleet-tls refuses it
            await run(conn, ["fleet-tls", "request", "fleet-run"], timeout_s=10)
            ca = tls.ensure_ca(tmp_path / "tls", "fleet test CA")
            _, other = tls.sign_server(ca, ["elsewhere"], 1)
            with pytest.raises(RemoteError, match="not for this host's key"):
                await run(conn, ["fleet-tls", "install", "fleet-run"], stdin=other.decode(), timeout_s=10)
