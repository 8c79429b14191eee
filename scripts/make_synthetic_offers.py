#!/usr/bin/env python3
"""Write offers/synthetic-eu-2026-11.json: a made-up, EU-heavy snapshot in the raw
`vastai search offers --raw` format (every field of the real dump beside it), with a few
offers that fail each of fleet's filters. SYNTHETIC: prices and machines are invented.
Deterministic: running it again gives the same file."""

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = json.loads((ROOT / "offers" / "real-vast-a100-sxm4-2026.json").read_text())[0]
GPUS = {  # name: (MB per GPU, compute cap, max power W, mem bw GB/s, TFLOPS)
    "RTX 3090": (24576, 860, 350.0, 936.2, 35.6),
    "RTX 4090": (24564, 890, 450.0, 1008.0, 82.6),
    "RTX A5000": (24564, 860, 230.0, 768.0, 27.8),
    "RTX A6000": (49140, 860, 300.0, 768.0, 38.7),
    "L40S": (46068, 890, 350.0, 864.0, 91.6),
    "RTX A4000": (16376, 860, 140.0, 448.0, 19.2),
    "Tesla V100": (32768, 700, 300.0, 900.0, 15.7),
    "RTX 5090": (32607, 1200, 575.0, 1792.0, 104.8),
    "GH200": (97871, 900, 900.0, 4000.0, 67.0),
}
# (gpu, n, country, dph_base, reliability, cuda, direct ports, inet $/GB, disk GB, verified, why)
ROWS = [
    ("RTX 3090", 1, "Sweden, SE", 0.215, 0.995, 12.8, 12, 0.004, 200, True, "cheapest EU 3090"),
    ("RTX 3090", 1, "Germany, DE", 0.228, 0.991, 13.0, 8, 0.006, 150, True, ""),
    ("RTX 3090", 1, "Netherlands, NL", 0.241, 0.989, 12.9, 20, 0.010, 500, True, ""),
    ("RTX 3090", 1, "Poland, PL", 0.252, 0.986, 12.8, 4, 0.020, 120, True, ""),
    ("RTX 3090", 1, "Czechia, CZ", 0.262, 0.983, 13.0, 30, 0.008, 300, True, ""),
    ("RTX 3090", 1, "Finland, FI", 0.199, 0.962, 12.8, 10, 0.004, 200, True, "low reliability"),
    ("RTX 3090", 1, "Spain, ES", 0.205, 0.993, 12.2, 10, 0.004, 200, True, "old CUDA"),
    ("RTX 3090", 1, "France, FR", 0.207, 0.992, 12.8, 1, 0.004, 200, True, "one direct port"),
    ("RTX 3090", 1, "Italy, IT", 0.209, 0.994, 12.8, 10, 0.120, 200, True, "expensive traffic"),
    ("RTX 3090", 1, "Belgium, BE", 0.211, 0.994, 12.8, 10, 0.004, 60, True, "small disk"),
    ("RTX 3090", 1, "Texas, US", 0.170, 0.996, 12.8, 50, 0.002, 400, True, "not EU"),
    ("RTX 3090", 1, "Romania, RO", 0.190, 0.990, 12.8, 10, 0.004, 200, False, "unverified"),
    ("RTX 4090", 1, "Norway, NO", 0.345, 0.994, 12.9, 16, 0.005, 250, True, ""),
    ("RTX 4090", 1, "United Kingdom, GB", 0.372, 0.990, 13.0, 12, 0.007, 300, True, ""),
    ("RTX 4090", 2, "Germany, DE", 0.690, 0.992, 13.0, 24, 0.006, 800, True, "2x, shares GPUs"),
    ("RTX A5000", 1, "Switzerland, CH", 0.224, 0.987, 12.8, 6, 0.009, 180, True, ""),
    ("RTX A6000", 1, "Austria, AT", 0.438, 0.993, 12.8, 10, 0.005, 400, True, ""),
    ("L40S", 1, "Ireland, IE", 0.781, 0.997, 12.8, 40, 0.003, 1000, True, ""),
    ("L40S", 1, "Quebec, CA", 0.699, 0.996, 12.8, 40, 0.003, 1000, True, "not EU"),
    ("RTX 4090", 1, "Guangdong, CN", 0.280, 0.981, 12.8, 10, 0.010, 200, True, "not EU"),
    ("RTX A4000", 1, "Portugal, PT", 0.142, 0.991, 12.8, 8, 0.005, 150, True, "16 GB: too small for a4b"),
    # (appended, so that the rows above keep their random draws)
    ("Tesla V100", 1, "Germany, DE", 0.120, 0.995, 12.8, 10, 0.004, 200, True, "compute 7.0: not in the image"),
    ("RTX 5090", 1, "Sweden, SE", 0.395, 0.996, 12.9, 16, 0.004, 400, True, "Blackwell, compute 12.0"),
    ("RTX 3090", 1, "Denmark, DK", 0.180, 0.994, 12.8, 10, 0.004, 200, True, "contract ends in 10 h"),
    ("RTX 3090", 1, "Slovakia, SK", 0.185, 0.994, 12.8, 10, 0.004, 200, True, "a 40 Mbit/s link"),
    # Grace Hopper: compute 9.0 passes every GPU filter, but its CPU is arm64, where an amd64 image cannot start
    ("GH200", 1, "Norway, NO", 0.640, 0.996, 12.8, 16, 0.004, 500, True, "arm64"),
    ("GH200", 1, "Sweden, SE", 0.655, 0.995, 12.8, 16, 0.004, 500, True, "arm64"),
    ("GH200", 1, "Germany, DE", 0.670, 0.995, 12.8, 16, 0.004, 500, True, "arm64"),
    # the cheapest EU 3090, with the RAM of a laptop: llama-server's prompt cache and the pull need more
    ("RTX 3090", 1, "Estonia, EE", 0.176, 0.994, 12.8, 10, 0.004, 200, True, "8 GB of RAM"),
]
# What a row's offer says apart from the columns above (its contract's time left, its link's speed).
OVERRIDES = {
    "contract ends in 10 h": {"duration": 36000.0},
    "a 40 Mbit/s link": {"inet_down": 40.0},
    "8 GB of RAM": {"cpu_ram": 8000},
    "arm64": {"cpu_arch": "arm64", "cpu_name": "NVIDIA Grace A02", "cpu_cores": 72, "cpu_cores_effective": 72.0},
}


def main() -> None:
    rng = random.Random(2026)
    offers = []
    machine_id, offer_id, gpu_id = 61000, 29001000, 510000
    for gpu, n, geo, dph_base, rel, cuda, ports, inet, disk, verified, why in ROWS:
        mb, cc, watts, bw, tflops = GPUS[gpu]
        machine_id += rng.randint(3, 40)
        ids = list(range(gpu_id, gpu_id + n))
        gpu_id += n
        # A 2-GPU machine also offers each GPU alone: renting one hides the overlapping offers.
        slices = [ids] + ([[i] for i in ids] if n > 1 else [])
        for gpu_ids in slices:
            offer_id += rng.randint(1, 900)
            k = len(gpu_ids)
            base = round(dph_base * k / n, 4)
            storage_cost = round(rng.uniform(0.08, 0.3), 4)
            row = dict(TEMPLATE)
            row.update(
                {
                    "id": offer_id,
                    "ask_contract_id": offer_id,
                    "bundle_id": offer_id * 3 + 1,
                    "avail_vol_ask_id": offer_id + 2,
                    "machine_id": machine_id,
                    "host_id": 90000 + machine_id % 997,
                    "gpu_name": gpu,
                    "num_gpus": k,
                    "gpu_ids": gpu_ids,
                    "gpu_frac": k / n,
                    "gpu_ram": mb,
                    "gpu_total_ram": mb * k,
                    "compute_cap": cc,
                    "gpu_max_power": watts,
                    "gpu_mem_bw": bw,
                    "total_flops": tflops * k,
                    "gpu_lanes": 16,
                    "bw_nvlink": 0.0,
                    "gpu_display_active": False,
                    "cuda_max_good": cuda,
                    "driver_version": "570.86.15" if cuda < 13 else "580.95.05",
                    "driver_vers": 570086015 if cuda < 13 else 580095005,
                    "cpu_name": "AMD EPYC 7302 16-Core Processor",
                    "cpu_cores": 32 * k // n or 16,
                    "cpu_cores_effective": float(16 * k),
                    "cpu_ram": 64000 * k,
                    "cpu_ghz": 3.0,
                    "disk_space": float(disk),
                    "disk_name": "Samsung SSD 980 PRO 2TB",
                    "disk_bw": 2800.0,
                    "inet_up": round(rng.uniform(300, 900), 1),
                    "inet_down": round(rng.uniform(500, 2000), 1),
                    "inet_up_cost": inet,
                    "inet_down_cost": inet,
                    "internet_up_cost_per_tb": inet * 1024,
                    "internet_down_cost_per_tb": inet * 1024,
                    "direct_port_count": ports,
                    "dph_base": base,
                    "storage_cost": storage_cost,
                    "min_bid": round(base * 0.7, 4),
                    "vram_costperhour": base / (mb * k / 1024),
                    "reliability": rel,
                    "reliability2": rel,
                    "reliability_mult": rel,
                    "verification": "verified" if verified else "unverified",
                    "vericode": 1 if verified else 0,
                    "geolocation": geo,
                    "geolocode": rng.randint(10**8, 10**9),
                    "public_ipaddr": f"192.0.2.{rng.randint(1, 254)}",
                    "hosting_type": 0,
                    "dlperf": round(tflops * k * 1.7, 2),
                    "score": round(rel * 100 * tflops / 40, 3),
                    "start_date": 1795000000.0 + rng.randint(0, 10**6),
                    "end_date": 1810000000.0,
                    "duration": 14000000.0,
                    "os_version": "22.04",
                    "mobo_name": "ROMED8-2T",
                    "pci_gen": 4.0,
                    "pcie_bw": 24.5,
                    "rentable": True,
                    "rented": False,
                }
            )
            row.update(OVERRIDES.get(why, {}))
            # about half of vast.ai's machines list a fixed address (13 of the real A100 dump's 33): here the
            # better-kept ones, drawn from no random number so that every other column stays as it was
            row["static_ip"] = rel >= 0.995
            total = base + storage_cost / 720 * 5
            row["dph_total"] = total
            row["dlperf_per_dphtotal"] = row["dlperf"] / total
            row["flops_per_dphtotal"] = row["total_flops"] / total
            offers.append(row)
    offers.sort(key=lambda r: r["dph_total"])
    out = ROOT / "offers" / "synthetic-eu-2026-11.json"
    out.write_text(json.dumps(offers, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(offers)} offers to {out}")


if __name__ == "__main__":
    main()
