"""Two gateway instances on one PostgreSQL record (issue 22, item 9): every call's host agrees, whichever
instance a turn reaches. The record gives each host the same slot in both; HAProxy's peers carry the stick
tables between the instances, over TLS with fleet's certificates."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import shutil
import socket
import ssl
import threading
from pathlib import Path

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fleet.control import gateway
from fleet.control.up import UpRequest
from fleet.core import config, tls
from fleet.core.config import Serve
from fleet.gateway.files import files_for
from fleet.gateway.runtime import Runtime
from tests.fleetkit import fleet_for, settings_for, write_config
from tests.gateway.test_gateway import free_port, served_by_host, wait_hosts_up
from tests.gateway.test_gateway_input import fleet_cli

CHAT = "/v1/chat/completions"


def instance(base, postgres_url: str, name: str, ports: dict[str, int], peer_ports: dict[str, int]):
    settings = settings_for(base)
    peers = [f"{n}=127.0.0.1:{p}" for n, p in sorted(peer_ports.items())]
    return settings.model_copy(
        update={
            "database": settings.database.model_copy(update={"url": postgres_url}),
            "serve": [Serve(model="tiny", region="eu")],
            "gateway": settings.gateway.model_copy(
                update={
                    "directory": str(base / f"gw-{name}"),
                    "port": ports[name],
                    "metrics_port": 0,
                    "peers": peers,
                    "peer_name": name,
                }
            ),
        }
    )


async def test_two_gateways_on_one_record_agree_on_every_calls_host(cloud, local_cloud_env, postgres_url, tmp_path):
    ports = {"a": free_port(), "b": free_port()}
    peer_ports = {"a": free_port(), "b": free_port()}
    settings_a = instance(tmp_path, postgres_url, "a", ports, peer_ports)
    settings_b = instance(tmp_path, postgres_url, "b", ports, peer_ports)
    async with fleet_for(settings_a) as a, fleet_for(settings_b) as b:
        try:
            assert len((await a.up(UpRequest(model="tiny", region="eu", count=2))).ready) == 2
            await gateway.start(a)
            await gateway.start(b)
            key = await gateway.add_key(a, "agent")
            await gateway.apply(b)  # what b's daemon does on its next beat
            await wait_hosts_up(a)
            await wait_hosts_up(b)
            table_a = Runtime(files_for(settings_a).socket)
            table_b = Runtime(files_for(settings_b).socket)
            calls = [f"call-{i}" for i in range(6)]
            keys = {c: f"agent/{c}" for c in calls}  # the stick table's key: the call is its agent's
            clients = {
                n: httpx.AsyncClient(
                    base_url=f"https://localhost:{ports[n]}", verify=a.tls, headers={"Authorization": f"Bearer {key}"}
                )
                for n in ("a", "b")
            }
            try:
                for call in calls:  # each call's first turn reaches a, three of them at once
                    reply = await clients["a"].post(CHAT, json=first_turn(call), headers={"X-Session-Id": call})
                    assert reply.status_code == 200
                placed = await table_a.table("calls_t0")
                assert {placed[keys[c]]["server_key"] for c in calls} == {"s0", "s1"}
                for _ in range(200):  # the peers carry a's table to b
                    seen = await table_b.table("calls_t0")
                    if all(keys[c] in seen for c in calls):
                        break
                    await asyncio.sleep(0.05)
                assert {c: seen[keys[c]]["server_key"] for c in calls} == {
                    c: placed[keys[c]]["server_key"] for c in calls
                }
                before = await served_by_host(b)
                for call in calls:  # every later turn reaches b: the same host
                    reply = await clients["b"].post(CHAT, json=first_turn(call), headers={"X-Session-Id": call})
                    assert reply.status_code == 200
                after_b = await table_b.table("calls_t0")
                assert {c: after_b[keys[c]]["server_key"] for c in calls} == {
                    c: placed[keys[c]]["server_key"] for c in calls
                }
                moved = await served_by_host(b)
                per_slot = {h["slot"]: h["served"] for h in (await gateway.status(b))["targets"][0]["hosts"]}
                expected = {
                    int(s[1:]): sum(1 for c in calls if placed[keys[c]]["server_key"] == s) for s in ("s0", "s1")
                }
                assert sum(moved.values()) - sum(before.values()) == len(calls)
                assert {slot: per_slot[slot] for slot in expected} == expected
                # a key revoked through a is refused by b within moments, before any sync of b's: the peers
                # carry the revocation
                await gateway.revoke_key(a, "agent")
                answers = []
                for _ in range(100):
                    answers.append((await clients["b"].post(CHAT, json=first_turn("after"))).status_code)
                    if answers[-1] == 401:
                        break
                    await asyncio.sleep(0.05)
                assert answers[-1] == 401, answers
            finally:
                for c in clients.values():
                    await c.aclose()
        finally:
            await gateway.stop(a)
            await gateway.stop(b)
            await a.destroy(None)


def first_turn(call: str) -> dict:
    return {"messages": [{"role": "user", "content": f"{call}: hello"}], "max_tokens": 4}


class FakePeer:
    """A TLS server where a peer of the gateway should be, with the certificate it is given: it counts the
    handshakes the gateway finished with it and those it broke off."""

    def __init__(self, port: int, key_pem: bytes, cert_pem: bytes, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "key.pem").write_bytes(key_pem)
        (folder / "cert.pem").write_bytes(cert_pem)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(folder / "cert.pem", folder / "key.pem")
        self.listener = socket.create_server(("127.0.0.1", port))
        self.listener.settimeout(0.2)
        self.finished = self.broken = 0
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(5)
            try:
                with self.context.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(1)  # the gateway says its hello once it trusts this side
                    self.finished += 1
            except (ssl.SSLError, OSError):
                self.broken += 1

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        self.listener.close()


def host_certificate(ca: tls.CertificateAuthority, name: str) -> tuple[bytes, bytes]:
    """What a host of fleet's holds: a key it made and fleet's certificate for its address and name."""
    key = ec.generate_private_key(ec.SECP256R1())
    request = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([])).sign(key, hashes.SHA256())
    pem = tls.sign_host(
        ca, request.public_bytes(serialization.Encoding.PEM), "127.0.0.1", name,
        dt.datetime.now(dt.UTC) + dt.timedelta(days=1),
    )  # fmt: skip
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ), pem


def dial_peers_door(port: int, ca: tls.CertificateAuthority, key_pem: bytes, cert_pem: bytes, folder: Path) -> str:
    """Connect to a gateway's peers' door as a client holding `cert_pem` (TLS 1.2: the door's verdict on the
    client's certificate is part of the handshake): "accepted" or why not."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "key.pem").write_bytes(key_pem)
    (folder / "cert.pem").write_bytes(cert_pem)
    context = tls.client_context(ca.certificate_path)
    context.check_hostname = False
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(folder / "cert.pem", folder / "key.pem")
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as tcp, context.wrap_socket(tcp):
            return "accepted"
    except (ssl.SSLError, OSError) as e:
        return type(e).__name__


async def test_a_peer_is_reached_only_as_itself_and_no_hosts_certificate_passes_for_a_peer(tmp_path):
    """A host holds a certificate of fleet's CA: it neither connects to a gateway's peers' door nor, where a
    peer should be, gets the gateway's handshake (and with it the calls' stick table); another gateway's own
    peer certificate does both."""
    ports = {"a": free_port(), "b": free_port()}
    settings = settings_for(tmp_path)
    settings = settings.model_copy(
        update={
            "serve": [Serve(model="tiny", region="eu")],
            "gateway": settings.gateway.model_copy(
                update={
                    "directory": str(tmp_path / "gw-a"),
                    "port": free_port(),
                    "metrics_port": 0,
                    "peers": [f"{n}=127.0.0.1:{p}" for n, p in sorted(ports.items())],
                    "peer_name": "a",
                }
            ),
        }
    )
    async with fleet_for(settings) as fleet:
        ca = fleet.ca
        as_host = host_certificate(ca, "b")  # even one named like the peer, in the hosts' domain
        as_peer = tls.sign_peer(ca, "b", 1)
        as_other_peer = tls.sign_peer(ca, "c", 1)
        await gateway.start(fleet)
        try:
            door = {
                "a host": dial_peers_door(ports["a"], ca, *as_host, tmp_path / "dial-host"),
                "a peer": dial_peers_door(ports["a"], ca, *as_peer, tmp_path / "dial-peer"),
            }
            assert door["a host"] != "accepted" and door["a peer"] == "accepted", door
            seen = {}
            for case, (key, cert) in {"a host": as_host, "another peer": as_other_peer, "the peer": as_peer}.items():
                fake = FakePeer(ports["b"], key, cert, tmp_path / case.replace(" ", "-"))
                try:
                    # HAProxy dials its peers again every few seconds: wait for its first try, however long
                    for _ in range(600):
                        if fake.finished or fake.broken:
                            break
                        await asyncio.sleep(0.05)
                finally:
                    fake.close()
                seen[case] = (fake.finished, fake.broken)
            assert seen["a host"][0] == 0 and seen["a host"][1] > 0, seen
            assert seen["another peer"][0] == 0 and seen["another peer"][1] > 0, seen
            assert seen["the peer"][0] > 0, seen
        finally:
            await gateway.stop(fleet)


async def test_a_gateway_machine_runs_with_the_cas_certificate_alone(postgres_url, tmp_path):
    """Where the CA key is, `fleet gateway peer-certificate` signs a peer's certificate; the gateway's machine,
    given it, its own agents' certificate and ca.pem, starts its gateway with no CA key and makes none."""
    ca_machine = settings_for(tmp_path / "ca-machine").model_copy(
        update={"database": config.Database(path=str(tmp_path / "ca-machine" / "fleet.db"), url=postgres_url)}
    )
    async with fleet_for(ca_machine) as fleet:
        ca = fleet.ca  # made there, and named in the record
    config_path = write_config(tmp_path / "ca-machine")
    env = {"FLEET_DATABASE_URL": postgres_url}
    out = tmp_path / "made"
    made = fleet_cli(config_path, "gateway", "peer-certificate", "b", "--out", str(out), "--json", env=env)
    assert made.returncode == 0, made.stderr
    files = json.loads(made.stdout)
    assert oct(Path(files["key_file"]).stat().st_mode & 0o777) == "0o600"
    for bad, says in ((["b;rm", "--out", str(out)], "a peer's name"), (["b", "--out", str(out)], "exists")):
        refused = fleet_cli(config_path, "gateway", "peer-certificate", *bad, "--json", env=env)
        assert refused.returncode == 2 and says in json.loads(refused.stdout)["error"], refused.stdout
    # the gateway's machine: the record, ca.pem, the agents' certificate of its own, the peer's from above
    folder = tmp_path / "gw-machine"
    (folder / "tls").mkdir(parents=True)
    shutil.copy(ca.certificate_path, folder / "tls" / "ca.pem")
    agents_key, agents_certificate = tls.sign_server(ca, ["localhost", "127.0.0.1"], 30)  # the team's own, say
    (folder / "agents.pem").write_bytes(agents_certificate)
    (folder / "agents.key").write_bytes(agents_key)
    base = settings_for(folder)
    gateway_machine = base.model_copy(
        update={
            "database": config.Database(path=str(folder / "fleet.db"), url=postgres_url),
            "serve": [Serve(model="tiny", region="eu")],
            "gateway": base.gateway.model_copy(
                update={
                    "directory": str(folder / "gw"),
                    "port": free_port(),
                    "metrics_port": 0,
                    "certificate_file": str(folder / "agents.pem"),
                    "key_file": str(folder / "agents.key"),
                    "peers": [f"a=127.0.0.1:{free_port()}", f"b=127.0.0.1:{free_port()}"],
                    "peer_name": "b",
                    "peer_certificate_file": files["certificate_file"],
                    "peer_key_file": files["key_file"],
                }
            ),
        }
    )
    async with fleet_for(gateway_machine) as fleet:
        try:
            status = await gateway.start(fleet)
            assert status["running"]
        finally:
            await gateway.stop(fleet)
    assert not (folder / "tls" / "ca.key").exists()
