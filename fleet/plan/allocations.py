"""What llama-server says it allocated: the buffer lines it logs at verbosity 4 (`-lv 4`).

llama.cpp logs one line per buffer as it loads, e.g.
    load_tensors:        CUDA0 model buffer size = 13004.65 MiB
    llama_kv_cache:      CUDA0 KV buffer size =   640.00 MiB
    llama_memory_recurrent:  CUDA0 RS buffer size =  47.62 MiB
    sched_reserve:       CUDA0 compute buffer size =   522.01 MiB
A draft model's context logs its own lines after the target's; a draft that reads the target's cache logs
its cache's size but allocates no KV buffer. These are what `fleet plan`'s terms are checked against.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

MIB = 1024**2
_LINE = re.compile(
    r"\s(?P<device>[A-Za-z0-9_]+) (?P<kind>model|KV|RS|compute|output) buffer size =\s*(?P<mib>[\d.]+) MiB"
)
KINDS = ("model", "KV", "RS", "compute", "output")


@dataclass
class Allocations:
    """Bytes per kind of buffer and device, summed over every line (target and draft contexts)."""

    by_kind: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))

    def on(self, kind: str, devices: tuple[str, ...]) -> int:
        """Bytes of `kind` on any of `devices` (e.g. ("CUDA0",) or ("CPU", "CPU_Mapped"))."""
        return sum(v for d, v in self.by_kind.get(kind, {}).items() if d in devices)

    def devices(self) -> set[str]:
        return {d for per in self.by_kind.values() for d in per}


def parse_buffer_lines(log: str) -> Allocations:
    """Sum llama-server's buffer lines by kind and device (pure: tested on recorded logs)."""
    found = Allocations()
    for line in log.splitlines():
        m = _LINE.search(line)
        if m:
            per = found.by_kind[m["kind"]]
            per[m["device"]] = per.get(m["device"], 0) + round(float(m["mib"]) * MIB)
    return found
