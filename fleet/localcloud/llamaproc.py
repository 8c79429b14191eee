"""Running the locally built llama-server outside any host (tests of the tiny models, benchmarks)."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from fleet.localcloud.network import free_port

LAST_WORDS = 8  # lines of a server's log that failing to start repeats


@dataclass(frozen=True)
class Served:
    url: str  # the base URL
    pid: int  # the server's process (its threads are under /proc/PID/task)


@contextmanager
def llama_server(
    binary: Path,
    model: Path,
    *flags: str,
    timeout_s: float = 20.0,
    tls: ssl.SSLContext | None = None,
    log: Path | None = None,
) -> Iterator[str]:
    """Serve `model` on a free loopback port in its own process group; yield the base URL; end it. With
    `tls` (the flags carry --ssl-key-file and --ssl-cert-file), the URL is https:// and checked with it; with
    `log`, what the server prints goes there."""
    with serving(binary, model, *flags, timeout_s=timeout_s, tls=tls, log=log) as served:
        yield served.url


@contextmanager
def serving(
    binary: Path,
    model: Path,
    *flags: str,
    timeout_s: float = 20.0,
    tls: ssl.SSLContext | None = None,
    log: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[Served]:
    """llama_server's process, with its PID beside the URL; `env`: variables set for it beside ours."""
    port = free_port()
    with log.open("w") if log else open(os.devnull, "w") as out:
        process = subprocess.Popen(
            [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *flags],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **env} if env else None,
        )
    base = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1, verify=tls or True).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                # its last words say why (a bench on a borrowed machine brings back its error, not the log)
                said = log.read_text(errors="replace").strip().splitlines()[-LAST_WORDS:] if log else []
                raise RuntimeError("\n".join([f"llama-server did not come up on {base}", *said]))
            time.sleep(0.05)
        yield Served(base, process.pid)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
