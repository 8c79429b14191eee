"""An image rented by its tag proves itself (issue 46 item 2): vast.ai may resolve a digest reference as a tag of
its own, and a machine may boot its stale copy of a tag. Each host shows the manifest its image's build wrote
(`fleet-image-proof`), which must hash to `provider.image_proof`, with every program it names unchanged, before
fleet pays for a pull."""

import hashlib
import subprocess
from pathlib import Path

import pytest

from fleet.control.up import UpRequest
from fleet.localcloud import toolchain
from fleet.localcloud.hosts import LocalHost
from tests.fleetkit import first_machine, fleet_for, settings_for


@pytest.fixture(autouse=True)
def _local_cloud(local_cloud_env):
    yield


def laid_out(directory: Path, llama_server: Path) -> LocalHost:
    """A host's folder as the local cloud lays one out for fleet's llama-server image."""
    host = LocalHost(directory=directory, token="proof", private_ip="127.0.0.1", ssh_port=0, llama_server=llama_server)
    host.prepare()
    return host


def proof_of(host: LocalHost) -> str:
    return "sha256:" + hashlib.sha256(host.manifest.read_bytes()).hexdigest()


def prove(host: LocalHost) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(host.bin_dir / "fleet-image-proof")], capture_output=True, text=True, timeout=60)


def test_the_manifest_names_every_program_and_the_proof_finds_a_changed_one(tmp_path, llama_server):
    host = laid_out(tmp_path / "host", llama_server)
    names = [line.split("  ", 1)[1] for line in host.manifest.read_text().splitlines()]
    scripts = sorted(p.name for p in (toolchain.REPO_ROOT / "images" / "llama-server" / "host").iterdir())
    assert names == sorted(["llama-server", *scripts])
    shown = prove(host)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == host.manifest.read_text()  # what fleet hashes is the manifest, byte for byte
    # the same programs give the same manifest in another folder: the pin does not depend on where they live
    assert proof_of(laid_out(tmp_path / "elsewhere", llama_server)) == proof_of(host)
    serve = host.bin_dir / "fleet-serve"
    text = serve.read_text()
    serve.unlink()
    serve.write_text(text + "# changed after the build\n")
    serve.chmod(0o755)
    changed = prove(host)
    assert changed.returncode == 1 and "fleet-serve" in changed.stderr
    assert changed.stdout == host.manifest.read_text()  # the manifest still hashes to the pin: its programs don't
    host.manifest.unlink()
    assert prove(host).returncode == 1


async def test_a_machine_with_a_stale_copy_of_the_tag_is_refused_before_the_pull(cloud, tmp_path, llama_server):
    pinned = proof_of(laid_out(tmp_path / "layout", llama_server))
    settings = settings_for(tmp_path, provider={"image_proof": pinned})
    machine = await first_machine(settings)
    cloud.set_faults({"stale_image": [machine]})
    async with fleet_for(settings) as fleet:
        result = await fleet.up(UpRequest("tiny", "eu"))
        failed, ready = result.attempts
        assert (failed.machine_id, failed.phase) == (machine, "connect"), failed
        assert "booted another image than fleet.toml pins" in failed.reason and pinned in failed.reason
        assert ready.outcome == "ready" and ready.machine_id != machine
        assert [b.machine_id for b in fleet.record.blacklist()] == [machine]
        refused = fleet.record.hosts(names=[failed.host])[0]
        assert refused.pulled_at is None and refused.destroyed_at is not None  # no weights paid for
        await fleet.destroy(None)


async def test_an_image_whose_tag_moved_is_refused_on_every_machine(cloud, tmp_path):
    settings = settings_for(tmp_path, provider={"image_proof": "sha256:" + "0" * 64}, up={"max_attempts": 2})
    async with fleet_for(settings) as fleet:
        result = await fleet.up(UpRequest("tiny", "eu"))
        assert result.ready == [] and [a.phase for a in result.attempts] == ["connect", "connect"]
        assert all("booted another image than fleet.toml pins" in a.reason for a in result.attempts)
        assert all(h.pulled_at is None and h.destroyed_at is not None for h in fleet.record.hosts())
