"""nvidia-smi telemetry: the query fleet asks for and a parser for its CSV.

Real output carries units inside the values (`1470 MHz`, `692.30 W`, `100 %`), `[N/A]` for fields the
card lacks (those stay None, never zero), the throttle reasons as a hex mask and as `Active` /
`Not Active`. Columns are found by the header, so their order does not matter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FIELDS = (
    "timestamp,name,pstate,temperature.gpu,temperature.memory,clocks.sm,clocks.mem,clocks.max.sm,"
    "clocks.max.mem,power.draw,power.limit,clocks_event_reasons.active,"
    "clocks_event_reasons.hw_thermal_slowdown,clocks_event_reasons.sw_thermal_slowdown,"
    "clocks_event_reasons.sw_power_cap,utilization.gpu,utilization.memory,memory.used,memory.total,fan.speed"
)
QUERY = ["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv"]
_HEADER_ALIASES = {
    "clocks.current.sm": "clocks.sm",
    "clocks.current.memory": "clocks.mem",
    "clocks.max.memory": "clocks.max.mem",
    "clocks_throttle_reasons.active": "clocks_event_reasons.active",
}
_MISSING = {"[n/a]", "n/a", "[not supported]", "[unknown error]", ""}


@dataclass(frozen=True)
class GpuSample:
    timestamp: str
    index: int
    name: str | None
    pstate: str | None
    gpu_c: float | None
    memory_c: float | None
    sm_mhz: float | None
    mem_mhz: float | None
    max_sm_mhz: float | None
    max_mem_mhz: float | None
    power_w: float | None
    power_limit_w: float | None
    throttle_mask: int | None
    hw_thermal_slowdown: bool | None
    sw_thermal_slowdown: bool | None
    sw_power_cap: bool | None
    util_gpu_pct: float | None
    util_mem_pct: float | None
    mem_used_mib: float | None
    mem_total_mib: float | None
    fan_pct: float | None


class GpuParseError(ValueError):
    pass


def _number(value: str | None) -> float | None:
    if value is None or value.strip().lower() in _MISSING:
        return None
    m = re.match(r"^\s*(-?\d+(?:\.\d+)?)", value)
    if not m:
        raise GpuParseError(f"not a number: {value!r}")
    return float(m.group(1))


def _flag(value: str | None) -> bool | None:
    if value is None or value.strip().lower() in _MISSING:
        return None
    v = value.strip().lower()
    if v in ("active", "yes"):
        return True
    if v in ("not active", "no"):
        return False
    raise GpuParseError(f"not a flag: {value!r}")


def _mask(value: str | None) -> int | None:
    if value is None or value.strip().lower() in _MISSING:
        return None
    try:
        return int(value.strip(), 16)
    except ValueError:
        raise GpuParseError(f"not a hex mask: {value!r}") from None


def _text(value: str | None) -> str | None:
    return None if value is None or value.strip().lower() in _MISSING else value.strip()


def parse_query_csv(text: str) -> list[GpuSample]:
    """Every sample of `nvidia-smi --query-gpu=... --format=csv` output (header line required)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return []
    header = [re.sub(r"\s*\[.*?\]$", "", h.strip()) for h in lines[0].split(",")]
    header = [_HEADER_ALIASES.get(h, h) for h in header]
    if "temperature.gpu" not in header:
        raise GpuParseError(f"not a --query-gpu CSV header: {lines[0]!r}")
    samples = []
    index_by_time: dict[str, int] = {}
    for line in lines[1:]:
        values = [v.strip() for v in line.split(",")]
        if len(values) != len(header):
            raise GpuParseError(f"{len(values)} values for {len(header)} columns: {line!r}")
        row = dict(zip(header, values, strict=True))
        stamp = row.get("timestamp", "")
        index = index_by_time.get(stamp, 0)
        index_by_time[stamp] = index + 1
        samples.append(
            GpuSample(
                timestamp=stamp,
                index=index,
                name=_text(row.get("name")),
                pstate=_text(row.get("pstate")),
                gpu_c=_number(row.get("temperature.gpu")),
                memory_c=_number(row.get("temperature.memory")),
                sm_mhz=_number(row.get("clocks.sm")),
                mem_mhz=_number(row.get("clocks.mem")),
                max_sm_mhz=_number(row.get("clocks.max.sm")),
                max_mem_mhz=_number(row.get("clocks.max.mem")),
                power_w=_number(row.get("power.draw")),
                power_limit_w=_number(row.get("power.limit")),
                throttle_mask=_mask(row.get("clocks_event_reasons.active")),
                hw_thermal_slowdown=_flag(row.get("clocks_event_reasons.hw_thermal_slowdown")),
                sw_thermal_slowdown=_flag(row.get("clocks_event_reasons.sw_thermal_slowdown")),
                sw_power_cap=_flag(row.get("clocks_event_reasons.sw_power_cap")),
                util_gpu_pct=_number(row.get("utilization.gpu")),
                util_mem_pct=_number(row.get("utilization.memory")),
                mem_used_mib=_number(row.get("memory.used")),
                mem_total_mib=_number(row.get("memory.total")),
                fan_pct=_number(row.get("fan.speed")),
            )
        )
    return samples
