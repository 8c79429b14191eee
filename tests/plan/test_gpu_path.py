"""What the H200 run (bench/gpu) found different from the CPU path, checked here on the CPU against real
parts: the hub serving a generated model of a real shape through the whole `fleet up` path; a host seeing
the machine's nvidia-smi; the planner's terms against what a real llama-server allocates; llama-server's
buffer lines and nvidia-smi's output as the card printed them."""

import os
import subprocess
import time
from pathlib import Path

import pytest

from fleet.control.up import UpRequest
from fleet.localcloud import bigmodels, control, replicas
from fleet.plan import memory as plan
from fleet.plan.allocations import parse_buffer_lines
from fleet.plan.gguf import read_local
from fleet.probes.gpu import parse_query_csv
from tests.conftest import _start, _stop_and_check
from tests.fleetkit import fleet_for, settings_for, with_variant

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SMALL = bigmodels.DenseShape("small-shape", 2, 512, 4, 2, 128, 1024, 4096, 10000.0)
MIB = 1024**2


H200_CSV = (FIXTURES / "nvidia-smi-h200-thermal" / "query.csv").read_text().splitlines()


@pytest.fixture(scope="module")
def gpu_machine(tmp_path_factory: pytest.TempPathFactory, llama_server: Path):
    """A local cloud whose machine has an nvidia-smi (it prints `card.csv`: by default what the H200 printed)
    and whose hub publishes a directory of generated models, as bench/gpu/run starts it."""
    root = tmp_path_factory.mktemp("gpu-machine")
    tools = root / "bin"
    tools.mkdir()
    smi = tools / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat {root / 'card.csv'}\n")
    smi.chmod(0o755)
    models = root / "models"
    bigmodels.write_dense(SMALL, models / "small-shape-Q8_0.gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", f"{tools}:{os.environ['PATH']}")
        handle = _start(root / "localcloud", publish={"fleet-local/gpu-models": models})
    try:
        yield handle, root / "card.csv"
    finally:
        _stop_and_check(handle)


def _small_settings(tmp_path: Path, **sections: dict):
    settings = settings_for(tmp_path, **sections)
    tiny = settings.models["tiny"]
    small = tiny.files[0].model_copy(
        update={"repo": "fleet-local/gpu-models", "file": "small-shape-Q8_0.gguf", "sha256": None}
    )
    return with_variant(settings, "small", files=[small], on_up=["smoke"])


def _card(rows: list[str]) -> str:
    return "\n".join([H200_CSV[0], *rows]) + "\n"


async def test_a_generated_model_of_a_real_shape_goes_ready_and_the_host_reads_the_card(
    gpu_machine, tmp_path, monkeypatch
):
    cloud, card = gpu_machine
    card.write_text(_card(H200_CSV[1:2]))  # one card
    monkeypatch.setenv("FLEET_LOCALCLOUD_DIR", str(cloud.info.state_dir))
    async with fleet_for(_small_settings(tmp_path)) as fleet:
        [host] = (await fleet.up(UpRequest("small", "eu"))).ready
        try:
            [thermal] = await fleet.probe(host.name, only=["thermal"])
        finally:
            await fleet.destroy(None)
        [reading] = [e.detail for e in fleet.record.events(host.id) if e.kind == "card"]
    assert reading == "NVIDIA H200: 52791 of 143771 MiB in use"
    cards = thermal.metrics["series"]["cards"]
    assert thermal.metrics["card_samples"] >= 2 and {c["name"] for c in cards} == {"NVIDIA H200"}
    assert all(c["fan_pct"] is None and c["mem_total_mib"] == 143771 for c in cards)


@pytest.mark.parametrize(
    ("used", "total", "why"),
    [
        ("0 MiB", "143771 MiB", "llama-server left the model off the card: 0 MiB in use"),
        ("52791 MiB", "4 MiB", "the card has 4 MiB; the profile needs"),
    ],
)
async def test_a_host_whose_card_does_not_hold_the_model_is_not_ready(
    used, total, why, gpu_machine, tmp_path, monkeypatch
):
    cloud, card = gpu_machine
    row = H200_CSV[2].replace("52889 MiB", used).replace("143771 MiB", total)
    assert row != H200_CSV[2]
    card.write_text(_card([row]))
    monkeypatch.setenv("FLEET_LOCALCLOUD_DIR", str(cloud.info.state_dir))
    async with fleet_for(_small_settings(tmp_path, up={"max_attempts": 1})) as fleet:
        result = await fleet.up(UpRequest("small", "eu"))
        assert not result.ready
        [attempt] = result.attempts
        hosts = fleet.record.hosts()
    assert attempt.phase == "start" and why in attempt.reason, attempt.reason
    assert [(h.state, h.failed_phase) for h in hosts] == [("failed", "start")]
    assert hosts[0].destroyed_at is not None  # the instance went with it


def test_the_cloud_refuses_to_publish_a_directory_that_is_not_there(tmp_path):
    with pytest.raises(control.CloudControlError, match="exited with status 2"):
        control.start(tmp_path / "cloud", publish={"fleet-local/gpu-models": tmp_path / "missing"})
    assert "expected OWNER/REPO=DIR with DIR a directory" in (tmp_path / "cloud" / "server.log").read_text()


def test_a_generated_model_holds_what_its_header_promises(tmp_path):
    path = bigmodels.write_dense(SMALL, tmp_path / "m.gguf")
    header = read_local(path)
    blocks = {t.name: t.nbytes for t in header.tensors if t.name.startswith("blk.") and "norm" not in t.name}
    assert sum(blocks.values()) == SMALL.quantized_bytes()
    data = path.read_bytes()
    assert len(set(data[-4096:])) > 200  # random blocks, not a hole


def _serve_once(binary: Path, argv: list[str], log: Path) -> str:
    """Start llama-server on the CPU, wait for it to answer (it has allocated everything by then), stop it."""
    import httpx

    from fleet.localcloud.network import free_port

    port = free_port()
    with log.open("w") as out:
        server = subprocess.Popen([str(binary), *argv, "--host", "127.0.0.1", "--port", str(port)], stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert server.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        else:
            raise AssertionError("llama-server did not answer in 240 s")
    finally:
        server.terminate()
        server.wait(timeout=60)
    return log.read_text()


@pytest.mark.parametrize(("model", "slots"), [("a4b", 2), ("phonellm", 3)])
def test_the_planner_terms_are_what_llama_server_allocates(model, slots, tmp_path, llama_server):
    # The header replicas, loaded by the real llama-server with the profile's flags (on the CPU every buffer
    # is in host memory, so the model buffer holds the input embedding that a card would leave behind).
    settings = settings_for(tmp_path)
    profile = settings.profile(model)
    by_name = {(r.repo, r.filename): r for r in replicas.REPLICAS}
    paths = {f.key: replicas.write(by_name[(f.repo, f.file)], tmp_path / f.file) for f in profile.files}
    args = [a.replace("{file.draft}", str(paths.get("draft", ""))) for a in profile.args]
    args[args.index("-np") + 1] = str(slots)
    args[args.index("-c") + 1] = str(slots * profile.ctx_per_slot)
    argv = ["-m", str(paths["main"]), *args, "-lv", "4", "--no-warmup", "--no-repack", "-fit", "off", "-t", "2"]
    found = parse_buffer_lines(_serve_once(llama_server, argv, tmp_path / "server.log"))

    main = read_local(paths["main"])
    draft = read_local(paths["draft"]) if "draft" in paths else None
    planned = plan.make_plan(
        model, slots, plan.cache_settings_from_args(profile.args, profile.ctx_per_slot), main, draft,
        plan.PlanSettings(0, 0),
    )  # fmt: skip
    cpu = ("CPU", "CPU_Mapped")
    # llama-server prints MiB to two decimals: equal to that
    assert abs(found.on("KV", cpu) + found.on("RS", cpu) - slots * planned.per_slot_bytes) < MIB / 50
    host = planned.weights.host + (planned.draft_weights.host if planned.draft_weights else 0)
    assert abs(found.on("model", cpu) - (planned.weights_bytes + host)) < MIB / 50
    if model == "a4b":  # the MTP draft reads the target's cache: nothing of its own per slot
        assert planned.draft_per_slot is None and planned.as_dict()["per_slot"]["draft"] == 0
    else:  # its own output matrix: the input embedding stays in host memory on a card
        embd = next(t.nbytes for t in main.tensors if t.name == "token_embd.weight")
        assert planned.weights.host == embd and planned.weights.embeddings > 0


def test_the_buffer_lines_of_an_h200_load_sum_by_kind_and_device():
    found = parse_buffer_lines((FIXTURES / "llama-server-h200" / "a4b-10-slots.log").read_text())
    assert found.devices() == {"CPU_Mapped", "CUDA0", "CUDA_Host"}
    assert found.on("KV", ("CUDA0",)) == (6400 + 3000) * MIB  # global + windowed; the draft's are shared
    assert found.on("model", ("CUDA0",)) == round(13659.70 * MIB) + round(265.93 * MIB)
    assert found.on("model", ("CPU_Mapped",)) == round(577.50 * MIB) + round(157.50 * MIB)


def test_the_thermal_capture_of_an_h200_parses():
    samples = parse_query_csv((FIXTURES / "nvidia-smi-h200-thermal" / "query.csv").read_text())
    assert len(samples) == 62 and {s.name for s in samples} == {"NVIDIA H200"}
    assert all(s.fan_pct is None for s in samples)  # the one field this card reads [N/A]
    assert all(s.gpu_c and s.memory_c and s.power_w and s.mem_total_mib == 143771 for s in samples)
    assert max(s.util_gpu_pct for s in samples) >= 90 and min(s.throttle_mask for s in samples) == 0
