#!/usr/bin/env python3
"""The GPU bench's measurements, run by bench/gpu/run on the GPU machine (see bench/gpu/README.md).

  decode   the card's device-to-device copy bandwidth (PyTorch), llama-bench's decode rate on the model
           (no HTTP), then `fleet up` through the local cloud and `fleet bench` at 1, 2, 4 and 8 callers;
           bytes read per token times each rate as a share of the copy bandwidth; served / llama-bench.
  plan     each header replica (a4b with its MTP draft, phonellm, 12b, 31b) written with random blocks and
           loaded by llama-server with its profile's flags at several slot counts; `fleet plan`'s terms
           against llama-server's own buffer lines and nvidia-smi's memory.used of the process.
  replan   PLAN_JSON: a recorded plan run's table with the planner as it is now (anywhere, no GPU).
  slots    calls on neighbouring slots and on slots apart, a KV cache stream per slot against the shared
           cache fleet runs, with and without idle calls held in the other slots (bench/slots.py), at the
           bench's depth and at a shorter one
  path     where served decode is lost on fleet's path: a fleet host, then its server taken apart one
           difference at a time (decode_path.py)
  thermal  `fleet up`, then `fleet probe HOST --only thermal` for the profile's 5 minutes, with the raw
           nvidia-smi query captured beside it (the parser fixture) and `nvidia-smi -q` under load.
  calls    the a4b replica with its MTP draft (random blocks) through `fleet up` with as many slots as the card
           holds (fill_card), then calls in conversation at CALLS_LEVELS through `fleet gateway` and directly,
           and speakers at CALLS_SPEAKERS on both paths: calls per card at the voice target, $/voice-minute at
           the H200 offer's price, the gateway's added first content and its throughput ratio.

Writes everything under $OUT and prints a markdown table last. Needs: the environment bench/gpu/run sets.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import gguf
import served

from fleet.core.config import VoiceTarget
from fleet.economics.capacity import capacity, judge_level, usd_per_voice_minute
from fleet.engines import registry
from fleet.engines.llama_server import profile_args
from fleet.localcloud import control, replicas
from fleet.localcloud.bigmodels import NEMO_12B
from fleet.plan.allocations import Allocations, parse_buffer_lines
from fleet.plan.gguf import read_local
from fleet.plan.memory import MIB, PlanSettings, cache_settings_from_args, make_plan
from fleet.probes.bench import LevelResult
from fleet.probes.conversation import CallsLevel
from fleet.probes.gpu import QUERY

REPO = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("OUT", "/tmp/fleet-gpu/out"))
LOGS = OUT / "logs"  # bench/gpu/run packs these into one archive: few files come back from the machine
G = Path(os.environ.get("FLEET_GPU_DIR", "/tmp/fleet-gpu"))
MODEL = G / "models" / "nemo-12b-shape-Q8_0.gguf"
PROFILE = "h200-12b"
SLOT_DEPTHS = (13620, 4000)  # fleet bench's depth on this profile, and a shorter call's
# f16 K and V of every layer: 40 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes
KV_BYTES_PER_TOKEN = NEMO_12B.n_layer * NEMO_12B.n_head_kv * NEMO_12B.head_dim * 2 * 2


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def ended_by_signal(signum: int, _frame: object) -> None:
    """SIGTERM (`timeout` ending a device call's command) unwinds like an error: each `finally` ends what it
    started (the local cloud, a llama-server), or the machine's next call finds the card still taken. Once:
    `timeout` signals the whole process group and bench/gpu/run forwards it, and a second TERM would cut the
    unwinding short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def run_to_end(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """subprocess.run, but a measurement cut short asks the child to end (SIGTERM, as run()'s SIGKILL would
    not let it end its own servers) and waits for it."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        try:
            out, err = child.communicate(timeout=timeout)
        except BaseException:
            child.terminate()
            try:
                child.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.communicate()
            raise
    return subprocess.CompletedProcess(argv, child.returncode, out, err)


def fleet(*args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the fleet CLI; its output goes to $OUT/fleet-<verb>.log as well."""
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "fleet", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    with (LOGS / f"fleet-{args[0]}.log").open("a") as f:
        f.write(f"$ fleet {' '.join(args)}  ({time.monotonic() - started:.1f} s, exit {result.returncode})\n")
        f.write(result.stdout + result.stderr + "\n")
    if check and result.returncode != 0:
        tail = (result.stdout + result.stderr)[-4000:]
        raise SystemExit(f"fleet {' '.join(args)} exited {result.returncode}:\n{tail}")
    return result


def copy_bandwidth() -> float:
    """Bytes read plus bytes written per second by a large device-to-device copy, median of 20 (PyTorch)."""
    import torch

    n = 4 * 1024**3  # 4 GiB each way: far past the 60 MB L2
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for i in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1000)
    if not torch.equal(dst[:: 1 << 20], src[:: 1 << 20]):
        raise SystemExit("the device copy did not copy")
    del src, dst
    torch.cuda.empty_cache()
    times.sort()
    return 2 * n / times[len(times) // 2]


def bytes_per_token(path: Path) -> int:
    """What one decoded token reads of the weights: every tensor but the token embedding (one row of it)."""
    reader = gguf.GGUFReader(str(path))
    return sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight")


def llama_bench(depths: tuple[int, ...]) -> dict[int, float]:
    """llama.cpp's own decode rate (tg128, no HTTP, no sampling) at each context depth."""
    binary = Path(os.environ["FLEET_LLAMA_SERVER"]).with_name("llama-bench")
    argv = [str(binary), "-m", str(MODEL), "-ngl", "99", "-fa", "1", "-p", "0", "-n", "128", "-r", "5",
            "-d", ",".join(str(d) for d in depths), "-o", "json"]  # fmt: skip
    log("llama-bench: " + " ".join(argv[1:]))
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True)
    (OUT / "llama-bench.json").write_text(result.stdout)
    (LOGS / "llama-bench.log").write_text(result.stderr)
    return {int(row.get("n_depth", 0)): float(row["avg_ts"]) for row in json.loads(result.stdout)}


def batched_bench(depth: int, callers: list[int]) -> dict[int, float]:
    """llama.cpp's own decode of `n` sequences at once, each at `depth` (llama-batched-bench, its own cache
    stream per sequence as llama-server's slots have): per-sequence tokens/s by sequence count."""
    binary = Path(os.environ["FLEET_LLAMA_SERVER"]).with_name("llama-batched-bench")
    most = max(callers)
    argv = [str(binary), "-m", str(MODEL), "-ngl", "99", "-fa", "on", "-c", str(most * (depth + 256)),
            "-npp", str(depth), "-ntg", "128", "-npl", ",".join(map(str, callers)),
            "--output-format", "jsonl"]  # fmt: skip
    log("llama-batched-bench: " + " ".join(argv[1:]))
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True)
    (LOGS / "llama-batched-bench.log").write_text(result.stdout + result.stderr)
    rows = [json.loads(line) for line in (result.stdout + result.stderr).splitlines() if line.startswith('{"n_kv_max"')]
    return {int(r["pl"]): float(r["speed_tg"]) / int(r["pl"]) for r in rows}


def start_cloud(publish: dict[str, Path] | None = None) -> None:
    """The local cloud offering the card; its hub serves the generated model and `publish`'s repositories. A cloud
    that a cut call left running (it runs in its own session, which outlives the call's command) is ended first,
    its hosts destroyed: it still rents the card's one offer."""
    state = control.default_state_dir()
    if control.find(state):
        log("a local cloud left by an earlier call: its hosts destroyed and the cloud stopped first")
        tear_down()
    control.start(
        state,
        offers_dir=REPO / "bench" / "gpu" / "offers",
        hub_bytes_per_s=1 << 30,  # per connection: the hub is this machine's loopback
        publish={"fleet-local/gpu-models": MODEL.parent, **(publish or {})},
        timeout_s=600,  # the hub hashes what it publishes before it answers: 17 GB of a4b is ~1 min
    )


def up(profile: str = PROFILE) -> tuple[str, float]:
    started = time.monotonic()
    result = fleet("up", "--model", profile, "--region", "eu", "--json", timeout=900)
    seconds = time.monotonic() - started
    ready = json.loads(result.stdout)["ready"]
    log(f"fleet up: {ready[0]} READY in {seconds:.0f} s")
    return ready[0], seconds


def tear_down() -> None:
    fleet("destroy", "--all", "--yes", "--json", check=False, timeout=300)
    control.stop(control.default_state_dir())


def decode() -> None:
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    log("device-to-device copy")
    bandwidth = copy_bandwidth()
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + written)")
    per_token = bytes_per_token(MODEL)
    binary = Path(os.environ["FLEET_LLAMA_SERVER"])
    flags = profile_args(registry.load().profile(PROFILE))  # as fleet runs them: its cache layout too
    rows: dict[str, list[dict]] = {}
    for name, tls in (("llama-server alone, HTTP", False), ("llama-server alone, HTTPS", True)):
        log(f"{name}: the profile's flags alone, fleet's bench at 1-8 callers")
        rows[name] = served.alone(binary, MODEL, flags, 8, tls)
        keep(rows)
    start_cloud()
    try:
        host, up_s = up()
        result = fleet(
            "bench", host, "--callers", "8", "--max-tokens", "128", "--load", "speakers", "--json", timeout=900
        )
        report = json.loads(result.stdout)
        (OUT / "fleet-bench.json").write_text(json.dumps(report, indent=1))
        rows["fleet host (fleet bench: HTTPS, the local cloud's forwarder)"] = report["levels"]
        keep(rows)
        log("the host through the gateway, then directly")
        pair = served.through_gateway(host, 8)
        rows["fleet host through the gateway (HAProxy, TLS both hops)"] = pair["gateway"]
        rows["fleet host directly, right after the gateway's run"] = pair["host"]
        (LOGS / "fleet-status.json").write_text(fleet("status", "--json").stdout)
    finally:
        tear_down()
    keep(rows)
    depth = int(rows["llama-server alone, HTTP"][0]["prompt_tokens"])  # where callers decode: llama.cpp's runs too
    bench_rates = llama_bench((0, depth))
    batched = batched_bench(depth, [1, 2, 4, 8])
    log(f"llama-bench tg128: {bench_rates}; batched per sequence at depth {depth}: {batched}")
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
    lines = [
        f"# Decode on {smi}, {stamp}",
        "",
        "Command: `bench/gpu/run decode` (bench/gpu/README.md). Model: random-weight Mistral NeMo 12B shape",
        f"(`fleet/localcloud/bigmodels.py` NEMO_12B), Q8_0, {MODEL.stat().st_size / 1e9:.2f} GB file, "
        f"{per_token / 1e9:.3f} GB of weights read per token (every tensor but the token embedding), plus the",
        f"KV cache of the context: {KV_BYTES_PER_TOKEN // 1024} KiB per token of depth.",
        f"Device-to-device copy (PyTorch, 4 GiB, median of 20, read + written): {bandwidth / 1e12:.3f} TB/s.",
        f"`fleet up` to READY: {up_s:.0f} s (rent, boot, aria2c pull from the hub, sha256, load, probes).",
        f"Served callers decode at a depth of {depth} tokens (median prompt of the measured turns); every served",
        "row is fleet's own bench code (the recorded call, callers in waves, 3 measured waves a level).",
        "",
        "| what | callers | tok/s per caller | first content p50 / p95 ms | bytes read per step x steps/s | "
        "share of copy bandwidth | / llama.cpp alone | / llama-server alone, HTTP |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for d, rate in sorted(bench_rates.items()):
        achieved = (per_token + KV_BYTES_PER_TOKEN * d) * rate
        lines.append(f"| llama-bench tg128, depth {d} | 1 | {rate:.1f} | | {achieved / 1e12:.3f} TB/s | "
                     f"{achieved / bandwidth:.3f} | | |")  # fmt: skip
    for n, rate in sorted(batched.items()):
        achieved = (per_token + KV_BYTES_PER_TOKEN * depth * n) * rate
        lines.append(f"| llama-batched-bench, depth {depth} | {n} | {rate:.1f} | | {achieved / 1e12:.3f} TB/s | "
                     f"{achieved / bandwidth:.3f} | | |")  # fmt: skip
    direct = {lv["callers"]: lv for lv in rows["llama-server alone, HTTP"]}
    for name, found in rows.items():
        for level in found:
            n, rate = level["callers"], level["decode_per_caller_tok_s"]
            if rate is None:
                lines.append(f"| {name} | {n} | - | | | | errors {level['errors']} | |")
                continue
            achieved = (per_token + KV_BYTES_PER_TOKEN * depth * n) * rate
            alone = bench_rates[depth] if n == 1 else batched.get(n)
            first = f"{level['first_content_p50_ms']:.1f} / {level['first_content_p95_ms']:.1f}"
            base = (direct.get(n) or {}).get("decode_per_caller_tok_s")
            lines.append(
                f"| {name} | {n} | {rate:.1f} | {first} | {achieved / 1e12:.3f} TB/s | {achieved / bandwidth:.3f} | "
                f"{_ratio_of(rate, alone)} | {_ratio_of(rate, base)} |"
            )
    lines += ["", *verdicts(rows, bench_rates[depth], batched)]
    lines.append(f"Capacity at the voice target: {report['capacity']['callers']} callers"
                 + (" (at least)" if report["capacity"]["at_least"] else ""))  # fmt: skip
    text = "\n".join(lines) + "\n"
    (OUT / "decode.md").write_text(text)
    print(text)


def alone() -> None:
    """llama-server alone with the profile's flags as fleet runs them, fleet's bench at 1-8 callers over HTTP,
    against llama.cpp's own llama-bench (1) and llama-batched-bench (2-8) at the callers' depth: decode's
    "llama-server alone / llama.cpp alone" row without a fleet host (no host tools needed)."""
    binary = Path(os.environ["FLEET_LLAMA_SERVER"])
    flags = profile_args(registry.load().profile(PROFILE))
    log(f"llama-server alone, HTTP: {' '.join(flags)}")
    rows = {"llama-server alone, HTTP": served.alone(binary, MODEL, flags, 8, False)}
    keep(rows)
    depth = int(rows["llama-server alone, HTTP"][0]["prompt_tokens"])
    one = llama_bench((depth,))[depth]
    batched = batched_bench(depth, [1, 2, 4, 8])
    cpp = {1: one, **{n: r for n, r in batched.items() if n > 1}}
    lines = [
        f"llama-server alone (fleet's bench, HTTP) against llama.cpp alone at depth {depth}:",
        "",
        "| callers | llama-server alone tok/s per caller | llama.cpp alone | ratio |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for level in rows["llama-server alone, HTTP"]:
        n, rate = level["callers"], level["decode_per_caller_tok_s"]
        lines.append(f"| {n} | {rate:.1f} | {cpp.get(n, 0):.1f} | {_ratio_of(rate, cpp.get(n))} |")
    text = "\n".join(lines) + "\n"
    (OUT / "alone.md").write_text(text)
    print(text)


def keep(rows: dict[str, list[dict]]) -> None:
    """The served rows so far, in $OUT: a call cut off at its time limit still brings back what it measured."""
    (OUT / "served.json").write_text(json.dumps(rows, indent=1))


def _ratio_of(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if a and b else ""


def verdicts(rows: dict[str, list[dict]], one_alone: float, batched: dict[int, float]) -> list[str]:
    """The issue's targets, each with the worst level: fleet >= 0.95 of llama-server alone, alone >= 0.95 of
    llama.cpp alone, HTTPS within 1% decode and 1 ms first content of HTTP, the gateway within its own."""

    def by(name: str) -> dict[int, dict]:
        return {lv["callers"]: lv for lv in rows[name]}

    http, https = by("llama-server alone, HTTP"), by("llama-server alone, HTTPS")
    host = by("fleet host (fleet bench: HTTPS, the local cloud's forwarder)")
    through, beside = (
        by("fleet host through the gateway (HAProxy, TLS both hops)"),
        by("fleet host directly, right after the gateway's run"),
    )

    def worst(a: dict[int, dict], b: dict[int, dict], field: str = "decode_per_caller_tok_s") -> tuple[float, int]:
        ratios = [(a[n][field] / b[n][field], n) for n in sorted(a) if n in b and a[n][field] and b[n][field]]
        return min(ratios) if ratios else (float("nan"), 0)

    def added(a: dict[int, dict], b: dict[int, dict], field: str) -> tuple[float, int]:
        gaps = [(a[n][field] - b[n][field], n) for n in sorted(a) if n in b and a[n][field] and b[n][field]]
        return max(gaps) if gaps else (float("nan"), 0)

    cpp = {1: one_alone, **{n: r for n, r in batched.items() if n > 1}}
    alone_vs_cpp = [(http[n]["decode_per_caller_tok_s"] / cpp[n], n) for n in sorted(http) if cpp.get(n)]
    fleet_ratio, fleet_n = worst(host, http)
    cpp_ratio, cpp_n = min(alone_vs_cpp) if alone_vs_cpp else (float("nan"), 0)
    tls_ratio, tls_n = worst(https, http)
    tls_first, tls_first_n = added(https, http, "first_content_p50_ms")
    gw_ratio, gw_n = worst(through, beside)
    gw_p50, gw_p50_n = added(through, beside, "first_content_p50_ms")
    gw_p95, gw_p95_n = added(through, beside, "first_content_p95_ms")
    return [
        f"- fleet host / llama-server alone (HTTP), worst level: {fleet_ratio:.3f} at {fleet_n} (target >= 0.95).",
        f"- llama-server alone / llama.cpp alone (llama-bench at 1, llama-batched-bench above), worst level: "
        f"{cpp_ratio:.3f} at {cpp_n} (target >= 0.95).",
        f"- HTTPS / HTTP decode, worst level: {tls_ratio:.3f} at {tls_n} (target: within 1%); first content p50 "
        f"added by TLS, worst level: {tls_first:+.2f} ms at {tls_first_n} (target < 1 ms, kept connections).",
        f"- Through the gateway / directly, decode, worst level: {gw_ratio:.3f} at {gw_n} (target >= 0.98); first "
        f"content added, worst level: p50 {gw_p50:+.2f} ms at {gw_p50_n} (target <= 1 ms), p95 {gw_p95:+.2f} ms at "
        f"{gw_p95_n} (the target is <= 3 ms at p99; 3 waves a level give no p99).",
    ]


def path() -> None:
    """Where served decode is lost between llama-server alone and a fleet host (decode_path.py)."""
    import decode_path

    start_cloud()
    decode_path.run(up, tear_down, OUT, LOGS)


# bench/slots.py's runs: the model, its profile (and the configuration it is in: None is FLEET_CONFIG), the
# slots it is served with, and each depth with the KV cache layouts measured there.
SLOT_RUNS = {
    "nemo": (PROFILE, None, None, ((SLOT_DEPTHS[0], "both"),)),
    "a4b": ("a4b", REPO / "fleet.toml", 8, ((4000, "both"), (SLOT_DEPTHS[0], "stream"))),
    "phonellm": ("phonellm", REPO / "fleet.toml", 8, ((4000, "both"),)),
}


def slots(only: list[str]) -> None:
    """bench/slots.py on the card with each profile's flags: calls on any slots with a stream per slot (fleet's
    layout, patch 0003) against neighbours and against one shared cache, idle calls held or not.
    `only`: the models of SLOT_RUNS to run (default all)."""
    lines = []
    for name in only or list(SLOT_RUNS):
        profile_name, config_file, n_slots, runs = SLOT_RUNS[name]
        model, files = MODEL, []
        if name != "nemo":
            profile = registry.load(config_file).profile(profile_name)
            by_name = {(r.repo, r.filename): r for r in replicas.REPLICAS}
            (G / "replicas").mkdir(parents=True, exist_ok=True)
            paths = {f.key: replicas.write(by_name[(f.repo, f.file)], G / "replicas" / f.file, fill=True)
                     for f in profile.files}  # fmt: skip
            model = paths.pop("main")
            files = [a for key, path in paths.items() for a in ("--file", f"{key}={path}")]
            log(f"{name}: wrote the replicas of {', '.join(f.file for f in profile.files)}")
        for depth, layout in runs:
            layout = os.environ.get("SLOT_LAYOUT", layout)  # `stream`: fleet's layout alone
            log(f"slots: {name} at depth {depth}, {layout}")
            argv = [sys.executable, str(REPO / "bench" / "slots.py"), "--profile", profile_name, "--model", str(model),
                    *files, "--binary", os.environ["FLEET_LLAMA_SERVER"], "--depth", str(depth), "--tokens", "128",
                    "--layout", layout, "--repeats", os.environ.get("SLOT_REPEATS", "3"),
                    "--json", str(OUT / f"slots-{name}-{depth}.json")]  # fmt: skip
            if config_file:
                argv += ["--config", str(config_file)]
            if n_slots:
                argv += ["--slots", str(n_slots)]
            if os.environ.get("SLOT_ONE_TEXT") == "1":
                argv.append("--one-text")
            found = run_to_end(argv, timeout=600)
            (LOGS / f"slots-{name}-{depth}.log").write_text(found.stderr)
            if found.returncode != 0:
                raise SystemExit(f"bench/slots.py failed: {found.stderr[-2000:]}")
            lines += [f"{name} ({profile_name}, {n_slots or 'its'} slots), depth {depth} tokens, 128 tokens decoded "
                      "by each call:", "", found.stdout, ""]  # fmt: skip
            (OUT / "slots.md").write_text("\n".join(lines))  # a call cut off keeps what it measured
    print("\n".join(lines))


# bench/server_decode.py's models on the card: the GGUF (None: NeMo's shape above, else the profile whose main
# file's replica is written) and its vocabulary's size
STREAM_RUNS = {"nemo": (None, 356), "a4b": ("a4b", 262144), "phonellm": ("phonellm", 131072)}


def streams(only: list[str]) -> None:
    """llama-server alone against llama-batched-bench at 1-64 streams on the card, 0004's top-k path against the
    whole vocabulary's (bench/server_decode.py), for each model of STREAM_RUNS (`only`: some of them)."""
    lines = []
    for name in only or list(STREAM_RUNS):
        profile_name, n_vocab = STREAM_RUNS[name]
        model = MODEL
        if profile_name is not None:
            main = registry.load(REPO / "fleet.toml").profile(profile_name).files[0]
            by_name = {(r.repo, r.filename): r for r in replicas.REPLICAS}
            (G / "replicas").mkdir(parents=True, exist_ok=True)
            model = replicas.write(by_name[(main.repo, main.file)], G / "replicas" / main.file, fill=True)
            log(f"streams: {name}: wrote the replica of {main.file}")
        argv = [sys.executable, str(REPO / "bench" / "server_decode.py"), "--model-file", str(model), "--name", name,
                "--n-vocab", str(n_vocab), "--flags", "-ngl 99 -fa on --cache-type-k f16 --cache-type-v f16",
                "--bin-dir", str(Path(os.environ["FLEET_LLAMA_SERVER"]).parent), "--threads", "8",
                "--streams", os.environ.get("STREAMS", "1,8,16,32,64"), "--tokens", "80",
                "--repeats", os.environ.get("STREAM_REPEATS", "1"), "--stacks", os.environ.get("STREAM_STACKS", "0"),
                "--perf", os.environ.get("STREAM_PERF", "0"),
                *([f"--beside={os.environ['STREAM_BESIDE']}"] if os.environ.get("STREAM_BESIDE") else []),
                *(["--beside-bin", os.environ["STREAM_BESIDE_BIN"]] if os.environ.get("STREAM_BESIDE_BIN") else []),
                f"--server-flags={os.environ.get('STREAM_SERVER_FLAGS', '')}",  # empty: llama-server's defaults
                "--log-dir", str(LOGS), "--json", str(OUT / f"streams-{name}.json")]  # fmt: skip
        found = run_to_end(argv, timeout=600)
        (LOGS / f"streams-{name}.log").write_text(found.stderr)
        if found.returncode != 0:
            raise SystemExit(f"bench/server_decode.py failed: {found.stderr[-2000:]}")
        lines += [found.stdout, ""]
        if "samples of the main thread" in found.stderr:  # STREAM_STACKS: where the server's thread was
            lines += [found.stderr[found.stderr.index(f"{name}: where the server") :], ""]
        (OUT / "streams.md").write_text("\n".join(lines))  # a call cut off keeps what it measured
    print("\n".join(lines))


def thermal() -> None:
    start_cloud()
    try:
        host, _ = up()
        (OUT / "nvidia-smi-q-idle.txt").write_text(
            subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True, check=False).stdout
        )
        query = subprocess.Popen(
            [*QUERY, "-l", "5"], stdout=(OUT / "query.csv").open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        argv = [sys.executable, "-m", "fleet", "probe", host, "--only", "thermal", "--plot", str(OUT / "thermal.png")]
        probe = subprocess.Popen([*argv, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(90)  # under load by now: which fields read N/A then
            (OUT / "nvidia-smi-q-under-load.txt").write_text(
                subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True, check=False).stdout
            )
            stdout, stderr = probe.communicate(timeout=900)
        finally:
            query.terminate()
            query.wait()
        (OUT / "thermal.json").write_text(stdout)
        (LOGS / "fleet-probe.log").write_text(stderr)
    finally:
        tear_down()
    print(stdout[-4000:] or stderr[-4000:])


PLAN_RUNS = (("a4b", (1, 3, 10)), ("phonellm", (1, 12)), ("12b", (1, 3)), ("31b", (1, 2)))
GPU = ("CUDA0",)


def _serve_once(argv: list[str], log_path: Path) -> tuple[str, int | None]:
    """Start llama-server, wait until it answers /health, read the process's memory.used, stop it."""
    with log_path.open("w") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    used = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and server.poll() is None:
            probe = subprocess.run(["curl", "-sf", "http://127.0.0.1:18181/health"], capture_output=True, check=False)
            if probe.returncode == 0 and shutil.which("nvidia-smi"):
                apps = subprocess.run(
                    ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, check=False,
                ).stdout  # fmt: skip
                rows = [[x.strip() for x in line.split(",")] for line in apps.splitlines() if "," in line]
                mine = [int(mib) for pid, mib in rows if int(pid) == server.pid] or [int(mib) for _, mib in rows]
                used = mine[0] * MIB if len(mine) == 1 else None  # the server's own, or the only process
            if probe.returncode == 0:
                break
            time.sleep(0.5)
    finally:
        server.terminate()
        server.wait(timeout=60)
    return log_path.read_text(), used


def plan(only: list[str]) -> None:
    settings = registry.load(REPO / "fleet.toml")
    binary = os.environ["FLEET_LLAMA_SERVER"]
    directory = G / "replicas"
    directory.mkdir(parents=True, exist_ok=True)
    by_name = {(r.repo, r.filename): r for r in replicas.REPLICAS}
    p = settings.plan
    rows, records = [], []
    started = time.monotonic()
    for model, slot_counts in PLAN_RUNS:
        if only and model not in only:
            continue
        if time.monotonic() - started > 200:
            log(f"skipping {model}: out of time")
            continue
        profile = settings.profile(model)
        paths = {}
        for f in profile.files:
            paths[f.key] = replicas.write(by_name[(f.repo, f.file)], directory / f.file, fill=True)
        log(f"{model}: wrote {', '.join(p.name for p in paths.values())}")
        main, draft = read_local(paths["main"]), read_local(paths["draft"]) if "draft" in paths else None
        plan_settings = PlanSettings(int(p.runtime_mib_for(profile) * MIB), int(p.headroom_mib * MIB))
        for n in slot_counts:
            sized = profile.model_copy(
                update={"slots": n, "args": _with(profile.args, {"-np": str(n), "-c": str(n * profile.ctx_per_slot)})}
            )
            args = [a.replace("{file.draft}", str(paths.get("draft", ""))) for a in profile_args(sized)]
            argv = [binary, "-m", str(paths["main"]), *args, "--host", "127.0.0.1", "--port", "18181", "-lv", "4"]
            text, used = _serve_once(argv, LOGS / f"serve-{model}-{n}.log")
            found = parse_buffer_lines(text)
            cache = cache_settings_from_args(profile.args, profile.ctx_per_slot)
            planned = make_plan(model, n, cache, main, draft, plan_settings)
            record = {
                "model": model,
                "slots": n,
                "plan": planned.as_dict(),
                "allocated": {k: dict(v) for k, v in found.by_kind.items()},
                "process_used_bytes": used,
            }
            records.append(record)
            rows.append(_plan_row(record, planned, found, used))
            log(f"{model} x{n}: {rows[-1]}")
            (OUT / "plan.json").write_text(json.dumps(records, indent=1))  # a call cut off keeps what it measured
        for path in paths.values():
            path.unlink()
    (OUT / "plan.json").write_text(json.dumps(records, indent=1))
    text = plan_table(rows)
    (OUT / "plan.md").write_text(text)
    print(text)


def plan_table(rows: list[str]) -> str:
    header = (
        "| model | slots | weights plan / CUDA0 model | per-slot plan / (KV+RS)/slots | draft per slot plan | "
        "runtime plan / compute + rest | total plan (no headroom) / process memory.used |\n"
        "| --- | ---: | --- | --- | ---: | --- | --- |"
    )
    return header + "\n" + "\n".join(rows) + "\n"


def replan(path: Path) -> None:
    """The table of a recorded `plan` run (its plan.json) with the planner as it is now: no GPU needed."""
    settings = registry.load(REPO / "fleet.toml")
    by_name = {(r.repo, r.filename): r for r in replicas.REPLICAS}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for record in json.loads(path.read_text()):
            profile = settings.profile(record["model"])
            headers = {}
            for f in profile.files:
                headers[f.key] = read_local(replicas.write(by_name[(f.repo, f.file)], Path(tmp) / f.file))
            p = settings.plan
            planned = make_plan(
                record["model"],
                record["slots"],
                cache_settings_from_args(profile.args, profile.ctx_per_slot),
                headers["main"],
                headers.get("draft"),
                PlanSettings(int(p.runtime_mib_for(profile) * MIB), int(p.headroom_mib * MIB)),
            )
            found = Allocations()
            for kind, per in record["allocated"].items():
                found.by_kind[kind] = dict(per)
            rows.append(_plan_row(record, planned, found, record["process_used_bytes"]))
    print(plan_table(rows))


def _with(args: list[str], values: dict[str, str]) -> list[str]:
    out = list(args)
    for flag, value in values.items():
        out[out.index(flag) + 1] = value
    return out


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:,.0f}"


def _ratio(a: float, b: float | None) -> str:
    return "" if not b else f" ({a / b:.3f})"


def _plan_row(record: dict, planned, found, used: int | None) -> str:
    n = record["slots"]
    model_gpu = found.on("model", GPU)
    kv_gpu = found.on("KV", GPU) + found.on("RS", GPU)
    compute = found.on("compute", GPU) + found.on("output", GPU)
    rest = (used - model_gpu - kv_gpu - compute) if used else None
    runtime = compute + (rest or 0)
    total = planned.total_bytes() - planned.headroom_bytes
    draft = planned.draft_per_slot.total if planned.draft_per_slot else 0
    planned_runtime = planned.overhead_bytes + planned.mask_bytes()  # a shared cache's mask is compute buffer
    return (
        f"| {record['model']} | {n} | {_mib(planned.weights_bytes)} / {_mib(model_gpu)}"
        f"{_ratio(planned.weights_bytes, model_gpu)} | {_mib(planned.per_slot_bytes)} / {_mib(kv_gpu / n)}"
        f"{_ratio(planned.per_slot_bytes, kv_gpu / n)} | {_mib(draft)} | {_mib(planned_runtime)} / "
        f"{_mib(compute)} + {_mib(rest)}{_ratio(planned_runtime, runtime)} | {_mib(total)} / {_mib(used)}"
        f"{_ratio(total, used)} |"
    )


CALLS_PROFILE = "h200-a4b"  # bench/gpu/fleet.toml: the a4b profile's flags and files, filling the card
CALLS_TURNS = 2  # measured turns a call, after its cold one, each after the profile's turn gap (8 s)
CALLS_TOKENS = 80  # a reply, as our users' sweep asked for


def _levels(name: str, default: str) -> list[int]:
    return [int(n) for n in os.environ.get(name, default).split(",") if n.strip()]


def calls() -> None:
    """The a4b replica on the card with as many slots as it holds; calls and speakers through the gateway and
    directly (served.calls), and the table. CALLS_DRAFT_MAX_SLOTS sets the profile's draft_max_slots: below the
    slots the card holds, the host starts without the draft, as a profile whose draft does not pay at many calls."""
    if draft_max := os.environ.get("CALLS_DRAFT_MAX_SLOTS"):
        config, header = G / "fleet-calls.toml", f"[models.{CALLS_PROFILE}]\n"
        text = Path(os.environ["FLEET_CONFIG"]).read_text()
        if header not in text:  # measured with the draft while saying without it: refused
            raise SystemExit(f"CALLS_DRAFT_MAX_SLOTS: {os.environ['FLEET_CONFIG']} has no {header.strip()}")
        config.write_text(text.replace(header, f"{header}draft_max_slots = {int(draft_max)}\n"))
        os.environ["FLEET_CONFIG"] = str(config)  # fleet up, run below, reads it too
    settings = registry.load(os.environ["FLEET_CONFIG"])
    profile = settings.profile(CALLS_PROFILE)
    by_name = {(r.repo, r.filename): r for r in replicas.REPLICAS}
    directory = G / "a4b"
    directory.mkdir(parents=True, exist_ok=True)
    for f in profile.files:
        replicas.write(by_name[(f.repo, f.file)], directory / f.file, fill=True)
    log(f"a4b: wrote {', '.join(f.file for f in profile.files)} with random blocks")
    repos = {f.repo for f in profile.files}
    start_cloud({repo: directory for repo in repos})
    try:
        host, seconds = up(CALLS_PROFILE)
        levels, speakers = _levels("CALLS_LEVELS", "8,16,32,64"), _levels("CALLS_SPEAKERS", "8,32,64")

        def keep_calls(rows: dict) -> None:
            (OUT / "calls.json").write_text(json.dumps({**rows, "up_s": seconds}, indent=1))

        rows = asyncio.run(served.calls(host, levels, speakers, CALLS_TURNS, CALLS_TOKENS, keep_calls))
        rows["up_s"] = seconds
        keep_calls(rows)
        text = calls_table(rows, profile.voice)
        (OUT / "calls.md").write_text(text)
        print(text)
    finally:
        tear_down()


def calls_table(rows: dict, target: VoiceTarget) -> str:
    """Calls per card at the voice target on each path, with the levels; the gateway's added first content and
    throughput ratio at the speaker levels."""
    lines = [f"`{rows['host']}`: {rows['slots']} slots, ${rows['usd_per_hour']:.3f}/h, READY in {rows['up_s']:.0f} s",
             "", "| calls | path | first content p50 / p95 ms | decode tok/s a call | draft accepted | waited "
             "| peak in flight | duty | at target |", "|---:|---|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    held = {}
    for path, found in rows["calls"].items():
        levels = {lv["calls"]: CallsLevel(**lv) for lv in found}
        for n, lv in sorted(levels.items()):
            why = judge_level(lv, target)
            lines.append(f"| {n} | {path} | {_ms(lv.first_content_p50_ms)} / {_ms(lv.first_content_p95_ms)} | "
                         f"{_num(lv.decode_per_caller_tok_s)} | {_num(lv.draft_acceptance, 2)} | {lv.waited} | "
                         f"{lv.peak_in_flight} | {_num(lv.duty, 2)} "
                         f"| {why or 'yes'} |")  # fmt: skip
        held[path] = capacity(levels, target, max(levels, default=0)) if levels else None
    lines.append("")
    for path, found in held.items():
        if found is None:
            continue
        cost = usd_per_voice_minute(rows["usd_per_hour"], found.callers)
        more = " (every level measured held: more may)" if found.exhausted else ""
        lines.append(f"- {path}: **{found.callers} calls** at the target{more}; "
                     f"${cost:.4f} a voice-minute" if cost else f"- {path}: no level held the target")  # fmt: skip
    lines += ["", "| speakers | first content p50 / p95 / p99 ms, gateway | direct | added p50 / p99 ms "
              "| throughput gateway / direct |", "|---:|---|---|---|---:|"]  # fmt: skip
    gateway_levels = {lv["callers"]: LevelResult(**lv) for lv in rows["speakers"].get("gateway", [])}
    for lv in rows["speakers"].get("host", []):
        d, g = LevelResult(**lv), gateway_levels.get(lv["callers"])
        if g is None:
            continue
        added = [
            _diff(g.first_content_p50_ms, d.first_content_p50_ms),
            _diff(g.first_content_p99_ms, d.first_content_p99_ms),
        ]
        lines.append(f"| {d.callers} | {_ms(g.first_content_p50_ms)} / {_ms(g.first_content_p95_ms)} / "
                     f"{_ms(g.first_content_p99_ms)} | {_ms(d.first_content_p50_ms)} / {_ms(d.first_content_p95_ms)} / "
                     f"{_ms(d.first_content_p99_ms)} | {' / '.join(added)} | "
                     f"{_ratio_of(g.throughput_tok_s, d.throughput_tok_s)} |")  # fmt: skip
    lines += ["", "Our users' sweep beside it (vLLM, Gemma 4 26B-A4B NVFP4 on an RTX PRO 6000, 96 GB, 80-token "
              "replies): concurrency 12-48, first content p50 127-271 ms."]  # fmt: skip
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _diff(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a - b:+.1f}"


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, ended_by_signal)
    if sys.argv[1] != "replan":
        LOGS.mkdir(parents=True, exist_ok=True)
    if sys.argv[1] == "plan":
        plan(sys.argv[2:])
    elif sys.argv[1] == "replan":
        replan(Path(sys.argv[2]))
    elif sys.argv[1] == "slots":
        slots(sys.argv[2:])
    elif sys.argv[1] == "streams":
        streams(sys.argv[2:])
    else:
        {"decode": decode, "thermal": thermal, "path": path, "alone": alone, "calls": calls}[sys.argv[1]]()
