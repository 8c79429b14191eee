#!/usr/bin/env python3
"""What the patch set saves a voice call: first content of warm turns, stock llama-server against the
patched one, side by side in one run, through a link with an added round trip.

The recorded call (fleet/probes/data/call.json: its system prompt cut to --system-chars, its tools, its
user turns) is replayed turn by turn on one client connection per call, the way an agent talks to its
server: a streamed chat completion per turn, the reply appended to the history. The stock build closes
the connection after every streamed reply, so each warm turn pays a TCP connect and sends its request
body in slow start; the patched build keeps the connection. A second row per build waits --idle-gap-s
between turns (a caller speaking), past cpp-httplib's own 5 s idle limit.

The link: a client network namespace and a server namespace, made and removed by this script, with the
round trip added to the traffic between them and nothing else. tc netem on a veth pair where the kernel
has it; where it does not (this project's build machines lack sch_netem), a delay line in user space:
a TUN device in each namespace and this script relaying IP packets between them after half the round
trip each way, so both ends are the kernel's own TCP (handshake, slow start at a 1500-byte MTU).
Target: the patched build saves at least one round trip per warm turn at each delay.

Needs root (namespaces). Builds what is missing (scripts/build-llama-server, stock and patched).
Usage: sudo .venv/bin/python bench/keepalive.py [--rtt-ms 30,60] [--calls 3] [--turns 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import secrets
import signal
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.core.tls import client_context
from fleet.localcloud import tinymodels, toolchain
from fleet.probes.call import load_call
from fleet.probes.server import Server
from fleet.probes.stream import Connection

ROOT = Path(__file__).resolve().parents[1]
CLIENT_IP, SERVER_IP, PREFIX = "10.231.0.1", "10.231.0.2", 30
PORT = 18080
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


# ---- the link ------------------------------------------------------------------------------------
@dataclass
class Link:
    client_ns: str
    server_ns: str
    mechanism: str


def _netns_pair(tag: str) -> tuple[str, str]:
    client, server = f"fleet-ka-c-{tag}", f"fleet-ka-s-{tag}"
    for ns in (client, server):
        ip("netns", "add", ns)
        ip("-n", ns, "link", "set", "lo", "up")
    return client, server


def _try_netem(client: str, server: str, rtt_ms: float, tag: str) -> bool:
    """A veth pair between the namespaces with half the round trip of netem on each side."""
    c_if, s_if = f"kac{tag}"[:15], f"kas{tag}"[:15]
    ip("link", "add", c_if, "netns", client, "type", "veth", "peer", "name", s_if, "netns", server)
    for ns, dev, addr in ((client, c_if, CLIENT_IP), (server, s_if, SERVER_IP)):
        ip("-n", ns, "addr", "add", f"{addr}/{PREFIX}", "dev", dev)
        ip("-n", ns, "link", "set", dev, "up", "mtu", "1500")
    for ns, dev in ((client, c_if), (server, s_if)):
        added = subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", f"{rtt_ms / 2}ms"],
            capture_output=True,
            text=True,
        )
        if added.returncode != 0:
            ip("-n", client, "link", "del", c_if)
            return False
    return True


@contextlib.contextmanager
def delayed_link(rtt_ms: float) -> Iterator[Link]:
    """Two namespaces joined by a link that adds `rtt_ms` to every round trip; removed on exit."""
    tag = f"{os.getpid() % 100000}"
    client, server = _netns_pair(tag)
    relay = None
    try:
        if _try_netem(client, server, rtt_ms, tag):
            yield Link(client, server, "tc netem on a veth pair")
            return
        relay = subprocess.Popen(
            [sys.executable, __file__, "--delay-line", client, server, tag, str(rtt_ms / 2)],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert relay.stdout is not None
        if relay.stdout.readline().strip() != "ready":
            raise RuntimeError("the delay line did not start")
        yield Link(client, server, "a user-space delay line between TUN devices (this kernel has no netem)")
    finally:
        if relay is not None:
            os.killpg(relay.pid, signal.SIGTERM)
            relay.wait(10)
        for ns in (client, server):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def run_delay_line(client: str, server: str, tag: str, one_way_ms: float) -> None:
    """Relay IP packets between a TUN device in each namespace, each after `one_way_ms`, in order."""
    ends = {}
    for ns, name, addr in ((client, f"kac{tag}"[:15], CLIENT_IP), (server, f"kas{tag}"[:15], SERVER_IP)):
        fd = _tun(name)
        ip("link", "set", name, "netns", ns)
        ip("-n", ns, "addr", "add", f"{addr}/{PREFIX}", "dev", name)
        ip("-n", ns, "link", "set", name, "up", "mtu", "1500")
        ends[ns] = fd
    a, b = ends[client], ends[server]
    loop = asyncio.new_event_loop()
    delay = one_way_ms / 1000

    def deliver(dst: int, packet: bytes) -> None:
        with contextlib.suppress(BlockingIOError):  # a full queue drops the packet, as a link would
            os.write(dst, packet)

    def forward(src: int, dst: int) -> None:
        while True:
            try:
                packet = os.read(src, 65536)
            except BlockingIOError:
                return
            loop.call_at(loop.time() + delay, deliver, dst, packet)

    loop.add_reader(a, forward, a, b)
    loop.add_reader(b, forward, b, a)
    loop.add_signal_handler(signal.SIGTERM, loop.stop)
    print("ready", flush=True)
    loop.run_forever()


# ---- the servers and the client -------------------------------------------------------------------
def ensure_build(stock: bool) -> Path:
    path = toolchain.llama_server_path(stock=stock)
    if path is None:
        env = {**os.environ, **({"FLEET_LLAMA_PATCHES": "none"} if stock else {})}
        print(f"building the {'stock' if stock else 'patched'} llama-server (minutes)...", file=sys.stderr)
        out = subprocess.run([str(ROOT / "scripts" / "build-llama-server")], env=env, check=True, capture_output=True)
        path = Path(out.stdout.decode().strip().splitlines()[-1])
    return path


@contextlib.contextmanager
def server_in(
    ns: str, binary: Path, model: Path, key_file: Path, tls_files: tuple[Path, Path] | None = None
) -> Iterator[str]:
    """llama-server in the server namespace; with `tls_files` (key, certificate) it serves HTTPS alone."""
    argv = ["ip", "netns", "exec", ns, str(binary), "-m", str(model), "--host", SERVER_IP, "--port", str(PORT)]
    if tls_files:
        argv += ["--ssl-key-file", str(tls_files[0]), "--ssl-cert-file", str(tls_files[1])]
    # the tiny model says it was trained on 4k tokens; the call's system prompt is a voice agent's
    argv += ["-np", "1", "-c", "32768", "--override-kv", "llama.context_length=int:32768", "-t", "1"]
    argv += ["--api-key-file", str(key_file)]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield f"{'https' if tls_files else 'http'}://{SERVER_IP}:{PORT}"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def server_ms(timings: dict) -> float:
    """What the server spent before the first token: the prompt and one decode step."""
    steps = max(int(timings.get("predicted_n", 1)), 1)
    return float(timings.get("prompt_ms", 0)) + float(timings.get("predicted_ms", 0)) / steps


async def replay(
    url: str, key: str, calls: int, turns: int, system_chars: int, gap_s: float, tls: ssl.SSLContext | None = None
) -> list[dict]:
    """The recorded call, `calls` times, on one connection per call; one row per turn."""
    call = load_call().with_system_chars(system_chars)
    deadline = time.monotonic() + 60
    while True:  # the server loads in its namespace: wait for it from here
        probe = Connection(Server(url, key, tls))
        try:
            await probe.chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
        finally:
            await probe.close()
    rows = []
    for c in range(calls):
        conn = Connection(Server(url, key, tls))
        messages: list[dict] = [{"role": "system", "content": call.system}]
        try:
            for k in range(turns):
                if k and gap_s:
                    await asyncio.sleep(gap_s)
                messages.append({"role": "user", "content": call.user_turns[k % len(call.user_turns)]})
                body = {"messages": messages, "tools": call.tools, "max_tokens": 8, "temperature": 0}
                r = await conn.chat(body)
                if r.status != 200:
                    raise RuntimeError(f"turn {k + 1}: {r.error}")
                rows.append(
                    {
                        "call": c,
                        "turn": k,
                        "first_content_ms": r.timing.first_content_ms,
                        "connect_ms": r.timing.connect_ms,
                        "tls_ms": r.timing.tls_ms,
                        "body_bytes": len(json.dumps(body)),
                        # what the server spent before the first token: the prompt and one decode step
                        "server_ms": float(r.server_timings.get("prompt_ms", 0))
                        + float(r.server_timings.get("predicted_ms", 0))
                        / max(int(r.server_timings.get("predicted_n", 1)), 1),
                    }
                )
                messages.append({"role": "assistant", "content": r.content})
        finally:
            await conn.close()
    return rows


def client_in(
    ns: str,
    url: str,
    key_file: Path,
    calls: int,
    turns: int,
    system_chars: int,
    gap_s: float,
    ca_file: Path | None = None,
) -> list:
    argv = ["ip", "netns", "exec", ns, sys.executable, __file__, "--client", url, "--key-file", str(key_file)]
    argv += ["--calls", str(calls), "--turns", str(turns), "--system-chars", str(system_chars), "--gap-s", str(gap_s)]
    argv += ["--ca-file", str(ca_file)] if ca_file else []
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"the client failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout)


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[18] if len(values) > 1 else values[0]


def replay_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a replay through a delayed link (this bench and bench/tls.py)."""
    parser.add_argument("--rtt-ms", default="30,60", help="round trips to add, comma-separated")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-chars", type=int, default=16000, help="the call's system prompt, cut")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    replay_arguments(parser)
    parser.add_argument("--idle-gap-s", type=float, default=6.0, help="the gap of the idle row (0: no such row)")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--key-file", help=argparse.SUPPRESS)
    parser.add_argument("--gap-s", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--ca-file", help=argparse.SUPPRESS)
    parser.add_argument("--delay-line", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.delay_line:
        client, server, tag, one_way = args.delay_line
        run_delay_line(client, server, tag, float(one_way))
        return 0
    if args.client:
        key = Path(args.key_file).read_text().strip()
        verify = client_context(Path(args.ca_file)) if args.ca_file else None
        rows = asyncio.run(replay(args.client, key, args.calls, args.turns, args.system_chars, args.gap_s, verify))
        print(json.dumps(rows))
        return 0
    if os.geteuid() != 0:
        print("error: bench/keepalive.py makes network namespaces: run it as root", file=sys.stderr)
        return 2
    try:
        rtts = [float(x) for x in args.rtt_ms.split(",")]
    except ValueError:
        print(f"error: --rtt-ms takes numbers separated by commas, not {args.rtt_ms!r}", file=sys.stderr)
        return 2
    builds = {"stock": ensure_build(stock=True), "patched": ensure_build(stock=False)}
    with tempfile.TemporaryDirectory() as tmp:
        model = tinymodels.ensure(Path(tmp))["tiny"]
        key_file = Path(tmp) / "key"
        key_file.write_text(secrets.token_urlsafe(24))
        key_file.chmod(0o600)
        rows = []
        for rtt in rtts:
            with delayed_link(rtt) as link:
                print(f"link: +{rtt:g} ms round trip, {link.mechanism}", file=sys.stderr)
                plans = [(0.0, args.calls, args.turns)]
                if args.idle_gap_s and rtt == max(rtts):
                    plans.append((args.idle_gap_s, 1, 4))
                for gap, calls, turns in plans:
                    for name, binary in builds.items():
                        with server_in(link.server_ns, binary, model, key_file) as url:
                            turns_seen = client_in(link.client_ns, url, key_file, calls, turns, args.system_chars, gap)
                        warm = [t for t in turns_seen if t["turn"] > 0]
                        first = [t["first_content_ms"] for t in warm]
                        transport = [t["first_content_ms"] - t["server_ms"] for t in warm]
                        connects = [t["connect_ms"] for t in turns_seen if t["connect_ms"] is not None]
                        rows.append(
                            {
                                "rtt_ms": rtt,
                                "gap_s": gap,
                                "build": name,
                                "warm_turns": len(warm),
                                "p50": statistics.median(first),
                                "p95": p95(first),
                                "transport_p50": statistics.median(transport),
                                "reconnects_per_warm_turn": sum(t["connect_ms"] is not None for t in warm) / len(warm),
                                "connect_ms": statistics.median(connects),
                                "body_kb": statistics.median(t["body_bytes"] for t in warm) / 1024,
                            }
                        )
    print(f"\nllama.cpp {toolchain.llama_cpp_version()}, patch set p{toolchain.patchset_id()}; tiny model, one slot;")
    print(f"recorded call: system prompt {args.system_chars} chars, its tools, 8 tokens a reply\n")
    print(
        "| added RTT | gap between turns | build | warm turns | reconnects/turn | first content p50 | p95 "
        "| of it outside the server, p50 | saved p50 | saved outside the server |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        stock = next(r for r in rows if r["rtt_ms"] == row["rtt_ms"] and r["gap_s"] == row["gap_s"])
        saved, saved_out = stock["p50"] - row["p50"], stock["transport_p50"] - row["transport_p50"]
        patched = row["build"] == "patched"
        print(
            f"| {row['rtt_ms']:g} ms | {row['gap_s']:g} s | {row['build']} | {row['warm_turns']} | "
            f"{row['reconnects_per_warm_turn']:.2f} | {row['p50']:.1f} ms | {row['p95']:.1f} ms | "
            f"{row['transport_p50']:.1f} ms | "
            + (f"{saved:.1f} ms = {saved / row['rtt_ms']:.2f} RTT | " if patched else "| ")
            + (f"{saved_out:.1f} ms = {saved_out / row['rtt_ms']:.2f} RTT |" if patched else "|")
        )
    print(
        f"\n(request body of a warm turn: about {rows[0]['body_kb']:.0f} KiB. Outside the server: first content "
        "less the server's prompt time and one decode step, from its own timings.)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
