"""The local cloud's server process: `python -m fleet.localcloud.server --state-dir DIR`.

It writes `server.json` (url, pid and the process's start time) into the state directory once it listens, and on SIGTERM
stops every host's processes before it exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path

from aiohttp import web

from fleet.localcloud import cardmodel, procs, replicas, toolchain
from fleet.localcloud.api import build_app
from fleet.localcloud.cloud import Cloud, CloudSettings
from fleet.localcloud.hub import Hub
from fleet.localcloud.state import write_json_atomic

DEFAULT_OFFERS_DIR = toolchain.REPO_ROOT / "offers"


async def serve(settings: CloudSettings, host: str, port: int, publish: list[tuple[str, Path]] = ()) -> None:
    cloud = Cloud(settings)
    hub = Hub(
        settings.state_dir / "hub",
        settings.hub_bytes_per_s,
        lambda: cloud.faults,
        links=cloud.link_of,
        on_download=lambda instance_id, n: cloud.count_traffic(instance_id, down=n),
    )
    await asyncio.to_thread(hub.publish_tiny_models)
    await asyncio.to_thread(hub.publish_replicas, toolchain.cache_dir() / "replicas" / f"v{replicas.REPLICA_FORMAT}")
    await asyncio.to_thread(hub.publish_hf_replica, toolchain.cache_dir() / "replicas" / "hf-nvfp4-v1")
    for repo, directory in publish:
        await asyncio.to_thread(hub.publish_directory, repo, directory)
    runner = web.AppRunner(build_app(cloud, hub), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    await cloud.resume_hosts()
    write_json_atomic(
        settings.state_dir / "server.json",
        {"url": f"http://{host}:{bound}", "pid": os.getpid(), "started": procs.identity(os.getpid()), "port": bound},
    )
    logging.getLogger("fleet.localcloud").info("listening on http://%s:%s", host, bound)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await cloud.shutdown()
    await runner.cleanup()
    (settings.state_dir / "server.json").unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the fleet local cloud server")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--offers-dir", type=Path, default=DEFAULT_OFFERS_DIR)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--provision-delay", type=float, default=0.6)
    parser.add_argument("--loading-delay", type=float, default=1.0)
    parser.add_argument("--hub-bytes-per-s", type=int, default=4 * 1024 * 1024)
    parser.add_argument(
        "--kind", action="store_true", help="no rate limits, read lag, late SSH keys or heartbeat gaps (tests only)"
    )
    parser.add_argument(
        "--simulated-card",
        choices=cardmodel.models(),
        help="every host simulated in this process, decoding as this model on the card measured (issue 48)",
    )
    parser.add_argument(
        "--publish", action="append", default=[], metavar="OWNER/REPO=DIR", help="serve DIR's GGUF files as this repo"
    )
    args = parser.parse_args(argv)
    publish = []
    for item in args.publish:
        repo, sep, directory = item.partition("=")
        if not sep or repo.count("/") != 1 or not Path(directory).is_dir():
            parser.error(f"--publish {item!r}: expected OWNER/REPO=DIR with DIR a directory")
        publish.append((repo, Path(directory)))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = CloudSettings(
        state_dir=args.state_dir,
        offers_dir=args.offers_dir,
        llama_server=toolchain.llama_server_path(),
        vllm_python=toolchain.vllm_python_path(),
        provision_delay_s=args.provision_delay,
        loading_delay_s=args.loading_delay,
        hub_bytes_per_s=args.hub_bytes_per_s,
        kind=args.kind,
        simulated_card=args.simulated_card,
    )
    asyncio.run(serve(settings, args.host, args.port, publish))


if __name__ == "__main__":
    main()
