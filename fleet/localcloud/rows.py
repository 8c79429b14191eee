"""What vast.ai answers about instances: one instance's row (show), and the list endpoint's page (its
filters, order, limit and paging token, its label counts), field for field."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from fleet.localcloud import network, query
from fleet.localcloud.apierror import NO_SUCCESS, ApiError
from fleet.localcloud.instances import Instance

MAX_LIST_LIMIT = 25
T = TypeVar("T")


def list_page(
    visible: list[Instance], row_of: Callable[[Instance], dict[str, Any]], params: dict[str, str]
) -> dict[str, Any]:
    """The list endpoint's answer: the rows (`row_of`) of the `visible` instances (by id) filtered, sorted and
    paged as `params` ask, with vast.ai's limits and errors."""

    # its 400s say `invalid_request` (or `invalid_token` for a cursor) in a body without `success` (vast.ai's
    # OpenAPI show_instances.yaml)
    def refused(what: object, error: str = "invalid_request") -> ApiError:
        return ApiError(400, error, f"Error in query parameters: {what}", shape=NO_SUCCESS)

    try:
        after = params.get("after_token")
        after_id = int(json.loads(after)) if after not in (None, "", "null") else None
    except (ValueError, TypeError):
        raise refused("after_token is not a token of this listing", "invalid_token") from None
    try:
        select_filters = json.loads(params.get("select_filters", "{}") or "{}")
        order_by = json.loads(params.get("order_by", "[]") or "[]")
        limit = query.parse_limit(json.loads(params.get("limit", "25")), 25, MAX_LIST_LIMIT)
        if not isinstance(select_filters, dict) or not isinstance(order_by, list):
            raise query.QueryError("select_filters must be an object and order_by a list")
        query.validate_filters(select_filters)
    except (ValueError, TypeError) as e:
        raise refused(e) from None
    if limit <= 0:
        limit = 5
    for col in select_filters:
        if col in ("dph_total", "num_gpus"):
            raise refused(f"{col} is not a valid search key")
    order = [(o.get("col", "id"), o.get("dir") == "desc") for o in order_by if isinstance(o, dict)]
    # rows are made only for the instances a page may hold where the instances alone say which (a filter on the
    # id, an order by id): a listing of 1,000 instances in 40 pages made 40,000 rows
    by_id = set(select_filters) <= {"id"} and all(col == "id" and not desc for col, desc in order)
    try:
        candidates = [i for i in visible if query.matches({"id": i.id}, select_filters)] if by_id else visible
        if by_id:
            candidates = _after(candidates, after_id, lambda i: i.id)[: limit + 1]
        rows = [r for r in map(row_of, candidates) if query.matches(r, select_filters)]
    except query.QueryError as e:
        raise refused(e) from None
    rows = query.sort_rows(rows, [*order, ("id", False)])
    if not by_id:
        rows = _after(rows, after_id, lambda r: r["id"])
    page = rows[:limit]
    more = len(rows) > limit
    labels: dict[str, int] = {}
    for inst in visible:
        labels[inst.label or ""] = labels.get(inst.label or "", 0) + 1
    return {
        "success": True,
        "instances_found": len(page),
        "total_instances": len(visible),
        "label_counts": labels,
        "next_token": json.dumps(page[-1]["id"]) if more and page else None,
        "instances": page,
    }


def _after(items: list[T], after_id: int | None, id_of: Callable[[T], int]) -> list[T]:
    """What follows the paging token's id; nothing when that id is not listed (anymore)."""
    if after_id is None:
        return items
    index = next((n for n, item in enumerate(items) if id_of(item) == after_id), None)
    return items[index + 1 :] if index is not None else []


def instance_row(inst: Instance, actual_status: str | None, credit: float, now: float) -> dict[str, Any]:
    """The instance as vast.ai's show-instance answers it; `actual_status` as the platform reads it now (a late
    heartbeat reads offline)."""
    o = inst.offer
    running = inst.status == "running"
    _, b, c, d = inst.private_ip.split(".")
    return {
        "id": inst.id,
        "actual_status": actual_status,
        "intended_status": inst.intended_status,
        "cur_state": inst.cur_state,
        "next_state": inst.intended_status,
        "status_msg": inst.status_msg,
        "label": inst.label,
        "machine_id": inst.machine_id,
        "host_id": o.get("host_id"),
        "bundle_id": o.get("bundle_id"),
        "image_uuid": inst.image,
        "image_args": [],
        "image_runtype": inst.runtype,
        "extra_env": [[k, v] for k, v in inst.env.items()]
        + [[f"-p {k.split('/')[0]}:{k.split('/')[0]}", "1"] for k in inst.ports if k != "22/tcp"],
        "onstart": inst.onstart,
        "jupyter_token": None,
        "template_id": None,
        "template_hash_id": None,
        "template_name": None,
        "ssh_host": network.PROXY_HOST if inst.ssh_mode else None,
        "ssh_idx": str(inst.id % 10000),
        "ssh_port": inst.ssh_port if inst.ssh_mode else None,
        "machine_dir_ssh_port": inst.ssh_port,
        "public_ipaddr": inst.public_ip,
        "local_ipaddrs": f"10.{b}.{c}.{d} 172.17.0.1 \n",  # the machine's LAN: unreachable from outside
        "ports": listed_ports(inst) if running else None,
        "direct_port_start": min(inst.ports.values(), default=-1),
        "direct_port_end": max(inst.ports.values(), default=-1),
        "direct_port_count": o.get("direct_port_count"),
        "num_gpus": o.get("num_gpus"),
        "gpu_name": o.get("gpu_name"),
        "gpu_ram": o.get("gpu_ram"),
        "gpu_totalram": o.get("gpu_total_ram"),
        "gpu_arch": o.get("gpu_arch"),
        "gpu_frac": o.get("gpu_frac"),
        "gpu_lanes": o.get("gpu_lanes"),
        "gpu_mem_bw": o.get("gpu_mem_bw"),
        "bw_nvlink": o.get("bw_nvlink"),
        "gpu_util": 0.0 if running else None,
        "gpu_temp": None,
        "cpu_util": 0.0,
        "cpu_cores": o.get("cpu_cores"),
        "cpu_cores_effective": o.get("cpu_cores_effective"),
        "cpu_name": o.get("cpu_name"),
        "cpu_ram": o.get("cpu_ram"),
        "cpu_arch": o.get("cpu_arch"),
        "mem_usage": None,
        "mem_limit": None,
        "vmem_usage": None,
        "disk_space": inst.disk,
        "disk_usage": 0.0,
        "disk_util": 0.0,
        "disk_bw": o.get("disk_bw"),
        "disk_name": o.get("disk_name"),
        "inet_up": o.get("inet_up"),
        "inet_down": o.get("inet_down"),
        "inet_up_cost": o.get("inet_up_cost"),
        "inet_down_cost": o.get("inet_down_cost"),
        "start_date": inst.created_at,
        "end_date": o.get("end_date"),
        "duration": o.get("duration"),
        "uptime_mins": (now - inst.running_at) / 60 if inst.running_at and running else None,
        "dph_base": o.get("dph_base"),
        "dph_total": inst.dph_total,
        "search": o.get("search"),
        "instance": o.get("instance"),
        "storage_cost": o.get("storage_cost"),
        "storage_total_cost": o.get("storage_total_cost"),
        "vram_costperhour": o.get("vram_costperhour"),
        "min_bid": o.get("min_bid"),
        "is_bid": False,
        "credit_balance": credit,
        "credit_discount": None,
        "credit_discount_max": o.get("credit_discount_max"),
        "reliability2": o.get("reliability2"),
        "verification": o.get("verification"),
        "geolocation": o.get("geolocation"),
        "static_ip": o.get("static_ip"),
        "rentable": False,
        "hosting_type": o.get("hosting_type"),
        "score": o.get("score"),
        "dlperf": o.get("dlperf"),
        "total_flops": o.get("total_flops"),
        "os_version": o.get("os_version"),
        "mobo_name": o.get("mobo_name"),
        "pci_gen": o.get("pci_gen"),
        "pcie_bw": o.get("pcie_bw"),
        "cuda_max_good": o.get("cuda_max_good"),
        "driver_version": o.get("driver_version"),
        "logo": o.get("logo"),
        "webpage": None,
        "external": o.get("external"),
        "client_run_time": 0.0,
        "host_run_time": 0.0,
        "time_remaining": "",
        "time_remaining_isbid": "",
    }


def listed_ports(inst: Instance) -> dict[str, list[dict[str, str]]]:
    """`ports` as Docker reports it: container port -> [{"HostIp": "0.0.0.0", "HostPort": "<external>"}].
    Docker cannot map a port above 65535, so an identity port is listed under its external number
    (even instance ids) or not at all (odd ids, as in vast.ai's own example instance)."""
    listed = {}
    for key, external in inst.ports.items():
        number, proto = key.split("/")
        if int(number) > 65535:
            if inst.id % 2:
                continue
            key = f"{external}/{proto}"
        listed[key] = [{"HostIp": "0.0.0.0", "HostPort": str(external)}]
    return listed
