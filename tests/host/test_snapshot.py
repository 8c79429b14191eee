"""A repository snapshot as fleet reads it: the hub's listing (the local hub's, which answers as Hugging Face
does, and hostile ones), the small files fleet fetches itself, the host script that writes them, and what
a vLLM reply and /metrics say."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import subprocess

import pytest
from aiohttp import web

from fleet.engines.metrics import requests_in_flight
from fleet.engines.replies import Timings
from fleet.localcloud import tinyhf, toolchain
from fleet.localcloud.apierror import ApiError
from fleet.localcloud.cloud import Cloud
from fleet.localcloud.hosts import VLLM_HOST_SCRIPTS
from fleet.localcloud.server import DEFAULT_OFFERS_DIR
from fleet.localcloud.state import CloudSettings
from fleet.plan.snapshot import MAX_FILES, RepoFile, Snapshot, SnapshotError, listing, parse_listing, small_file
from tests.helpers import http_server

COMMIT = "a" * 40


def blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


async def test_the_local_hub_lists_a_repository_as_the_real_hub_does(cloud):
    cloud.set_faults({})
    found = await listing(cloud.url, tinyhf.REPO, "main")
    files = tinyhf.files()
    assert sorted(f.name for f in found.files) == sorted(files)
    for f in found.files:
        data = files[f.name]
        assert f.size == len(data)
        if f.name.endswith(".safetensors"):
            # weights are in LFS: the hub states their sha256, and git holds their pointer, not them
            sha256 = hashlib.sha256(data).hexdigest()
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(data)}\n"
            assert (f.sha256, f.blob_id) == (sha256, blob_id(pointer.encode()))
        else:  # small files are known by their git blob alone
            assert (f.sha256, f.blob_id) == (None, blob_id(data))
    # the commit is a revision too; any other is not found
    assert (await listing(cloud.url, tinyhf.REPO, found.commit)).commit == found.commit
    with pytest.raises(SnapshotError, match="HTTP 404 RevisionNotFound"):
        await listing(cloud.url, tinyhf.REPO, "b" * 40)
    with pytest.raises(SnapshotError, match="HTTP 404 RepoNotFound"):
        await listing(cloud.url, "fleet-local/no-such-repo", "main")
    config = next(f for f in found.files if f.name == "config.json")
    assert await small_file(cloud.url, found, config) == files["config.json"]


async def test_a_gated_repository_is_listed_with_the_token_alone(cloud):
    token = "hf_" + "x" * 30
    cloud.set_faults({"gated_repos": {tinyhf.REPO: token}})
    try:
        with pytest.raises(SnapshotError, match=r"HTTP 401: the hub refuses it \(gated or private"):
            await listing(cloud.url, tinyhf.REPO, "main")
        found = await listing(cloud.url, tinyhf.REPO, "main", token)
        config = next(f for f in found.files if f.name == "config.json")
        with pytest.raises(SnapshotError, match="HTTP 401"):
            await small_file(cloud.url, found, config)
        assert json.loads(await small_file(cloud.url, found, config, token))["num_hidden_layers"] == tinyhf.LAYERS
    finally:
        cloud.set_faults({})


def sibling(name: str, data: bytes = b"{}", lfs: bool = False) -> dict:
    entry = {"rfilename": name, "size": len(data), "blobId": blob_id(data)}
    if lfs:
        entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry


@pytest.mark.parametrize(
    ("doc", "why"),
    [
        ({"sha": COMMIT, "siblings": [{"rfilename": "config.json"}]}, "no size and blob id"),
        ({"sha": COMMIT, "siblings": [{**sibling("c.json"), "size": -1}]}, "no size and blob id"),
        ({"sha": COMMIT, "siblings": [{**sibling("c.json"), "size": True}]}, "no size and blob id"),
        ({"sha": COMMIT, "siblings": [{**sibling("m.safetensors", lfs=True), "lfs": {"sha256": "x"}}]}, "in LFS"),
        ({"sha": COMMIT, "siblings": [{**sibling("m.safetensors", lfs=True), "size": 9}]}, "LFS size"),
        ({"sha": COMMIT, "siblings": [{**sibling("big.json"), "size": 1 << 30}]}, "outside LFS"),
        ({"sha": "main", "siblings": []}, "names no commit"),
        ({"sha": COMMIT, "siblings": [sibling("c.json")] * (MAX_FILES + 1)}, "at most"),
        ({"sha": COMMIT}, "no list of files"),
        ([], "no list of files"),
    ],
)
def test_a_hostile_listing_is_a_one_line_error(doc, why):
    with pytest.raises(SnapshotError, match=why) as e:
        parse_listing(json.dumps(doc).encode(), "o/r")
    assert "\n" not in str(e.value)


def test_a_listing_keeps_the_top_level_and_says_what_is_in_lfs():
    doc = {
        "sha": COMMIT,
        "siblings": [
            sibling("config.json"),
            sibling("original/params.json"),
            sibling("../../etc/passwd"),
            sibling("..x.json"),
            sibling("a b.json"),
            sibling(".gitattributes"),
            sibling("README.md"),
            sibling("pytorch_model.bin", b"w", True),
            sibling("w.safetensors", b"w", True),
            sibling("consolidated.safetensors", b"w", True),
        ],
    }
    found = parse_listing(json.dumps(doc).encode(), "o/r")
    # what a server loads, under plain names: never a path that climbs, a pickle, or a second format's weights
    assert [(f.name, f.in_lfs) for f in found.files] == [("config.json", False), ("w.safetensors", True)]
    with pytest.raises(SnapshotError, match="not JSON"):
        parse_listing(b"\xff", "o/r")
    with pytest.raises(SnapshotError, match="runs past"):
        parse_listing(b" " * (5 << 20), "o/r")


async def test_a_small_file_whose_bytes_are_not_its_blob_is_refused():
    real = b'{"num_hidden_layers": 2}'

    async def served(request: web.Request) -> web.Response:
        return web.Response(body=b'{"num_hidden_layers": 3}')  # its size, other bytes

    async def moved(request: web.Request) -> web.Response:
        return web.Response(status=307, headers={"Location": "https://elsewhere.example/config.json"})

    async with http_server({"/o/r/resolve/{rev}/config.json": served, "/o/m/resolve/{rev}/config.json": moved}) as hub:
        snapshot = Snapshot("o/r", COMMIT, (RepoFile("config.json", len(real), blob_id(real), None),))
        with pytest.raises(SnapshotError, match="its listing says"):
            await small_file(hub, snapshot, snapshot.files[0])
        renamed = Snapshot("o/m", COMMIT, snapshot.files)
        with pytest.raises(SnapshotError, match="redirects it to"):
            await small_file(hub, renamed, snapshot.files[0], "hf_token")
        longer = Snapshot("o/r", COMMIT, (RepoFile("config.json", 3, blob_id(real), None),))
        with pytest.raises(SnapshotError, match="more than 3 bytes"):
            await small_file(hub, longer, longer.files[0])


def test_fleet_put_writes_what_fleet_sent_or_nothing(tmp_path):
    put = str(VLLM_HOST_SCRIPTS / "fleet-put")
    data = bytes(range(256)) * 3  # a binary file (tokenizer.model) survives the trip
    good = hashlib.sha256(data).hexdigest()
    dest = tmp_path / "models" / "r" / "tokenizer.model"
    stdin = base64.b64encode(data).decode()
    done = subprocess.run([put, str(dest), good], input=stdin, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == f"ok {good} {len(data)}" and dest.read_bytes() == data
    other = tmp_path / "models" / "r" / "config.json"
    bad = subprocess.run([put, str(other), "0" * 64], input=stdin, capture_output=True, text=True)
    assert bad.returncode == 3 and "sha256 mismatch" in bad.stderr
    assert not other.exists() and not other.with_name("config.json.part").exists()


def test_a_vllm_reply_reports_its_cache_in_usage():
    usage = {"prompt_tokens": 654, "completion_tokens": 24, "prompt_tokens_details": {"cached_tokens": 640}}
    assert Timings.of({}, usage) == Timings(prompt_n=14, cache_n=640, predicted_n=24, predicted_per_second=None)
    # a host that claims more cached tokens than its prompt is held to its prompt
    lying = {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 10**9}}
    assert Timings.of(None, lying) == Timings(prompt_n=0, cache_n=10)
    assert Timings.of(None, {"prompt_tokens": "x", "prompt_tokens_details": []}) == Timings()
    # llama-server's timings win where a reply has them
    assert Timings.of({"prompt_n": 3, "cache_n": 5, "predicted_n": 2}, usage).cache_n == 5


def test_requests_in_flight_sum_each_engines_gauges_over_their_labels():
    vllm = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        'vllm:num_requests_running{engine="0",model_name="tiny-vllm"} 2.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="tiny-vllm"} 1.0\n'
        'vllm:num_requests_running{engine="1",model_name="tiny-vllm"} 1.0\n'
        "vllm:prefix_cache_hits_total 120.0\n"
    )
    assert requests_in_flight(vllm) == 4
    assert requests_in_flight("llamacpp:requests_processing 0\n") == 0
    assert requests_in_flight("vllm:num_requests_running{} -1\n") is None
    assert requests_in_flight("vllm:num_requests_running{} NaN\n") is None
    assert requests_in_flight("vllm:num_requests_running{} 1.5\n") is None
    assert requests_in_flight("process_cpu_seconds_total 3\n") is None


def test_a_local_cloud_without_vllm_refuses_the_vllm_image_at_its_pull_and_says_what_to_run(tmp_path, monkeypatch):
    """Started before scripts/setup-vllm finished (a cache with no vLLM), the cloud refuses a vLLM image at its
    pull and says what to run; once vLLM is there, the next create takes it, with no restart."""
    installed, real_cache = toolchain.vllm_python_path(), str(toolchain.cache_dir())
    assert installed is not None, "scripts/setup-vllm has not run"
    monkeypatch.setenv("FLEET_CACHE_DIR", str(tmp_path / "a-cache-without-vllm"))

    # on an event loop of its own: the cloud's shutdown ends its loop's default executor
    async def run() -> None:
        cloud = Cloud(CloudSettings(state_dir=tmp_path / "cloud", offers_dir=DEFAULT_OFFERS_DIR, vllm_python=None))
        body = {"image": "ghcr.io/fleet-voice/vllm:0.32.0", "disk": 20, "label": "fleet-test", "runtype": "ssh_direct"}
        try:
            refused = cloud.state.instances[cloud.create(cloud.offers[0]["id"], body)]
            assert refused.pull_error and "run scripts/setup-vllm" in refused.pull_error
            for _ in range(100):  # the platform gives up the start, as after a failed image pull: no GPU billed
                if refused.intended_status == "stopped":
                    break
                await asyncio.sleep(0.05)
            assert refused.status == "created" and refused.status_msg == refused.pull_error
            assert refused.intended_status == "stopped" and refused.running_at is None
            monkeypatch.setenv("FLEET_CACHE_DIR", real_cache)  # scripts/setup-vllm has finished since
            taken = cloud.state.instances[cloud.create(cloud.offers[1]["id"], body)]
            assert taken.pull_error is None and cloud.settings.vllm_python == installed
            for _ in range(100):  # a destroy inside the create's read lag finds no such instance yet
                try:
                    await cloud.destroy(taken.id)
                    break
                except ApiError:
                    await asyncio.sleep(0.1)
        finally:
            await cloud.shutdown()

    asyncio.run(run())
