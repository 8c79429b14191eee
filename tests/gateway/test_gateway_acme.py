"""The agents' door with a certificate every client already trusts (issue 36, item 1): fleet's gateway asks an
ACME CA for its domain with certbot over HTTP-01, for real, against Pebble (Let's Encrypt's test ACME server,
Debian's package) with its mock DNS answering the domain with this machine; HAProxy starts on a provisional
certificate and takes the ACME one in place; an agent then verifies the gateway with the ACME CA's root alone,
by the domain's name, and talks through it. A CA that refuses leaves a one-line error and no gateway."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from cryptography import x509

from fleet.control import gateway
from fleet.control.up import UpRequest
from fleet.core import tls
from fleet.core.config import Serve
from fleet.core.gatewayrecord import revoke_agent_key
from fleet.gateway import acme, process
from fleet.gateway.files import files_for
from fleet.gateway.runtime import Runtime
from tests.fleetkit import fleet_for, settings_for
from tests.gateway.test_gateway import free_port, wait_hosts_up

DOMAIN = "voice.fleet.test"


@dataclass
class Pebble:
    directory: str  # the ACME directory's URL
    ca_file: Path  # what Pebble's own HTTPS is signed by
    http_port: int  # where Pebble checks an HTTP-01 challenge (the gateway's acme.http_port)
    management: int

    def root(self) -> bytes:
        """The root Pebble signs every certificate under (it makes a new one at each start)."""
        verify = ssl.create_default_context(cafile=str(self.ca_file))
        return httpx.get(f"https://127.0.0.1:{self.management}/roots/0", verify=verify).content


def wait_port(port: int, process: subprocess.Popen, what: str) -> None:
    for _ in range(200):
        assert process.poll() is None, (
            f"{what} exited: {process.stdout.read().decode()[-500:] if process.stdout else ''}"
        )
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"{what} never listened on {port}")


@pytest.fixture(scope="module")
def pebble(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pebble]:
    """Pebble, and pebble-challtestsrv answering every name with 127.0.0.1 (its DNS alone), each stopped by its
    own process group."""
    folder = tmp_path_factory.mktemp("pebble")
    ca = tls.ensure_ca(folder / "ca", "pebble's own TLS")
    key, certificate = tls.sign_server(ca, ["127.0.0.1", "localhost"], 2)
    (folder / "key.pem").write_bytes(key)
    (folder / "cert.pem").write_bytes(certificate)
    ports = {name: free_port() for name in ("acme", "management", "http", "tls", "dns", "dns_management")}
    config = {
        "pebble": {
            "listenAddress": f"127.0.0.1:{ports['acme']}",
            "managementListenAddress": f"127.0.0.1:{ports['management']}",
            "certificate": str(folder / "cert.pem"),
            "privateKey": str(folder / "key.pem"),
            "httpPort": ports["http"],
            "tlsPort": ports["tls"],
            "ocspResponderURL": "",
            "externalAccountBindingRequired": False,
        }
    }
    (folder / "pebble.json").write_text(json.dumps(config))
    env = {**os.environ, "PEBBLE_VA_NOSLEEP": "1", "PEBBLE_WFE_NONCEREJECT": "0", "PEBBLE_AUTHZREUSE": "0"}
    started = []
    try:
        dns = subprocess.Popen(
            ["pebble-challtestsrv", "-defaultIPv4", "127.0.0.1", "-defaultIPv6", "",
             "-dns01", f"127.0.0.1:{ports['dns']}", "-http01", "", "-https01", "", "-tlsalpn01", "",
             "-management", f"127.0.0.1:{ports['dns_management']}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        started.append(dns)
        wait_port(ports["dns_management"], dns, "pebble-challtestsrv")
        server = subprocess.Popen(
            ["pebble", "-config", str(folder / "pebble.json"), "-dnsserver", f"127.0.0.1:{ports['dns']}"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        started.append(server)
        wait_port(ports["acme"], server, "pebble")
        yield Pebble(f"https://127.0.0.1:{ports['acme']}/dir", ca.certificate_path, ports["http"], ports["management"])
    finally:
        for process in started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(10)


async def turn_by_domain(root: Path, port: int, key: str) -> httpx.Response:
    """One turn through the gateway as an agent that trusts the ACME CA's root alone and names the domain."""
    verify = ssl.create_default_context(cafile=str(root))
    async with httpx.AsyncClient(verify=verify, timeout=30) as client:
        return await client.post(
            f"https://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            headers={"Authorization": f"Bearer {key}"},
            extensions={"sni_hostname": DOMAIN},
        )


def acme_settings(base: Path, pebble: Pebble, **acme_keys):
    settings = settings_for(base)
    values = {
        "directory": str(base / "gw"),
        "port": free_port(),
        "metrics_port": 0,
        "acme": {
            "domain": DOMAIN,
            "directory": pebble.directory,
            "ca_file": str(pebble.ca_file),
            "http_port": pebble.http_port,
            **acme_keys,
        },
    }
    return settings.model_copy(
        update={
            "serve": [Serve(model="tiny", region="eu")],
            "gateway": settings.gateway.model_validate({**settings.gateway.model_dump(), **values}),
        }
    )


async def test_the_gateway_gets_its_domains_certificate_by_acme_and_agents_need_no_private_ca(
    cloud, local_cloud_env, pebble, tmp_path
):
    settings = acme_settings(tmp_path, pebble)
    async with fleet_for(settings) as fleet:
        try:
            assert len((await fleet.up(UpRequest("tiny", "eu"))).ready) == 1
            await gateway.start(fleet)
            key = await gateway.add_key(fleet, "voice")
            await wait_hosts_up(fleet, count=1)
            files = files_for(settings)
            served = x509.load_pem_x509_certificate(files.pem.read_bytes())
            names = served.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            assert names.get_values_for_type(x509.DNSName) == [DOMAIN]
            assert served.issuer != fleet.ca.certificate.subject  # the ACME CA's, not fleet's
            assert oct((acme.folder(files)).stat().st_mode & 0o777) == "0o700"  # the ACME account's key is there
            # an agent that trusts the ACME CA's root alone (here Pebble's, a public CA's on vast.ai) and names
            # the domain: verified, and served through
            (tmp_path / "root.pem").write_bytes(pebble.root())
            port = settings.serve[0].port or settings.gateway.port
            reply = await turn_by_domain(tmp_path / "root.pem", port, key)
            assert reply.status_code == 200, reply.text
            # fleet's CA vouches for nothing at the agents' door any more
            with (
                pytest.raises(ssl.SSLCertVerificationError),
                socket.create_connection(("127.0.0.1", port), timeout=10) as tcp,
            ):
                fleet.tls.wrap_socket(tcp, server_hostname=DOMAIN).close()
            assert await gateway.renew(fleet) == []  # a fresh certificate: nothing to renew
            # what fleet tells a user: the URL by the domain the certificate names, and no CA file to hand out
            shown = await gateway.status(fleet)
            assert shown["targets"][0]["base_url"] == f"https://{DOMAIN}:{port}/v1"
            assert (shown["signed_by"], shown["ca_file"]) == ("acme", None)
            # the issuance is over: the challenge it answered is answered no more
            async with httpx.AsyncClient(timeout=10) as plain:
                answered = await plain.get(f"http://127.0.0.1:{pebble.http_port}/.well-known/acme-challenge/x")
            assert answered.status_code == 404 and not (await acme_entries(files))
        finally:
            await gateway.stop(fleet)
            await fleet.destroy(None)


async def acme_entries(files) -> list[str]:
    return [line for line in (await Runtime(files.socket).run(f"show map {files.acme_map}"))[0].splitlines() if line]


async def test_only_fleets_issuance_answers_an_acme_challenge(pebble, tmp_path):
    """Security round four: HAProxy handed every challenge to a loopback port that was free whenever certbot was
    not running, and a local user who listened there answered the CA and got a certificate for the domain.
    HAProxy now answers a challenge from its own memory, which fleet's issuance alone fills over the admin
    socket: a listener on any port is never asked, and a token nobody put there is not found."""
    settings = acme_settings(tmp_path, pebble)
    files = files_for(settings)
    rogue = socket.socket()
    rogue.bind(("127.0.0.1", 8402))  # the port challenges went to (certbot's), held by someone else
    rogue.listen()
    rogue.settimeout(0.1)
    try:
        async with fleet_for(settings) as fleet:
            try:
                await gateway.start(fleet)  # issued through the map: the rogue listener was never asked
                with pytest.raises(TimeoutError):
                    rogue.accept()
                url = f"http://127.0.0.1:{pebble.http_port}/.well-known/acme-challenge"
                async with httpx.AsyncClient(timeout=10) as plain:
                    assert (await plain.get(f"{url}/someone-elses-token")).status_code == 404
                    # an agent that found this port is told where agents go, not that /v1/models is served here
                    lost = await plain.get(f"http://127.0.0.1:{pebble.http_port}/v1/models")
                    assert lost.status_code == 404 and "ACME CA alone" in lost.json()["error"]["message"]
                    # what certbot's hook puts there (fleet's user alone reaches the socket) is what is answered
                    env = {"CERTBOT_TOKEN": "tok_EN-1", "CERTBOT_VALIDATION": "tok_EN-1.thumb", "FLEET_ACME_MAP":
                           str(files.acme_map), "FLEET_ACME_SOCKET": str(files.socket)}  # fmt: skip
                    hook = [sys.executable, "-m", "fleet.gateway.acmehook"]
                    assert subprocess.run([*hook, "add"], env={**os.environ, **env}).returncode == 0
                    answered = await plain.get(f"{url}/tok_EN-1")
                    assert (answered.status_code, answered.text) == (200, "tok_EN-1.thumb")
                    assert subprocess.run([*hook, "del"], env={**os.environ, **env}).returncode == 0
                    assert (await plain.get(f"{url}/tok_EN-1")).status_code == 404
                    # a hook handed what no ACME CA sends puts nothing on the socket
                    bad = {**env, "CERTBOT_TOKEN": "x y", "CERTBOT_VALIDATION": "x y.z"}
                    refused = subprocess.run([*hook, "add"], env={**os.environ, **bad}, capture_output=True, text=True)
                    assert refused.returncode == 2 and "not an ACME token" in refused.stderr
                    assert not await acme_entries(files)
            finally:
                await gateway.stop(fleet)
    finally:
        rogue.close()


async def test_an_acme_ca_that_refuses_says_why_in_one_line_and_leaves_no_gateway(pebble, tmp_path):
    """An ACME directory that does not answer as one (a wrong URL): the start fails with certbot's words, and
    nothing is left running."""
    settings = acme_settings(tmp_path, pebble, directory=pebble.directory.replace("/dir", "/no-such-directory"))
    async with fleet_for(settings) as fleet:
        with pytest.raises(acme.AcmeError, match=f"no certificate for {DOMAIN}") as refused:
            await gateway.start(fleet)
        assert "\n" not in str(refused.value)
    assert process.running_pid(files_for(settings)) is None


async def test_a_refused_renewal_holds_back_no_revocation_and_waits_out_a_backoff(pebble, tmp_path):
    """Security round four: the daemon's beat renewed before it applied the record, so a renewal the CA refused
    skipped the apply: a key revoked elsewhere went on working for three beats, and certbot ran with
    --force-renewal at every beat (an ACME CA limits failed validations). The record is applied first; a refused
    renewal is asked again only after a backoff."""
    settings = acme_settings(tmp_path, pebble)
    async with fleet_for(settings) as fleet:
        try:
            await gateway.start(fleet)
            key = await gateway.add_key(fleet, "voice")
            (tmp_path / "root.pem").write_bytes(pebble.root())

            async def answer() -> int:
                return (await turn_by_domain(tmp_path / "root.pem", settings.gateway.port, key)).status_code

            assert await answer() == 503  # the key is good; no host serves yet
            # the renewal is due (another name) and the CA refuses it (no ACME directory there)
            refusing = settings.gateway.acme.model_copy(
                update={"domain": "other." + DOMAIN, "directory": pebble.directory.replace("/dir", "/gone")}
            )
            fleet.settings = settings.model_copy(
                update={"gateway": settings.gateway.model_copy(update={"acme": refusing})}
            )
            assert revoke_agent_key(fleet.record, "voice") == 1  # revoked by another machine's fleet
            await gateway.keep(fleet)  # the daemon's beat: no error past it
            assert await answer() == 401  # the revocation was applied all the same
            failures = acme.folder(files_for(settings)) / "failures"
            count, next_try = failures.read_text().split()
            assert count == "1" and float(next_try) > time.time() + acme.FIRST_RETRY_S - 5
            await gateway.keep(fleet)  # within the backoff: the CA is not asked again
            assert failures.read_text().split()[0] == "1"
        finally:
            await gateway.stop(fleet)
