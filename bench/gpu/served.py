"""The served rows of bench/gpu/run decode, each driven by fleet's own bench code (fleet/probes/bench.py:
the recorded call, its system prompt fitted to 40% of a slot, callers in waves, the cold wave and a warm-up
discarded, 3 measured):

  alone   llama-server started by this script with the profile's flags as fleet runs them and nothing
          else, over plain HTTP and again over HTTPS (a certificate of a CA made here), each a fresh server
  gateway the fleet host through `fleet gateway` (HAProxy, an agent's key), and the same host reached
          directly right after it, so the two are measured side by side on one server
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleet.app import open_fleet
from fleet.control import gateway
from fleet.core.tls import client_context, ensure_ca, sign_server
from fleet.engines import registry
from fleet.localcloud.llamaproc import llama_server
from fleet.probes.bench import LevelResult, fit_call, levels_up_to, run_bench, run_level
from fleet.probes.call import load_call
from fleet.probes.conversation import converse
from fleet.probes.server import Server

MAX_TOKENS = 128
WAVES = 3  # run_bench's own


def levels(server: Server, most: int) -> list[dict[str, Any]]:
    """fleet's bench at 1, 2, 4 ... `most` callers on `server`: every level (no search), as dicts."""

    async def measured() -> list[LevelResult]:
        call, slots = await fit_call(server, load_call())
        return await run_bench(server, call, slots, max_callers=most, max_tokens=MAX_TOKENS)

    return [lv.as_dict() for lv in asyncio.run(measured())]


def alone(binary: Path, model: Path, flags: list[str], most: int, tls: bool) -> list[dict[str, Any]]:
    """llama-server with the profile's flags as fleet runs them (no key, no fleet exposure flags), fresh, over
    HTTP or HTTPS on loopback."""
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        extra: list[str] = []
        context = None
        if tls:
            ca = ensure_ca(tmp / "ca", "bench CA")
            key_pem, cert_pem = sign_server(ca, ["127.0.0.1"], days=1)
            (tmp / "key.pem").write_bytes(key_pem)
            (tmp / "cert.pem").write_bytes(cert_pem)
            extra = ["--ssl-key-file", str(tmp / "key.pem"), "--ssl-cert-file", str(tmp / "cert.pem")]
            context = client_context(ca.certificate_path)
        with llama_server(binary, model, *flags, *extra, timeout_s=300, tls=context) as url:
            return levels(Server(url, None, context), most)


def through_gateway(host_name: str, most: int) -> dict[str, list[dict[str, Any]]]:
    """The fleet host through `fleet gateway` with an agent's key, then the same host reached directly (its
    URL and key, fleet's CA), one after the other on one server."""
    return asyncio.run(_through_gateway(host_name, most))


async def _through_gateway(host_name: str, most: int) -> dict[str, list[dict[str, Any]]]:
    async with open_fleet(registry.load()) as fleet:
        started = await gateway.start(fleet)
        key = await gateway.add_key(fleet, "gpu-bench")
        url = started["targets"][0]["base_url"].removesuffix("/v1")
        host = fleet.record.hosts(names=[host_name])[0]
        direct = fleet.server(host)
        # the gateway serves chat and the model list alone: the call is fitted to the host (its /props and
        # /tokenize), the levels then run through each path as run_bench runs them
        call, _ = await fit_call(direct, load_call(), slots_started=host.slots)
        rows = {}
        for path, server in (("gateway", Server(url, key, fleet.tls)), ("host", direct)):
            found, one = [], None
            for n in levels_up_to(most):
                level = await run_level(server, call, n, WAVES, 1, MAX_TOKENS, one)
                one = one or level.decode_per_caller_tok_s
                found.append(level.as_dict())
            rows[path] = found
        return rows


async def calls(
    host_name: str,
    levels: list[int],
    speakers: list[int],
    turns: int,
    max_tokens: int,
    keep: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """The `calls` mode's rows: calls in conversation (fleet/probes/conversation.py, each call named so the
    gateway pins it) at each of `levels` through `fleet gateway` and then directly on the same host, one path
    after the other at each level; then speakers (every caller speaking at once, no gap) at each of `speakers`
    on both paths, for the gateway's added first content and its throughput ratio. Levels past the host's
    slots are left out: a call beyond them shares a slot and loses its cache. `keep` gets the rows so far after
    every level: a run cut by the machine's limit still brings back the levels it finished."""
    async with open_fleet(registry.load()) as fleet:
        host = fleet.record.hosts(names=[host_name])[0]
        profile = fleet.settings.profile(host.model)
        started = await gateway.start(fleet)
        key = await gateway.add_key(fleet, "gpu-bench-calls")
        target = next(t for t in started["targets"] if t["model"] == host.model)
        url = target["base_url"].removesuffix("/v1")
        direct = fleet.server(host)
        call, slots = await fit_call(
            direct, load_call().with_system_chars(profile.probes.system_chars), slots_started=host.slots
        )
        paths = (("gateway", Server(url, key, fleet.tls)), ("host", direct))
        rows: dict[str, Any] = {"host": host_name, "slots": slots, "usd_per_hour": host.effective_usd_per_hour}
        rows["calls"] = {path: [] for path, _ in paths}
        rows["speakers"] = {path: [] for path, _ in paths}
        gap = profile.voice.turn_gap_s
        for n in (n for n in levels if n <= slots):
            for path, server in paths:
                level = await converse(server, call, n, turns, max_tokens, gap, slots, named=True)
                rows["calls"][path].append(level.as_dict())
                print(f"calls {n} via {path}: {level.as_dict()}", flush=True)
                keep(rows)
        for n in (n for n in speakers if n <= slots):
            for path, server in paths:
                level = await run_level(server, call, n, WAVES, 1, max_tokens, None)
                rows["speakers"][path].append(level.as_dict())
                print(f"speakers {n} via {path}: {level.as_dict()}", flush=True)
                keep(rows)
        await gateway.stop(fleet)
        return rows
