#!/usr/bin/env python3
"""Capture fleet's own nvidia-smi query on a real NVIDIA GPU, idle and under load, as a test fixture.

Run on a GPU machine from the repository root: `OUT=dir python3 scripts/capture_nvidia_smi.py`.
It runs exactly the query the thermal probe sends (fleet/probes/gpu.py QUERY) once a second for about
25 s, with 12 s of back-to-back bf16 matrix products (PyTorch) in the middle, writes the raw output to
$OUT/query.csv, and parses it with fleet's parser to show it reads. Needs nothing of fleet's
dependencies: gpu.py is standard library only.
"""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleet.probes.gpu import QUERY, parse_query_csv


def load(seconds: float) -> None:
    import torch

    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.time() + seconds
    n = 0
    while time.time() < end:
        x @ x
        n += 1
        if n % 20 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()


def main() -> None:
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    header, rows = None, []
    worker = threading.Timer(6.0, load, args=(12.0,))
    worker.start()
    for _ in range(25):
        text = subprocess.run(QUERY, capture_output=True, text=True, check=True).stdout.splitlines()
        header = header or text[0]
        rows += text[1:]
        time.sleep(1.0)
    worker.join()
    raw = "\n".join([header or "", *rows]) + "\n"
    (out / "query.csv").write_text(raw)
    (out / "command.txt").write_text(" ".join(QUERY) + "\n")
    samples = parse_query_csv(raw)
    print(
        f"{len(samples)} samples; GPU {min(s.gpu_c for s in samples)}-{max(s.gpu_c for s in samples)} C; "
        f"power up to {max(s.power_w for s in samples)} W; power-capped samples "
        f"{sum(1 for s in samples if s.sw_power_cap)}; fan {samples[0].fan_pct}"
    )


if __name__ == "__main__":
    main()
