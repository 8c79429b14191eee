"""The disk holds the image (issue 46 item 4): vast.ai's allocation holds an instance's Docker image as well as what
it writes, and cannot grow after create. The local cloud holds each host to its allocation less its image (an ext4
filesystem in a sparse file, loop-mounted on the host's home), so a write past it fails with "No space left on
device"; an image larger than the disk never starts. fleet blames no machine for a disk that filled, and stops a
bring-up once two machines' disks filled alike (one machine's word alone never stops it)."""

from pathlib import Path

import asyncssh
import pytest

from fleet.control.up import UpRequest
from fleet.localcloud import disks
from tests.fleetkit import fleet_for, settings_for
from tests.helpers import cheapest_offer, destroy, mapped, rent, wait_status


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env):
    yield


def mounts_under(directory: Path) -> list[str]:
    return [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
            if line.split()[1].startswith(str(directory))]  # fmt: skip


async def test_a_host_writes_into_its_allocation_less_the_image_and_no_further(cloud, api, ssh_keypair):
    assert disks.holdable(), "this machine cannot loop-mount: the local cloud holds no disk allocation here"
    await api.post("/api/v0/ssh/", json={"ssh_key": ssh_keypair[1]})
    offer = await cheapest_offer(api)
    image = "fleet/small-disk:test"
    room = 2_000_000
    cloud.set_faults({"image_sizes": {image: 8_000_000_000 - room}})
    try:
        instance_id = await rent(api, offer["id"], image=image, disk=8)
        row = await wait_status(api, instance_id, "running", timeout_s=60)
        assert row is not None, "the instance never ran"
        host, port = mapped(row, 22)
        async with asyncssh.connect(
            host, port=port, username="root", client_keys=[ssh_keypair[0]], known_hosts=None
        ) as conn:
            size = int((await conn.run("df -B1 --output=size ~ | tail -n 1", check=True)).stdout)
            assert room * 0.9 < size <= room
            wrote = await conn.run(f"head -c {room // 2} /dev/zero > half && echo ok")
            assert wrote.stdout.strip() == "ok"
            past = await conn.run(f"head -c {room} /dev/zero > more")
            assert past.exit_status != 0 and "No space left on device" in str(past.stderr)
        home = cloud.info.state_dir / "hosts" / str(instance_id)
        assert mounts_under(home) == [str(home / "root")]
        await destroy(api, instance_id)
        assert mounts_under(home) == [] and not home.exists()  # the destroy let go of the disk, and removed it
    finally:
        cloud.set_faults({})


async def test_weights_that_overflow_the_disk_blame_no_machine_and_two_machines_stop_the_bring_up(cloud, tmp_path):
    settings = settings_for(tmp_path)
    disk = settings.models["tiny"].disk_gb  # the image leaves less room than the tiny model's 488 kB
    cloud.set_faults({"image_sizes": {settings.provider.image: int(disk * 1e9) - 400_000}})
    try:
        async with fleet_for(settings) as fleet:
            result = await fleet.up(UpRequest("tiny", "eu"))
            assert result.ready == []
            assert [a.phase for a in result.attempts] == ["pull", "pull"], result.attempts
            assert all("no space left on device" in a.reason for a in result.attempts)
            assert len({a.machine_id for a in result.attempts}) == 2
            assert fleet.record.blacklist() == []
            assert all(h.destroyed_at is not None for h in fleet.record.hosts())
    finally:
        cloud.set_faults({})


async def test_an_image_larger_than_the_disk_never_starts_and_blames_no_machine(cloud, tmp_path):
    settings = settings_for(tmp_path)
    disk = settings.models["tiny"].disk_gb
    cloud.set_faults({"image_sizes": {settings.provider.image: int(disk * 1e9)}})
    try:
        async with fleet_for(settings) as fleet:
            result = await fleet.up(UpRequest("tiny", "eu"))
            assert result.ready == [] and [a.phase for a in result.attempts] == ["boot", "boot"], result.attempts
            assert all("does not hold the image" in a.reason for a in result.attempts)
            assert fleet.record.blacklist() == []
            assert all(h.pulled_at is None and h.destroyed_at is not None for h in fleet.record.hosts())
    finally:
        cloud.set_faults({})
