"""The benchmark session report, end to end: a host brought up, probed for heat and benched on the local
cloud, then `fleet report` writes the HTML page and the markdown summary; a real headless Chromium
renders the page, its three plots are there, and neither file holds a key."""

import json
import os
import re
import shutil
import subprocess
import sys
from datetime import timedelta

import pytest

from fleet.control.up import UpRequest
from fleet.core.models import utcnow
from fleet.economics import report
from tests.fleetkit import fleet_for, settings_for, write_config

CHROMIUM = shutil.which("chromium-headless-shell") or shutil.which("chromium")


def chromium(*args: str) -> subprocess.CompletedProcess:
    assert CHROMIUM, "no headless Chromium: scripts/setup installs chromium-headless-shell"
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", *args], capture_output=True, text=True, timeout=120
    )


async def test_the_session_report_renders_in_a_browser_with_its_plots_and_no_key(cloud, local_cloud_env, tmp_path):
    async with fleet_for(settings_for(tmp_path)) as fleet:
        host = (await fleet.up(UpRequest("tiny", "eu"))).ready[0]
        host_key = fleet.api_key(host)
        try:
            [thermal] = await fleet.probe(host.name, only=["thermal"])
            await fleet.bench(host.name, max_callers=1, waves=1, warmup=0, max_tokens=16)
        finally:
            await fleet.destroy(None)
    env = {**os.environ, "FLEET_CONFIG": str(write_config(tmp_path))}
    out = tmp_path / "session"
    made = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "report", "--since", "1h", "--out", str(out), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    answer = json.loads(made.stdout)
    [row] = answer["hosts"]
    assert (row["host"], row["capacity"], row["state"]) == (host.name, ">=1", "destroyed")
    assert row["usd_per_voice_minute"] > 0 and row["session_usd"] == pytest.approx(answer["total_usd"])
    # the verdicts the record holds (a tiny host's thermal verdict moves with this machine's load)
    assert f"thermal {'pass' if thermal.passed else 'FAIL'}" in row["probes"] and "smoke pass" in row["probes"]

    page, summary = (out / "report.html").read_text(), (out / "report.md").read_text()
    assert f"| {host.name} | llama-server | 1x {host.gpu_name} |" in summary
    for secret in (host_key, cloud.info.api_key()):
        assert secret not in page and secret not in summary

    dom = chromium("--dump-dom", (out / "report.html").as_uri())
    assert dom.returncode == 0, dom.stderr[-500:]
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', dom.stdout)
    titles = ["What callers feel, by concurrent callers", "Thermal series", "Cost over time"]
    assert [alt for alt, _ in images] == titles
    assert all(len(data) > 10_000 for _, data in images)  # drawn plots, not empty frames
    shot = tmp_path / "page.png"
    rendered = chromium(f"--screenshot={shot}", "--window-size=1200,1800", (out / "report.html").as_uri())
    assert rendered.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_report_input_is_one_line_and_writes_nothing(tmp_path):
    env = {**os.environ, "FLEET_CONFIG": str(write_config(tmp_path))}
    for args, message in [
        (["--since", "yesterday"], "--since 'yesterday': give 30m, 6h, 2d or an ISO date"),
        (["--out", str(tmp_path / "fleet.toml")], "exists and is not a folder"),
    ]:
        bad = subprocess.run(
            [sys.executable, "-m", "fleet.cli", "report", "--out", str(tmp_path / "r"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode == 2 and message in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_since_reads_relative_and_iso_times():
    now = utcnow()
    assert report.parse_since("6h", now) == now - timedelta(hours=6)
    assert report.parse_since("30m", now) == now - timedelta(minutes=30)
    assert report.parse_since("2026-12-01T09:00", now).isoformat() == "2026-12-01T09:00:00+00:00"
