"""The strict local cloud behaves as vast.ai does at its hardest (docs/vast-fidelity.md has the sources):
rate limits, read lag, boot phases, heartbeat gaps, NAT'd ports, SSH as the platform gives it, keys and
money. Each test here is a row of that ledger, seen through the raw API."""

import asyncio
import json
import re
import time

import asyncssh
import httpx
import pytest

from tests.helpers import (
    SERVICE_PORT,
    cheapest_offer,
    destroy,
    listed_instances,
    mapped,
    polite,
    rent,
    shown,
    wait_status,
)


@pytest.fixture(autouse=True)
def clear_faults(cloud):
    cloud.set_faults({})
    yield
    cloud.set_faults({})


@pytest.fixture(scope="module")
async def offers(cloud) -> list[dict]:
    """The cheapest offers, one per machine, searched once: search is ten a minute per address, so these
    tests rent from one answer (each test destroys what it rents)."""
    async with cloud.client() as api:
        r = await polite(api, "POST", "/api/v0/bundles/", json={"order": [["dph_total", "asc"]], "limit": 200})
    by_machine: dict[int, dict] = {}
    for offer in r.json()["offers"]:
        by_machine.setdefault(offer["machine_id"], offer)
    return list(by_machine.values())


async def test_rate_limits_are_per_endpoint_intervals_with_vast_bodies(cloud, api):
    # show: 2 s between requests; a refused request restarts the interval; the body is {"detail": ...}
    first = await api.get("/api/v0/instances/1/")
    second = await api.get("/api/v0/instances/1/")
    assert first.status_code == 200 and second.status_code == 429
    assert second.json() == {"detail": "API requests too frequent endpoint threshold=2.0"}
    await asyncio.sleep(1.5)
    assert (await api.get("/api/v0/instances/1/")).status_code == 429  # 1.5 s after the refused one
    await asyncio.sleep(2.1)
    assert (await api.get("/api/v0/instances/1/")).status_code == 200
    # other endpoints keep their own clocks: the listing answers, then refuses with `detail` (its OpenAPI file)
    listing = await polite(api, "GET", "/api/v1/instances/")
    assert listing.status_code == 200
    refused = await api.get("/api/v1/instances/")
    assert refused.status_code == 429 and refused.json() == {
        "detail": "API requests too frequent endpoint threshold=1.0"
    }
    # its bad requests say `invalid_request` (`invalid_token` for a cursor), without `success`
    bad = await polite(
        api, "GET", "/api/v1/instances/", params={"select_filters": json.dumps({"dph_total": {"gt": 1}})}
    )
    assert bad.status_code == 400 and bad.json()["error"] == "invalid_request" and "success" not in bad.json()
    cursor = await polite(api, "GET", "/api/v1/instances/", params={"after_token": "not-a-token"})
    assert cursor.status_code == 400 and cursor.json()["error"] == "invalid_token"
    # destroy answers in the common error shape
    await polite(api, "DELETE", "/api/v0/instances/1/")
    refused = await api.delete("/api/v0/instances/1/")
    assert refused.status_code == 429
    assert refused.json()["error"] == "rate_limit_exceeded" and "threshold=3.0" in refused.json()["msg"]


async def test_some_429s_carry_a_fractional_retry_after_and_others_none(cloud, api):
    await polite(api, "GET", "/api/v0/users/current")
    answers = [await api.get("/api/v0/users/current") for _ in range(6)]
    assert [a.status_code for a in answers] == [429] * 6
    afters = [a.headers.get("Retry-After") for a in answers]
    assert None in afters and any(afters)
    for value in filter(None, afters):
        assert 0 < float(value) <= 1.1 and "." in value


async def test_create_has_a_penalty_for_coming_too_soon(cloud, api, offers):
    offer = offers[0]
    body = {"image": "x", "disk": 20, "label": "fleet:penalty"}
    created = await polite(api, "PUT", f"/api/v0/asks/{offer['id']}/", json=body)
    assert created.status_code == 200
    too_soon = await api.put(f"/api/v0/asks/{offer['id']}/", json=body)
    assert too_soon.status_code == 429 and too_soon.json() == {
        "detail": "API requests too frequent endpoint threshold=4.5"
    }
    await asyncio.sleep(5.0)  # past the 4.5 s interval, inside the 12 s penalty the refusal earned
    assert (await api.put(f"/api/v0/asks/{offer['id']}/", json=body)).status_code == 429
    await destroy(api, created.json()["new_contract"])


async def test_search_is_ten_a_minute_per_address_then_a_daily_quota(fresh_cloud):
    async with httpx.AsyncClient(base_url=fresh_cloud.url) as anonymous:
        codes = [(await anonymous.post("/api/v0/bundles/", json={"limit": 1})).status_code for _ in range(11)]
    assert codes[:10] == [200] * 10 and codes[10] == 429
    fresh_cloud.set_faults({"search_quota_left": 0})
    async with httpx.AsyncClient(base_url=fresh_cloud.url) as anonymous:
        spent = await anonymous.post("/api/v0/bundles/", json={"limit": 1})
    assert spent.status_code == 429 and spent.json()["error"] == "search_quota_exceeded"
    assert int(spent.headers["X-RateLimit-Reset"]) > time.time()


async def test_reads_lag_create_and_gone_reads_as_null_or_404(cloud, api, offers):
    ids = []
    try:
        for offer in offers[:2]:  # consecutive ids: one odd, one even, for both forms of "not there"
            ids.append(await rent(api, offer["id"], label="fleet:lag"))
            created = cloud.state()["instances"][str(ids[-1])]["created_at"]
            inside = 0  # reads sent inside the 3 s lag and answered (a 429, or a read sent late, proves nothing)
            while (sent := time.time()) - created < 2.5:
                one = await api.get(f"/api/v0/instances/{ids[-1]}/")
                listed = await api.get("/api/v1/instances/")
                if time.time() - created >= 3.0 or 429 in (one.status_code, listed.status_code):
                    continue
                # not yet visible: null or 404, as if gone
                assert one.status_code == 404 or one.json()["instances"] is None, (sent - created, one.text)
                assert ids[-1] not in {i["id"] for i in listed.json()["instances"]}, sent - created
                inside += 1
            assert inside > 0, "no read inside the lag was answered"
        assert {i % 2 for i in ids} == {0, 1}
        await asyncio.sleep(3.2 - (time.time() - cloud.state()["instances"][str(ids[-1])]["created_at"]))
        assert {i["id"] for i in await listed_instances(api)} >= set(ids)
        for instance_id in ids:
            assert (await shown(api, instance_id))["id"] == instance_id
    finally:
        for instance_id in ids:
            await destroy(api, instance_id)
    forms = []
    for instance_id in ids:
        r = await polite(api, "GET", f"/api/v0/instances/{instance_id}/")
        row = r.json()["instances"] if r.status_code == 200 else None
        forms.append("404" if r.status_code == 404 else "null" if row is None else row["actual_status"])
    # gone, each id in one of vast.ai's forms (its last row saying `destroyed` too, by the id: the first ids of a
    # fresh cloud take it), and the two in two different forms
    assert set(forms) <= {"404", "null", "destroyed"} and len(set(forms)) == 2, forms


async def test_boot_passes_scheduling_created_loading_with_messages(cloud, api, offers):
    instance_id = await rent(api, offers[0]["id"])
    try:
        await wait_status(api, instance_id, "running")
    finally:
        await destroy(api, instance_id)
    # every step as the cloud took it, from its log: sampling its state missed a 0.2 s step on a busy machine
    step = re.compile(rf"instance {instance_id} is (\S+): (.*)$")
    lines = (cloud.info.state_dir / "server.log").read_text().splitlines()
    seen = [(m[1], m[2]) for line in lines if (m := step.search(line))]
    statuses = [s for s, _ in seen]
    assert statuses[: statuses.index("running") + 1] == ["None", "scheduling", "created", "loading", "running"]
    assert all(msg != "None" for status, msg in seen if status != "None")


async def test_a_container_that_cannot_start_stays_created_saying_why(cloud, api, offers):
    offer = offers[0]
    cloud.set_faults({"oci_error": [offer["machine_id"]]})
    instance_id = await rent(api, offer["id"])
    try:
        await asyncio.sleep(4.0)
        for _ in range(2):
            row = await shown(api, instance_id)
            assert row["actual_status"] == "created" and "OCI runtime create failed" in row["status_msg"]
            await asyncio.sleep(2.1)
    finally:
        await destroy(api, instance_id)


async def test_a_late_heartbeat_reads_offline_then_running_again(cloud, api, offers):
    offer = offers[0]
    cloud.set_faults({"heartbeat_gap": {str(offer["machine_id"]): {"after_s": 6.0, "for_s": 6.0}}})
    instance_id = await rent(api, offer["id"])
    try:
        await wait_status(api, instance_id, "running")
        await wait_status(api, instance_id, "offline")
        await wait_status(api, instance_id, "running")
    finally:
        await destroy(api, instance_id)


async def test_ports_are_nat_mapped_and_an_identity_port_is_never_listed_as_such(cloud, api, ssh_keypair, offers):
    await polite(api, "POST", "/api/v0/ssh/", json={"ssh_key": ssh_keypair[1]})
    rows = {}
    for offer in offers[:2]:  # one odd and one even id: an identity port is listed under its number, or not at all
        onstart = 'echo "$VAST_TCP_PORT_70000" > identity-port; echo "$VAST_TCP_PORT_22" > ssh-port'
        env = {"-p 70000:70000": "1", f"-p {SERVICE_PORT}:{SERVICE_PORT}": "1"}
        instance_id = await rent(api, offer["id"], env=env, onstart=onstart)
        rows[instance_id] = await wait_status(api, instance_id, "running", timeout_s=30)
    try:
        for instance_id, row in rows.items():
            assert "70000/tcp" not in row["ports"]
            assert {"22/tcp", f"{SERVICE_PORT}/tcp"} <= set(row["ports"])
            extra = set(row["ports"]) - {"22/tcp", f"{SERVICE_PORT}/tcp"}
            async with await ssh_when_keys_arrive(row, ssh_keypair[0]) as conn:
                await wait_for_file(conn, "identity-port")
                identity = int((await conn.run("cat identity-port", check=True)).stdout)
                direct_22 = int((await conn.run("cat ssh-port", check=True)).stdout)
                # a process inside binds the identity port itself, on the host's own address
                await conn.run(
                    f'nohup python3 -m http.server {identity} --bind "$FLEET_LISTEN_HOST" >/dev/null 2>&1 &',
                    check=True,
                )
            assert direct_22 == mapped(row, 22)[1]
            assert extra == ({f"{identity}/tcp"} if instance_id % 2 == 0 else set())
            async with httpx.AsyncClient(timeout=5) as client:
                for _ in range(50):
                    try:
                        assert (await client.get(f"http://{row['public_ipaddr']}:{identity}/")).status_code == 200
                        break
                    except httpx.TransportError:
                        await asyncio.sleep(0.1)
                else:
                    raise AssertionError("the identity port never answered through the public address")
    finally:
        for instance_id in rows:
            await destroy(api, instance_id)


async def test_ssh_keys_arrive_after_running_and_interactive_logins_land_in_tmux(cloud, api, ssh_keypair, offers):
    await polite(api, "POST", "/api/v0/ssh/", json={"ssh_key": ssh_keypair[1]})
    instance_id = await rent(api, offers[0]["id"])
    try:
        deadline = time.monotonic() + 20
        while (state := cloud.state()["instances"][str(instance_id)])["status"] != "running":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        port = state["ports"]["22/tcp"]
        with pytest.raises(asyncssh.PermissionDenied):  # "if authentication fails, try again after a few seconds"
            await asyncssh.connect(
                "127.0.0.1", port=port, username="root", client_keys=[ssh_keypair[0]], known_hosts=None
            )
        row = await wait_status(api, instance_id, "running", timeout_s=30)
        async with await ssh_when_keys_arrive(row, ssh_keypair[0]) as conn:
            assert await interactive_tmux(conn) is True
            await conn.run("touch ~/.no_auto_tmux", check=True)
            assert await interactive_tmux(conn) is False
    finally:
        await destroy(api, instance_id)


async def test_account_keys_404_when_none_and_deleted_keys_never_reach_a_host(fresh_cloud, ssh_keypair, tmp_path):
    async with fresh_cloud.client() as api:
        assert (await api.get("/api/v0/ssh/")).status_code == 404  # an account that never had a key
        old = asyncssh.generate_private_key("ssh-ed25519")
        old.write_private_key(str(tmp_path / "old"))
        added = await polite(api, "POST", "/api/v0/ssh/", json={"ssh_key": old.export_public_key().decode()})
        await polite(api, "DELETE", f"/api/v0/ssh/{added.json()['key']['id']}/")
        await polite(api, "POST", "/api/v0/ssh/", json={"ssh_key": ssh_keypair[1]})
        keys = (await polite(api, "GET", "/api/v0/ssh/")).json()
        assert [bool(k["deleted_at"]) for k in keys] == [True, False]
        instance_id = await rent(api, (await cheapest_offer(api))["id"])
        try:
            row = await wait_status(api, instance_id, "running", timeout_s=30)
            async with await ssh_when_keys_arrive(row, ssh_keypair[0]) as conn:
                assert (await conn.run("echo ok", check=True)).stdout.strip() == "ok"
            host, port = mapped(row, 22)
            with pytest.raises(asyncssh.PermissionDenied):
                await asyncssh.connect(
                    host, port=port, username="root", client_keys=[str(tmp_path / "old")], known_hosts=None
                )
        finally:
            await destroy(api, instance_id)


async def test_money_an_instance_may_cost_other_than_its_offer_and_an_error_may_hide_a_contract(cloud, api, offers):
    offer, second = offers[:2]
    cloud.set_faults({"reprice_at_create": {str(offer["id"]): 1.25}})
    repriced = await rent(api, offer["id"], disk=10)
    cloud.set_faults({"create_error_with_contract": 1})
    answer = await polite(
        api, "PUT", f"/api/v0/asks/{second['id']}/", json={"image": "x", "disk": 10, "label": "fleet:hidden"}
    )
    body = answer.json()
    try:
        assert answer.status_code == 200 and body["success"] is False and body["new_contract"]
        await asyncio.sleep(3.2)
        row = await shown(api, repriced)
        assert row["dph_total"] > offer["dph_total"] * 1.1
        hidden = await shown(api, body["new_contract"])
        assert hidden is not None and hidden["label"] == "fleet:hidden"  # the error made a contract all the same
    finally:
        await destroy(api, repriced)
        if body.get("new_contract"):
            await destroy(api, body["new_contract"])


async def ssh_when_keys_arrive(row: dict, key) -> asyncssh.SSHClientConnection:
    host, port = mapped(row, 22)
    deadline = time.monotonic() + 15
    while True:
        try:
            return await asyncssh.connect(host, port=port, username="root", client_keys=[str(key)], known_hosts=None)
        except asyncssh.PermissionDenied:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


async def wait_for_file(conn: asyncssh.SSHClientConnection, path: str) -> None:
    for _ in range(100):
        if (await conn.run(f"test -s {path}")).exit_status == 0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{path} never appeared")


async def interactive_tmux(conn: asyncssh.SSHClientConnection) -> bool:
    """Open an interactive login (a PTY, no command) and ask whether it runs inside tmux. A busy machine may
    start tmux after the question was typed, and the question is lost: it is asked again until answered."""
    process = await conn.create_process(term_type="xterm", term_size=(120, 40))
    question = 'echo "TMUX=[${TMUX:+yes}]"\n'  # the terminal echoes this line as typed, too
    output = ""
    try:
        for _ in range(6):
            process.stdin.write(question)
            try:
                async with asyncio.timeout(5):
                    while not (answer := re.search(r"TMUX=\[(yes)?\]", output)):
                        more = await process.stdout.read(4096)
                        if not more:  # the session ended: ask no more
                            raise AssertionError(f"the login ended before it answered: {output!r}")
                        output += more
                break
            except TimeoutError:
                continue
        else:
            raise AssertionError(f"no answer from the login: {output!r}")
        process.stdin.write("exit\n")
    finally:
        process.close()
    return answer.group(1) == "yes"
