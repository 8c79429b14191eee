"""Security on real parts (issue 20): every host speaks HTTPS alone with a certificate fleet signed, nothing
of the operator's SSH setup and no Hugging Face token reaches a host, a host's words never drive the
operator's terminal, and what a host serves hands no transcript to anyone."""

import asyncio
import contextlib
import datetime as dt
import hashlib
import ipaddress
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path
from urllib.parse import urljoin

import httpx
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fleet.context import key_secret_path, tls_dir
from fleet.control import rotation, sizing
from fleet.control.up import UpRequest
from fleet.core import tls
from fleet.core.apikeys import host_api_key
from fleet.core.config import ConfigError, Serve, verified_database_url
from fleet.core.errors import FleetError
from fleet.core.files import write_private
from fleet.host import addresses, hubfile
from fleet.host.phase import PhaseFailed
from fleet.host.remote import connect, run
from fleet.localcloud import tinymodels
from fleet.localcloud.hosts import HOST_SCRIPTS
from fleet.localcloud.hub import TINY_REPO
from fleet.localcloud.llamaproc import llama_server as run_llama_server
from fleet.probes.server import Server
from fleet.probes.stream import Connection, StreamError
from tests import dripper
from tests.fleetkit import cli_env, fleet_for, settings_for, with_variant, write_config
from tests.helpers import http_server, listed_instances


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env):
    yield


async def test_the_operators_ssh_config_and_agent_never_reach_a_host(cloud, tmp_path, monkeypatch):
    # an operator whose ~/.ssh/config forwards the agent to every host, with an agent running
    home = tmp_path / "operator"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text("Host *\n    ForwardAgent yes\n    User nobody\n    Port 1\n")
    agent = subprocess.Popen(
        ["ssh-agent", "-D", "-a", str(tmp_path / "agent.sock")], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        while not (tmp_path / "agent.sock").exists():
            assert agent.poll() is None
            await asyncio.sleep(0.05)
        monkeypatch.setenv("HOME", str(home))
        monkeypatch.setenv("SSH_AUTH_SOCK", str(tmp_path / "agent.sock"))
        async with fleet_for(settings_for(tmp_path)) as fleet:
            [host] = (await fleet.up(UpRequest("tiny", "eu"))).ready  # reached despite User nobody, Port 1
            try:
                conn, _ = await connect(host.ssh_host, host.ssh_port, fleet.ssh_key, host.host_key, 30)
                try:
                    seen = await run(conn, ["sh", "-c", 'echo "agent=${SSH_AUTH_SOCK:-none}"'])
                finally:
                    conn.close()
                assert str(seen.stdout).strip() == "agent=none"  # no agent was forwarded to the host
            finally:
                await fleet.destroy(None)
    finally:
        os.killpg(agent.pid, signal.SIGTERM)
        agent.wait(10)


def test_a_hosts_log_with_markup_and_escape_codes_is_shown_as_text(cloud, tmp_path):
    # llama-server repeats an unknown argument in its error: the log tail carries what the "host" chose
    weird = (
        "\n[models.tiny-weird]\ngpu_ram_gb = 0\ndisk_gb = 10\nslots = 1\nctx_per_slot = 2048\n"
        'files = [{ key = "main", repo = "fleet-local/tiny-models", file = "tiny-llama-bytes.gguf" }]\n'
        'args = ["-c", "2048", "--[/INST]\\u001b[2J\\u001b[31mpwned"]\n'
    )
    env = cli_env(cloud, tmp_path)
    # one machine's failure shows the tail: the four more that up would try fail the same way
    write_config(tmp_path, weird, up={"max_attempts": 1})
    up = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "up", "--model", "tiny-weird", "--region", "eu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert up.returncode == 1, up.stdout + up.stderr
    assert "Traceback" not in up.stderr and "MarkupError" not in up.stderr
    assert "[/INST]" in up.stderr and "pwned" in up.stderr  # shown, as text
    assert "\x1b" not in up.stderr + up.stdout  # no escape sequence reaches the terminal
    subprocess.run([sys.executable, "-m", "fleet.cli", "destroy", "--all", "--yes"], env=env, timeout=300)


async def test_no_transcript_is_readable_through_a_host_and_the_drain_sees_calls_in_flight(cloud, tmp_path):
    settings = settings_for(tmp_path)
    async with fleet_for(settings) as fleet:
        [host] = (await fleet.up(UpRequest("tiny", "eu"))).ready
        try:
            key = {"Authorization": f"Bearer {fleet.api_key(host)}"}
            # the database alone opens no host: its key is derived from a secret kept apart, private
            database = b"".join(p.read_bytes() for p in settings.database.file.parent.glob("fleet.db*"))
            assert host.api_key_nonce and host.api_key_nonce.encode() in database
            assert fleet.api_key(host).encode() not in database
            secret = key_secret_path(settings)
            assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and secret.read_bytes() not in database
            guessed = host_api_key(os.urandom(32), host.name, host.api_key_nonce)  # the nonce, another secret
            async with fleet.server(host).without_key().client(timeout=30) as client:
                assert (await client.get("/metrics", headers={"Authorization": f"Bearer {guessed}"})).status_code == 401
                for path in ("/slots", "/slots/0"):
                    assert (await client.get(path, headers=key)).status_code >= 400  # not even with the key
                assert (await client.get("/metrics")).status_code == 401  # without the key, nothing
                metrics = (await client.get("/metrics", headers=key)).text
                assert "llamacpp:requests_processing" in metrics
                page = await client.get("/", headers=key)
                assert page.status_code >= 400 or "<html" not in page.text.lower()  # no web UI
        finally:
            await fleet.destroy(None)


def _processes_carrying(secret: str) -> list[str]:
    """Every other process whose command line or environment holds `secret`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            for part in ("cmdline", "environ"):
                try:
                    if secret.encode() in (entry / part).read_bytes():
                        found.append(f"{entry.name} {part}")
                except OSError:
                    continue
    return found


async def _hub_stats(cloud) -> dict:
    async with cloud.client() as api:
        return (await api.get("/admin/hub-stats")).json()


async def test_a_gated_models_token_opens_the_hub_for_fleet_and_reaches_no_host(
    cloud, tmp_path, monkeypatch, secrets_watch
):
    token = "hf_" + "g4t3d" * 7
    secrets_watch.register(token)
    cloud.set_faults({"gated_repos": {TINY_REPO: token}})
    try:
        # without the token: one clear error before anything is rented (the plan reads the file's header)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        async with fleet_for(settings_for(tmp_path / "none")) as fleet:
            with pytest.raises(FleetError, match=r"HTTP 401 GatedRepo: the hub refuses it .*\$HF_TOKEN"):
                await fleet.up(UpRequest("tiny", "eu"))
        async with cloud.client() as api:
            assert await listed_instances(api) == []
        # and where a host would pull it, the hub's refusal blames neither the machine nor the next offer
        url = f"{cloud.url}/{TINY_REPO}/resolve/main/tiny-llama-bytes.gguf"
        for given, why in (("", "gated or private, and $HF_TOKEN is not set"), ("hf_wrong", "does not open it")):
            with pytest.raises(PhaseFailed, match=re.escape(why)) as refused:
                await hubfile.resolve(url, given)
            assert refused.value.blacklist is False and refused.value.retry is False
        opened = await hubfile.resolve(url, token)
        assert (
            "/cdn/" in opened.download_url and "Signature=" in opened.download_url and token not in opened.download_url
        )

        monkeypatch.setenv("HF_TOKEN", token)
        before = await _hub_stats(cloud)
        seen: list[str] = []
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                seen.extend(_processes_carrying(token))
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        try:
            async with fleet_for(settings_for(tmp_path / "with")) as fleet:
                [host] = (await fleet.up(UpRequest("tiny", "eu"))).ready
                stop.set()
                await watcher
                after = await _hub_stats(cloud)
                assert after["token_requests"] > before["token_requests"]  # fleet itself opened the gate
                assert after["host_token_requests"] == before["host_token_requests"]  # no host ever showed it
                assert seen == []  # in no command line or environment, on the host or here
                for path in (cloud.info.state_dir / "hosts" / str(host.instance_id)).rglob("*"):
                    if path.is_file() and path.stat().st_size < 50_000_000:
                        assert token.encode() not in path.read_bytes(), path
                await fleet.destroy(None)
        finally:
            stop.set()
            await watcher
    finally:
        cloud.set_faults({})


async def test_a_pull_that_outlives_its_signed_url_goes_on_with_a_fresh_one(cloud, tmp_path):
    # the cut ends the URL's life: aria2c's retries are refused, and only a new URL from the hub goes on
    cloud.set_faults({"pull_reset": {"after_bytes": 100_000, "count": 1, "expire_url": True}})
    try:
        before = await _hub_stats(cloud)
        async with fleet_for(settings_for(tmp_path, up={"pull_connections": 1})) as fleet:
            result = await fleet.up(UpRequest("tiny", "eu"))
            await fleet.destroy(None)
        assert len(result.ready) == 1 and len(result.attempts) == 1, result.attempts  # the same host, no new rental
        after = await _hub_stats(cloud)
        assert after["refused_urls"] > before["refused_urls"]  # the old URL was refused, as an expired one is
    finally:
        cloud.set_faults({})


def _host_cert(ca, address: str, directory: Path, name: str = "h") -> tuple[Path, Path]:
    """A server key made here and a certificate from `ca` for the host `name` at `address`: what a host would
    serve."""
    key = ec.generate_private_key(ec.SECP256R1())
    request = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "h")]))
        .sign(key, hashes.SHA256())
    )
    pem = tls.sign_host(ca, request.public_bytes(serialization.Encoding.PEM), address, name, _in(days=1))
    directory.mkdir(parents=True, exist_ok=True)
    key_path, cert_path = directory / "tls.key", directory / "tls.pem"
    write_private(
        key_path,
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    cert_path.write_bytes(pem)
    return key_path, cert_path


def _in(**delta: float) -> dt.datetime:
    return dt.datetime.now(dt.UTC) + dt.timedelta(**delta)


async def test_a_host_serves_https_alone_with_a_certificate_fleet_signed_for_its_address(cloud, tmp_path):
    async with fleet_for(settings_for(tmp_path)) as fleet:
        [host] = (await fleet.up(UpRequest("tiny", "eu"))).ready
        try:
            assert host.api_url.startswith("https://")
            address, port = host.api_url.removeprefix("https://").split(":")
            # plain HTTP gets no answer from it
            async with httpx.AsyncClient(timeout=10) as plain:
                with pytest.raises(httpx.HTTPError):
                    await plain.get(f"http://{address}:{port}/health")
            # nor does a client that trusts the system's roots and not fleet's CA
            async with httpx.AsyncClient(timeout=10) as system_roots:
                with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                    await system_roots.get(f"{host.api_url}/health")
            async with fleet.server(host).client(timeout=10) as client:
                assert (await client.get("/health")).status_code == 200
            # the certificate: fleet's CA, the marketplace's address, no longer than the contract
            with (
                socket.create_connection((address, int(port)), timeout=10) as tcp,
                fleet.tls.wrap_socket(tcp, server_hostname=address) as wrapped,
            ):
                der = wrapped.getpeercert(binary_form=True)
            cert = x509.load_der_x509_certificate(der)
            assert cert.issuer == fleet.ca.certificate.subject
            names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == [address]
            assert names.get_values_for_type(x509.DNSName) == [host.tls_name] == [tls.host_tls_name(host.name)]
            contract_end = host.contract_end_at.replace(tzinfo=dt.UTC)
            assert cert.not_valid_after_utc <= contract_end
            # the probes time the TLS handshake apart from the connect, and a kept connection skips both
            conn = Connection(fleet.server(host))
            try:
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                first, second = await conn.chat(body), await conn.chat(body)
            finally:
                await conn.close()
            assert first.status == 200 and first.timing.connect_ms is not None and first.timing.tls_ms is not None
            assert second.timing.reused and second.timing.connect_ms is None and second.timing.tls_ms is None
            # the host's TLS key was made there and stays there, private
            run_dir = cloud.info.state_dir / "hosts" / str(host.instance_id)
            [key_file] = [p for p in run_dir.rglob("tls.key")]
            assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
            secret = key_file.read_bytes()
            for path in tmp_path.rglob("*"):
                if path.is_file():
                    assert secret not in path.read_bytes(), path
        finally:
            await fleet.destroy(None)


async def test_a_server_with_anyone_elses_certificate_is_refused(llama_server, tmp_path):
    """On the path to a host: a certificate from another CA, or fleet's own for another host at this address (a
    listing that named another host's place got it signed); for a host signed before hosts had names (the record
    holds none), fleet's own for another address."""
    ours = tls.ensure_ca(tmp_path / "ours", "fleet CA ours")
    theirs = tls.ensure_ca(tmp_path / "theirs", "fleet CA theirs")
    model = tinymodels.ensure(tmp_path / "models")["tiny"]
    verify = tls.client_context(ours.certificate_path)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    h = tls.host_tls_name("h")  # what fleet's clients of host "h" check, at the address the record holds
    cases = {  # the certificate's CA, its address and host; the name the client checks
        "fleet's CA, this host": (ours, "127.0.0.1", "h", h),
        "another CA": (theirs, "127.0.0.1", "h", h),
        "fleet's CA, another host at this address": (ours, "127.0.0.1", "h2", h),
        "fleet's CA, no name, another address": (ours, "127.0.0.2", "h", None),
    }
    answered: dict[str, tuple[object, object]] = {}
    for case, (ca, address, name, expected) in cases.items():
        folder = tmp_path / case.replace(" ", "_").replace("'", "").replace(",", "")
        key, cert = _host_cert(ca, address, folder, name)
        flags = ["-np", "1", "-c", "512", "-t", "1", "--ssl-key-file", str(key), "--ssl-cert-file", str(cert)]
        up = tls.client_context(ca.certificate_path)  # to see it come up at all, whatever its name
        up.check_hostname = False
        with run_llama_server(llama_server, model, *flags, tls=up) as url:
            server = Server(url, None, verify, expected)
            conn = Connection(server)
            try:
                streamed: object = (await conn.chat(body)).status
            except StreamError as e:
                streamed = str(e)
            finally:
                await conn.close()
            try:
                async with server.client(timeout=30) as client:
                    asked: object = (await client.get("/health")).status_code
            except httpx.ConnectError as e:
                asked = str(e)
            answered[case] = (streamed, asked)
    assert answered.pop("fleet's CA, this host") == (200, 200)  # verified, and through TLS to the server itself
    for case, said in answered.items():
        assert all("CERTIFICATE_VERIFY_FAILED" in str(s) for s in said), (case, said)


def test_fleet_signs_only_the_public_key_of_a_well_formed_request(tmp_path):
    ca = tls.ensure_ca(tmp_path / "ca", "fleet CA test")
    assert stat.S_IMODE((tmp_path / "ca" / "ca.key").stat().st_mode) == 0o600
    assert tls.ensure_ca(tmp_path / "ca", "fleet CA test").certificate == ca.certificate  # made once
    key = ec.generate_private_key(ec.SECP256R1())
    greedy = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bank.example")]))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("bank.example"), x509.IPAddress(ipaddress.ip_address("1.2.3.4"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem = greedy.public_bytes(serialization.Encoding.PEM)
    cert = x509.load_pem_x509_certificate(tls.sign_host(ca, pem, "203.0.113.7", "h1", _in(hours=5)))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(v) for v in names.get_values_for_type(x509.IPAddress)] == ["203.0.113.7"]
    assert names.get_values_for_type(x509.DNSName) == ["h1.hosts.fleet.invalid"]  # the host's own name alone
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usages) == [ExtendedKeyUsageOID.SERVER_AUTH]  # never a client: no gateway peer
    assert cert.subject.rfc4514_string() == "CN=h1" and cert.public_key() == key.public_key()
    assert cert.not_valid_after_utc <= _in(hours=5)

    der = greedy.public_bytes(serialization.Encoding.DER)
    flipped = der[:-3] + bytes([der[-3] ^ 1]) + der[-2:]  # one bit of the signature
    tampered = x509.load_der_x509_csr(flipped).public_bytes(serialization.Encoding.PEM)
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    weak_request = (
        x509.CertificateSigningRequestBuilder().subject_name(x509.Name([])).sign(weak, hashes.SHA256())
    ).public_bytes(serialization.Encoding.PEM)
    refused = {
        "not a PEM certificate request": b"[/INST] not a request",
        "over 8192 bytes": b"-" * (tls.MAX_REQUEST_BYTES + 1),
        "not signed by its own key": tampered,
        "1024 bits, under 2048": weak_request,
    }
    for why, request in refused.items():
        with pytest.raises(tls.CertificateRequestRefused, match=why):
            tls.sign_host(ca, request, "203.0.113.7", "h1", _in(hours=5))
    with pytest.raises(tls.CertificateRequestRefused, match="end before it starts"):
        tls.sign_host(ca, pem, "203.0.113.7", "h1", _in(hours=-1))
    with pytest.raises(ValueError):
        tls.sign_host(ca, pem, "host.example", "h1", _in(hours=5))  # an address, never a name


async def test_the_hub_may_send_a_host_to_itself_or_its_cdn_over_https_alone():
    sent: dict[str, str] = {}

    async def resolve(request: web.Request) -> web.Response:
        headers = {"X-Linked-Etag": f'"{"0" * 64}"', "X-Linked-Size": "1", "Location": sent["to"]}
        return web.Response(status=302, headers=headers)

    async with http_server({"/org/repo/resolve/main/model.gguf": resolve}) as hub:
        url = f"{hub}/org/repo/resolve/main/model.gguf"
        for to in ("https://169.254.169.254/latest", "http://cdn-lfs.hf.co/x", "https://evil.example/hf.co/x",
                   "https://hf.co.evil.example/x", "ftp://cdn-lfs.hf.co/x", "file:///etc/shadow"):  # fmt: skip
            sent["to"] = to
            with pytest.raises(PhaseFailed, match="the hub sent") as refused:
                await hubfile.resolve(url, "")
            assert refused.value.retry is False, to
        for to in (
            "/cdn/org/repo/model.gguf?Signature=x",
            "https://cdn-lfs-us-1.hf.co/x",
            "https://cas-bridge.xethub.hf.co/x",
        ):
            sent["to"] = to
            assert (await hubfile.resolve(url, "")).download_url == urljoin(url, to)


async def test_fleet_pull_takes_a_metalink_for_the_file_itself_and_fetches_nothing_it_names(tmp_path):
    payload = os.urandom(4096)
    fetched: list[str] = []

    async def elsewhere(request: web.Request) -> web.Response:
        fetched.append(request.path)
        return web.Response(body=payload)

    async def metalink(request: web.Request) -> web.Response:
        body = (
            '<?xml version="1.0" encoding="UTF-8"?><metalink xmlns="urn:ietf:params:xml:ns:metalink">'
            f'<file name="model.gguf"><url>{request.url.with_path("/elsewhere.bin")}</url></file></metalink>'
        )
        return web.Response(body=body.encode(), content_type="application/metalink4+xml")

    async with http_server({"/model.meta4": metalink, "/elsewhere.bin": elsewhere}) as base:
        want = hashlib.sha256(payload).hexdigest()
        argv = [str(HOST_SCRIPTS / "fleet-pull"), f"{base}/model.meta4", want, str(tmp_path / "model.gguf"), "1"]
        pulled = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        _, err = await pulled.communicate()
    assert pulled.returncode == 3 and b"sha256 mismatch" in err  # the metalink document itself, not the payload
    assert fetched == []


def test_an_address_fleet_would_connect_to_must_be_global():
    refused = ["10.0.0.5", "192.168.1.20", "169.254.169.254", "0.0.0.0", "::1", "fd00::1", "127.0.0.1", "x;rm -rf /"]
    for address in refused:
        assert addresses.refusal(address, loopback_ok=False) is not None, address
    assert addresses.refusal("127.0.0.1", loopback_ok=True) is None  # the local cloud's hosts, on this machine
    assert addresses.refusal("10.0.0.5", loopback_ok=True) is not None  # never a private network
    assert addresses.refusal("8.8.8.8", loopback_ok=False) is None
    assert addresses.refusal("2606:4700::1111", loopback_ok=False) is None
    # global by the standard library's reckoning, each reaching another (maybe private) address, or no host
    for address in ("64:ff9b::a00:5", "64:ff9b:1::a00:5", "2002:a00:5::1", "::10.0.0.5", "::ffff:10.0.0.5",
                    "192.0.0.9", "192.0.0.200"):  # fmt: skip
        assert addresses.refusal(address, loopback_ok=True) is not None, address
    assert addresses.refusal("ssh5.vast.ai", loopback_ok=False) is not None  # no name where an IP belongs
    assert addresses.refusal("ssh5.vast.ai", loopback_ok=False, names_ok=True) is None  # the SSH gateway
    assert addresses.refusal("ssh5.vast.ai;reboot", loopback_ok=False, names_ok=True) is not None
    # security round four: any name passed, and some addresses the standard library calls global lead elsewhere
    for name in ("localhost", "2130706433", "127.1", "ssh\uff15.vast.ai", "ssh5.vast.ai.evil.example", "sshx.vast.ai"):
        assert addresses.refusal(name, loopback_ok=True, names_ok=True) is not None, name
    for address in ("::ffff:0:a00:5", "fec0::1", "ff02::1", "ff0e::1"):  # SIIT, site-local, multicast
        assert addresses.refusal(address, loopback_ok=True, names_ok=True) is not None, address


async def test_an_ssh_gateway_name_is_held_to_the_rule_by_every_address_it_resolves_to(monkeypatch):
    with pytest.raises(PhaseFailed, match=r"where vast\.ai's SSH gateway"):
        await addresses.require_resolved("localhost", 22, loopback_ok=True)
    await addresses.require_resolved("127.0.0.2", 22, loopback_ok=True)  # the local cloud's gateway: an address
    # a gateway name that resolves somewhere fleet may not connect (here the only name this machine resolves
    # without a network, let through as a gateway's name): refused by the address it leads to
    monkeypatch.setattr(addresses, "SSH_GATEWAY_NAME", re.compile(r"localhost(\.invalid)?"))
    with pytest.raises(PhaseFailed, match=r"its SSH gateway localhost resolves to (127\.0\.0\.1|::1): .*not a global"):
        await addresses.require_resolved("localhost", 22, loopback_ok=False)
    await addresses.require_resolved("localhost", 22, loopback_ok=True)  # on the local cloud, loopback is the host
    with pytest.raises(PhaseFailed, match="does not resolve"):
        await addresses.require_resolved("localhost.invalid", 22, loopback_ok=True)


def test_a_database_off_this_machine_is_reached_only_with_its_certificate_verified(cloud, tmp_path):
    env = cli_env(cloud, tmp_path)
    password = "hunter2-" + os.urandom(8).hex()
    remote = f"postgresql+psycopg://fleet:{password}@db.example.com:5432/fleet"
    lying = (
        "postgresql+psycopg://fleet@localhost/fleet?hostaddr=203.0.113.5",  # libpq connects to the hostaddr
        "postgresql+psycopg://fleet@/fleet?host=/run/postgresql,db.example.com",  # the second of a list
        "postgresql+psycopg://fleet@127.0.0.1:5432,db.example.com:5432/fleet",
    )
    for args in (("status",), ("status", "--json")):
        result = subprocess.run(
            [sys.executable, "-m", "fleet.cli", *args],
            env={**env, "FLEET_DATABASE_URL": remote},
            capture_output=True,
            text=True,
            timeout=60,
        )
        said = result.stdout if "--json" in args else result.stderr
        assert result.returncode == 2 and "sslmode=verify-full" in said, result.stderr
        assert password not in result.stdout + result.stderr  # the URL is never echoed
        if "--json" in args:
            assert "sslmode=verify-full" in json.loads(result.stdout)["error"]
        else:
            assert len(result.stderr.strip().splitlines()) == 1
    # every other form is refused by the check the command above went through, each a process less
    for url in (remote + "?sslmode=require", "postgresql+psycopg://fleet@/fleet?host=10.0.0.5&sslmode=prefer", *lying):
        with pytest.raises(ValueError, match="sslmode=verify-full") as refused:
            verified_database_url(url)
        assert password not in str(refused.value)
    write_config(tmp_path, database={"url": remote})  # the file cli_env wrote, its database's URL in it
    in_file = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "status"], env=env, capture_output=True, text=True, timeout=60
    )
    assert in_file.returncode == 2 and "database.url" in in_file.stderr and password not in in_file.stderr
    # on this machine (a socket or loopback) no TLS is needed; off it, verify-full is what passes
    for fine in (
        "postgresql+psycopg://fleet@/fleet",
        "postgresql+psycopg://fleet@/fleet?host=/run/postgresql",
        "postgresql+psycopg://fleet@127.0.0.1:5432/fleet",
        "postgresql+psycopg://fleet@localhost/fleet",
        "postgresql+psycopg://fleet@db.example.com/fleet?hostaddr=127.0.0.1",  # a name, reached on loopback
        remote + "?sslmode=verify-full&sslrootcert=/etc/fleet/db-ca.pem",
    ):
        assert verified_database_url(fine) == fine


def _serving_process(host_dir: Path) -> tuple[int, str, int]:
    """The host's llama-server: its PID and the address and port it listens on (inside the host)."""
    pid = int(next(host_dir.rglob("llama-server.pid")).read_text())
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return pid, argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])


async def test_a_host_that_drips_or_floods_its_answers_holds_up_no_health_sweep(cloud, tmp_path):
    """The host's root swaps llama-server for a server with the host's own certificate that answers /health
    one byte (one TLS record) every half second, then one that floods it: each sweep ends with that host
    unhealthy: the drip cut off partway, the flood read up to fleet's cap and no further."""
    async with fleet_for(settings_for(tmp_path, rotation={"unhealthy_after_sweeps": 3})) as fleet:
        [host] = (await fleet.up(UpRequest("tiny", "eu"))).ready
        try:
            host_dir = cloud.info.state_dir / "hosts" / str(host.instance_id)
            pid, address, port = _serving_process(host_dir)
            os.kill(pid, signal.SIGKILL)
            key, cert = next(host_dir.rglob("tls.key")), next(host_dir.rglob("tls.pem"))
            for mode, said in (("drip", "no whole answer within"), ("flood", "ReplyTooLarge")):
                count = tmp_path / f"{mode}.count"
                argv = [sys.executable, "-m", "tests.dripper", mode, address, str(port), str(key), str(cert)]
                with subprocess.Popen([*argv, str(count)], stdout=subprocess.PIPE, text=True) as liar:
                    try:
                        assert liar.stdout is not None and liar.stdout.readline().strip() == "listening"
                        [report] = await rotation.health_sweep(fleet)
                        assert not report.healthy and said in report.reason, report
                        if mode == "drip":  # the sweep gave up with the answer partly sent
                            assert 0 < int(count.read_text()) < len(dripper.DRIP_ANSWER)
                    finally:
                        liar.kill()
        finally:
            await fleet.destroy(None)


async def test_a_host_whose_props_lie_is_held_to_its_slots_and_drains_no_honest_host(cloud, tmp_path):
    """The host's root restarts llama-server with four slots where fleet started one: /props says 4 and the
    host may even hold them. fleet benches it at the one slot it started, and sizing, which would have
    counted it at 4 and drained the honest host as surplus, keeps both."""
    async with fleet_for(settings_for(tmp_path)) as fleet:
        honest, liar = (await fleet.up(UpRequest("tiny", "eu", count=2))).ready
        lying: subprocess.Popen | None = None
        try:
            host_dir = cloud.info.state_dir / "hosts" / str(liar.instance_id)
            pid, address, port = _serving_process(host_dir)
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().rstrip("\0").split("\0")
            environ = dict(
                kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in kv
            )
            cwd = os.readlink(f"/proc/{pid}/cwd")
            os.kill(pid, signal.SIGKILL)
            # the port is free once the killed server has let go of it: its exit on a busy machine takes a while,
            # and a liar started before then may find the port taken and exit (a run beside a CPU hog: "the
            # lying server did not come up", its words lost)
            for _ in range(600):
                with socket.socket() as probe:
                    if probe.connect_ex((address, port)) != 0:
                        break
                await asyncio.sleep(0.1)
            argv[argv.index("-np") + 1], argv[argv.index("-c") + 1] = "4", "8192"
            log = tmp_path / "lying.log"
            with log.open("wb") as out:
                lying = subprocess.Popen(argv, cwd=cwd, env=environ, stdout=out, stderr=subprocess.STDOUT)
            async with fleet.server(liar).client(timeout=10) as client:
                for _ in range(600):
                    with contextlib.suppress(httpx.HTTPError):
                        if (await client.get("/props")).json().get("total_slots") == 4:
                            break
                    if lying.poll() is not None:
                        pytest.fail(f"the lying server exited {lying.returncode}: {log.read_text()[-600:]}")
                    await asyncio.sleep(0.1)
                else:
                    pytest.fail(f"the lying server did not come up: {log.read_text()[-600:]}")
            report = await fleet.bench(liar.name, max_callers=None, waves=1, warmup=0, max_tokens=8)
            assert max(level.callers for level in report.levels) == liar.slots == 1  # only what fleet started
            assert report.capacity.callers <= liar.slots
            sized = sizing.observe(fleet, Serve(model="tiny", region="eu", calls=2, headroom=0))
            assert sized.capacity == 2 and honest.name not in sized.drain and sized.drain == (), sized
        finally:
            if lying is not None:
                lying.kill()
                lying.wait()
            await fleet.destroy(None)


async def test_a_model_file_pinned_by_sha256_is_pulled_only_with_those_bytes(cloud, tmp_path):
    """The hub's etag proves the transfer; fleet.toml's sha256 proves the origin. A hub that states other
    bytes for the file fails the pull before a host downloads it, blaming no machine; the right pin serves."""
    settings = settings_for(tmp_path)
    [tiny_file] = settings.models["tiny"].files
    url = f"{cloud.url}/{tiny_file.repo}/resolve/{tiny_file.revision}/{tiny_file.file}"
    real = (await hubfile.resolve(url, "")).sha256
    for name, sha in (("tiny-pinned", real), ("tiny-otherbytes", "0" * 64)):
        settings = with_variant(settings, name, files=[tiny_file.model_copy(update={"sha256": sha})])
    async with fleet_for(settings) as fleet:
        try:
            refused = await fleet.up(UpRequest("tiny-otherbytes", "eu"))
            assert refused.ready == [] and len(refused.attempts) == 1, refused  # not tried on another machine
            assert f"with sha256 {real}, not the {'0' * 64} fleet.toml pins" in " ".join(refused.failures)
            assert fleet.record.blacklist() == []  # the hub's doing, not a machine's
            [pinned] = (await fleet.up(UpRequest("tiny-pinned", "eu"))).ready
            assert pinned.state == "ready"
        finally:
            await fleet.destroy(None)
    async with cloud.client() as api:
        assert await listed_instances(api) == []


async def test_a_host_is_replaced_before_its_certificate_ends(cloud, tmp_path):
    """A host with no known contract gets a certificate for 30 days; as its end nears (within
    rotation.contract_margin_hours) the sweep replaces it make-before-break, blaming no machine."""
    async with fleet_for(settings_for(tmp_path)) as fleet:
        [old] = (await fleet.up(UpRequest("tiny", "eu"))).ready
        try:
            assert old.certificate_until is not None
            signed = x509.load_pem_x509_certificate(next(cloud.info.state_dir.rglob("tls.pem")).read_bytes())
            assert abs(signed.not_valid_after_utc - old.certificate_until.replace(tzinfo=dt.UTC)) < dt.timedelta(
                seconds=1
            )
            fleet.record.update(old, certificate_until=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1))
            [report] = await rotation.health_sweep(fleet)
            assert report.healthy and "its certificate ends at" in report.reason and report.replaced_by, report
            [new] = fleet.record.hosts(names=[report.replaced_by])
            assert new.state == "ready" and new.certificate_until.replace(tzinfo=dt.UTC) > dt.datetime.now(
                dt.UTC
            ) + dt.timedelta(days=29)
            [gone] = fleet.record.hosts(names=[old.name])
            assert gone.state == "destroyed" and fleet.record.blacklist() == []
        finally:
            await fleet.destroy(None)


async def test_a_machine_without_the_installs_ca_makes_none_of_its_own(tmp_path):
    """The record names the CA its hosts trust once one is used: a machine without its key (a gateway's, a new
    state directory on the same record) may verify hosts with its ca.pem alone, and never makes a CA of its own
    that no client of the install would trust."""
    settings = settings_for(tmp_path)
    folder = tls_dir(settings)
    async with fleet_for(settings) as fleet:
        made = fleet.ca
        assert fleet.record.ca_sha256() == tls.public_key_sha256(made.certificate)
    (folder / "ca.key").rename(tmp_path / "ca.key.elsewhere")
    async with fleet_for(settings) as fleet:
        assert fleet.ca_file == folder / "ca.pem" and fleet.tls is not None  # verifying needs no key
        with pytest.raises(ConfigError, match="CA key is not on this machine"):
            assert fleet.ca is None
    assert not (folder / "ca.key").exists()  # none made
    tls.ensure_ca(folder, "fleet CA another")  # a CA of another install's, or made by hand
    async with fleet_for(settings) as fleet:
        with pytest.raises(ConfigError, match="is not the one this install's hosts trust"):
            assert fleet.ca is None
    (folder / "ca.key").unlink()
    async with fleet_for(settings) as fleet:
        with pytest.raises(ConfigError, match="is not the one this install's hosts trust"):
            assert fleet.tls is None


def test_up_says_the_accounts_environment_variables_reach_every_host_and_never_their_values(cloud, tmp_path):
    """Security round four: vast.ai puts the account's own environment variables into every container it rents,
    so a Hugging Face token kept there reaches every host whatever fleet keeps from them. `fleet up` names them
    (never their values) and says to keep no secret there."""
    value = "hf-not-a-real-token-" + os.urandom(6).hex()
    env = cli_env(cloud, tmp_path)
    key = cloud.info.api_key()
    headers = {"Authorization": f"Bearer {key}"}
    created = httpx.post(f"{cloud.info.url}/api/v0/secrets/", json={"key": "hf_token", "value": value}, headers=headers)
    assert created.status_code == 200 and created.json()["success"] is True
    try:
        up = subprocess.run(
            [sys.executable, "-m", "fleet.cli", "up", "--model", "tiny", "--region", "eu"],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert up.returncode == 0, up.stderr
        said = up.stdout + up.stderr
        assert "environment variables reach every host it rents (HF_TOKEN)" in said and value not in said
        # (tests/localcloud/test_localcloud_hosts.py shows the local cloud puts it in every container, as vast.ai does)
    finally:
        subprocess.run([sys.executable, "-m", "fleet.cli", "destroy", "--all", "--yes"], env=env, timeout=300)
        httpx.request("DELETE", f"{cloud.info.url}/api/v0/secrets/", json={"key": "HF_TOKEN"}, headers=headers)


@pytest.mark.parametrize(
    ("api_url", "refused"),
    [
        ("https://203.0.113.7:40123", True),  # the gateway's name, another port: a certificate names no port
        ("https://[2001:0db8:0:0::1]:9", True),  # the same IPv6 address, written otherwise
        ("https://198.51.100.9:8443", False),  # another address, the gateway's port
        ("https://127.0.0.1:40123", False),  # loopback: the local cloud's hosts, on this machine
    ],
)
async def test_no_host_certificate_names_an_address_of_the_gateways_on_any_port(tmp_path, api_url, refused):
    """Security round four: fleet's CA signed a host certificate for the gateway's own IP when the listing gave
    another port than the gateway's, and an agent's client accepted it for that IP."""
    from fleet.core.models import Host
    from fleet.host.certificate import refuse_held
    from fleet.host.phase import PhaseFailed

    settings = settings_for(tmp_path)
    gateway = settings.gateway.model_copy(update={"listen": "0.0.0.0", "names": ["203.0.113.7", "2001:db8::1"]})
    async with fleet_for(settings.model_copy(update={"gateway": gateway})) as fleet:
        host = Host(name="tiny-eu-new", model="tiny", region="eu")
        if refused:
            with pytest.raises(PhaseFailed, match="an address of the gateway's"):
                refuse_held(fleet, host, api_url)
        else:
            refuse_held(fleet, host, api_url)
