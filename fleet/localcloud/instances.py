"""The local marketplace's state and operations; the HTTP layer (api.py) only maps requests here.

State lives in one directory: `state.json` (instances, SSH keys, charges, next ids), `api_key`
(mode 600), `faults.json`, and `hosts/<id>/` for each live host. Every mutation is saved before
the call returns, so `fleet` commands see the same instances across restarts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.localcloud import catalog, network, procs, query
from fleet.localcloud.faults import FaultDice, Faults, HeartbeatGap
from fleet.localcloud.hosts import HostError, LocalHost
from fleet.localcloud.ratelimit import DAILY_SEARCH_QUOTA, RateLimiter

log = logging.getLogger("fleet.localcloud")

PORT_KEY = re.compile(r"^-p (\d{1,5}):(\d{1,5})(/tcp|/udp)?$")
MAX_PORTS = 64  # vast.ai: "a limit of 64 total open ports per container"
MAX_LIST_LIMIT = 25
STARTING_CREDIT_USD = 100.0


class ApiError(Exception):
    """An error answered with vast.ai's body shape: {"success": false, "error": ..., "msg": ...}."""

    def __init__(self, status: int, error: str, msg: str, **extra: Any) -> None:
        super().__init__(msg)
        self.status = status
        self.body = {"success": False, "error": error, "msg": msg, **extra}


@dataclass
class CloudSettings:
    """How the cloud behaves. The defaults are vast.ai's hardest documented forms (docs/vast-fidelity.md),
    with boot phases shortened from minutes to seconds. `kind` turns off the time-based hardships (rate
    limits, read lag, late SSH keys, heartbeat gaps) for tests that say why; the structure (NAT, SSH,
    environment, error shapes, money) never changes."""

    state_dir: Path
    offers_dir: Path
    llama_server: Path | None = None
    provision_delay_s: float = 0.6  # null -> scheduling -> created, a third each
    loading_delay_s: float = 1.0
    hub_bytes_per_s: int = 4 * 1024 * 1024  # per connection, like a CDN edge
    kind: bool = False

    @property
    def read_lag_s(self) -> float:
        """How long a new instance stays invisible to show and list."""
        return 0.0 if self.kind else 3.0

    @property
    def key_lag_s(self) -> float:
        """How long after `running` the account's SSH keys reach the host (auth fails meanwhile)."""
        return 0.0 if self.kind else 1.5


@dataclass
class Instance:
    id: int
    offer: dict[str, Any]
    label: str | None
    image: str
    env: dict[str, str]
    onstart: str | None
    disk: float
    runtype: str
    created_at: float
    token: str
    private_ip: str  # the host's own address; its processes bind here, unreachable but through mappings
    internal_ssh_port: int  # sshd on the private address (the container's port 22)
    ssh_port: int  # the SSH proxy's port on PROXY_HOST (vast.ai's ssh_host/ssh_port)
    ports: dict[str, int]  # container port ("22/tcp", "8000/tcp", "70000/tcp") -> external port
    authorized_keys: list[str]  # the account's keys at create time (vast.ai applies no later one)
    status: str | None = None
    status_msg: str | None = None
    running_at: float | None = None
    intended_status: str = "running"

    @property
    def machine_id(self) -> int:
        return int(self.offer["machine_id"])

    @property
    def dph_total(self) -> float:
        return float(self.offer["dph_total"])

    @property
    def ssh_mode(self) -> bool:
        return "ssh" in self.runtype or "jupyter" in self.runtype

    def targets(self) -> dict[str, int]:
        """Container port -> the port its process binds on the private address. An identity port
        (above 65535) is bound at its external number, as `$VAST_TCP_PORT_70000` tells the container."""
        found = {}
        for key, external in self.ports.items():
            number = int(key.split("/")[0])
            if key == "22/tcp":
                found[key] = self.internal_ssh_port
            elif number > 65535:
                found[key] = external
            else:
                found[key] = number
        return found


@dataclass
class Charge:
    instance_id: int
    label: str | None
    start: float
    end: float | None
    dph_total: float
    kind: str = "gpu"  # gpu: the whole hourly price while it runs; storage: the disk alone while stopped

    def amount(self, now: float) -> float:
        return self.dph_total * ((self.end or now) - self.start) / 3600.0


@dataclass
class State:
    next_instance_id: int = 1001
    next_key_id: int = 1
    instances: dict[int, Instance] = field(default_factory=dict)
    ssh_keys: list[dict[str, Any]] = field(default_factory=list)
    charges: list[Charge] = field(default_factory=list)
    offer_overrides: dict[int, dict[str, Any]] = field(default_factory=dict)
    removed_offers: list[int] = field(default_factory=list)
    destroyed: list[int] = field(default_factory=list)  # ids that existed: show answers them as gone


class Cloud:
    def __init__(self, settings: CloudSettings) -> None:
        self.settings = settings
        self.state_dir = settings.state_dir
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        self.api_key = self._load_or_make_key()
        self.offers = catalog.load_offers(settings.offers_dir)
        self.state = self._load_state()
        self.faults = self._load_faults()
        self.dice = FaultDice()
        self._tasks: dict[int, list[asyncio.Task]] = {}
        self._hosts: dict[int, LocalHost] = {}
        self._networks: dict[int, network.HostNetwork] = {}
        self.limiter = RateLimiter(scale=0.0 if settings.kind else 1.0)
        if self.faults.search_quota_left is not None:
            self.limiter.set_search_quota_left(self.faults.search_quota_left)

    # ---- persistence -------------------------------------------------------------------
    @property
    def api_key_file(self) -> Path:
        return self.state_dir / "api_key"

    def _load_or_make_key(self) -> str:
        if self.api_key_file.exists():
            return self.api_key_file.read_text().strip()
        key = secrets.token_hex(32)
        fd = os.open(self.api_key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        return key

    def _load_state(self) -> State:
        path = self.state_dir / "state.json"
        if not path.exists():
            return State()
        raw = json.loads(path.read_text())
        return State(
            next_instance_id=raw["next_instance_id"],
            next_key_id=raw["next_key_id"],
            instances={int(k): Instance(**v) for k, v in raw["instances"].items()},
            ssh_keys=raw["ssh_keys"],
            charges=[Charge(**c) for c in raw["charges"]],
            offer_overrides={int(k): v for k, v in raw.get("offer_overrides", {}).items()},
            removed_offers=raw.get("removed_offers", []),
            destroyed=raw.get("destroyed", []),
        )

    def save(self) -> None:
        s = self.state
        raw = {
            "next_instance_id": s.next_instance_id,
            "next_key_id": s.next_key_id,
            "instances": {str(k): vars(v) for k, v in s.instances.items()},
            "ssh_keys": s.ssh_keys,
            "charges": [vars(c) for c in s.charges],
            "offer_overrides": {str(k): v for k, v in s.offer_overrides.items()},
            "removed_offers": s.removed_offers,
            "destroyed": s.destroyed,
        }
        _write_json_atomic(self.state_dir / "state.json", raw)

    def _load_faults(self) -> Faults:
        path = self.state_dir / "faults.json"
        return Faults.from_dict(json.loads(path.read_text())) if path.exists() else Faults()

    def set_faults(self, data: dict[str, Any]) -> None:
        self.faults = Faults.from_dict(data)
        self.limiter.set_search_quota_left(
            self.faults.search_quota_left if self.faults.search_quota_left is not None else DAILY_SEARCH_QUOTA
        )
        _write_json_atomic(self.state_dir / "faults.json", self.faults.to_dict())

    # ---- offers ----------------------------------------------------------------------
    def catalogue(self) -> list[dict[str, Any]]:
        removed = set(self.state.removed_offers)
        return [
            {**o, **self.state.offer_overrides.get(int(o["id"]), {})}
            for o in self.offers
            if int(o["id"]) not in removed
        ]

    def taken_gpu_ids(self) -> dict[int, set[int]]:
        taken: dict[int, set[int]] = {}
        for inst in self.state.instances.values():
            taken.setdefault(inst.machine_id, set()).update(inst.offer.get("gpu_ids") or [])
        return taken

    def search(self, body: Any) -> list[dict[str, Any]]:
        try:
            return catalog.search(self.catalogue(), body, self.taken_gpu_ids())
        except query.QueryError as e:
            raise ApiError(400, "invalid_args", f"Invalid args: {e}") from None

    def override_offer(self, offer_id: int, fields: dict[str, Any]) -> dict[str, Any]:
        if not any(int(o["id"]) == offer_id for o in self.offers):
            raise ApiError(404, "no_such_ask", f"no_such_ask Instance type by id {offer_id} is not available.")
        self.state.offer_overrides.setdefault(offer_id, {}).update(fields)
        self.save()
        return next(o for o in self.catalogue() if int(o["id"]) == offer_id)

    # ---- instances ----------------------------------------------------------------------
    def create(self, offer_id: int, body: dict[str, Any]) -> int:
        if not isinstance(body, dict):
            raise ApiError(400, "invalid_args", "Invalid args: invalid json body", ask_id=offer_id)
        image = body.get("image")
        if not isinstance(image, str) or not image or len(image) > 1024:
            raise ApiError(400, "invalid_args", "Invalid args: 'image' is required", ask_id=offer_id)
        try:
            disk = float(body.get("disk", 10))
        except (TypeError, ValueError):
            raise ApiError(400, "invalid_args", "Invalid args: 'disk' must be a number", ask_id=offer_id) from None
        if disk < 8.0:
            raise ApiError(400, "invalid_args", "Invalid args: 'disk' must be at least 8 GB", ask_id=offer_id)
        env = body.get("env") or {}
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise ApiError(400, "invalid_args", "Invalid args: 'env' must be an object of strings", ask_id=offer_id)
        label = body.get("label")
        if label is not None and (not isinstance(label, str) or len(label) > 256):
            raise ApiError(
                400, "invalid_args", "Invalid args: 'label' must be a string of at most 256 characters", ask_id=offer_id
            )
        onstart = body.get("onstart")
        if onstart is not None and not isinstance(onstart, str):
            raise ApiError(400, "invalid_args", "Invalid args: 'onstart' must be a string", ask_id=offer_id)
        runtype = body.get("runtype") or "ssh"
        if not isinstance(runtype, str):
            raise ApiError(400, "invalid_args", "Invalid args: 'runtype' must be a string", ask_id=offer_id)

        container_ports: list[str] = []
        plain_env: dict[str, str] = {}
        for key, value in env.items():
            if key.startswith("-p "):
                m = PORT_KEY.match(key)
                if not m or not 0 < int(m.group(2)) < 100_000:
                    raise ApiError(400, "invalid_args", f"Invalid args: bad port mapping {key!r}", ask_id=offer_id)
                container_ports.append(f"{int(m.group(2))}{m.group(3) or '/tcp'}")
            elif key.startswith("-"):
                continue  # other docker options (-h, -v, ...) mean nothing here
            else:
                plain_env[key] = value
        direct_ssh = "ssh_direc" in runtype or "22/tcp" in container_ports
        if direct_ssh and "22/tcp" not in container_ports:
            container_ports.insert(0, "22/tcp")
        if len(container_ports) > MAX_PORTS:
            raise ApiError(400, "invalid_args", f"Invalid args: at most {MAX_PORTS} open ports", ask_id=offer_id)

        gone = ApiError(
            404,
            "invalid_args",
            f"error 404/3603: no_such_ask Instance type by id {offer_id} is not available.",
            ask_id=offer_id,
        )
        if offer_id in self.faults.vanish_at_create:
            self.faults.vanish_at_create.remove(offer_id)
            self.state.removed_offers.append(offer_id)
            self.save()
            raise gone
        offer = next((o for o in self.catalogue() if int(o["id"]) == offer_id), None)
        if offer is None:
            raise gone
        taken = self.taken_gpu_ids().get(int(offer["machine_id"]), set())
        if taken & set(offer.get("gpu_ids") or []) or not offer.get("rentable", True):
            raise ApiError(
                410,
                "no_such_ask",
                f"error 410/3907: no_such_ask Instance type {offer_id} is no longer available.",
                ask_id=offer_id,
            )

        priced = catalog.priced(offer, disk)
        factor = self.faults.reprice_at_create.pop(offer_id, None)
        if factor is not None:
            priced = catalog.priced({**offer, "dph_base": float(offer.get("dph_base", 0.0)) * factor}, disk)

        instance_id = self.state.next_instance_id
        self.state.next_instance_id += 1
        private_ip = network.private_address()
        inst = Instance(
            id=instance_id,
            offer=priced,
            label=label,
            image=image,
            env=plain_env,
            onstart=onstart,
            disk=disk,
            runtype=runtype,
            created_at=time.time(),
            token=secrets.token_hex(16),
            private_ip=private_ip,
            internal_ssh_port=network.internal_ssh_port(private_ip),
            ssh_port=network.free_port(network.PROXY_HOST),
            ports={key: network.free_port() for key in container_ports},
            authorized_keys=[k["public_key"] for k in self.state.ssh_keys if not k.get("deleted_at")],
        )
        self.state.instances[instance_id] = inst
        self.state.charges.append(Charge(instance_id, label, inst.created_at, None, inst.dph_total))
        self.save()
        self.start_host(inst)
        log.info("created instance %s on offer %s (machine %s)", instance_id, offer_id, inst.machine_id)
        if self.faults.create_error_with_contract > 0:
            # vast.ai can answer a create with an error while the contract was made; the body names it.
            self.faults.create_error_with_contract -= 1
            raise ApiError(
                200,
                "internal_error",
                f"error 500/4410: instance {instance_id} was created but could not be confirmed; retry later",
                new_contract=instance_id,
            )
        return instance_id

    def host_for(self, inst: Instance) -> LocalHost:
        """The instance's host; one object per instance, so it remembers the PIDs it spawned."""
        if inst.id not in self._hosts:
            self._hosts[inst.id] = LocalHost(
                directory=self.state_dir / "hosts" / str(inst.id),
                token=inst.token,
                private_ip=inst.private_ip,
                ssh_port=inst.internal_ssh_port,
                llama_server=self.settings.llama_server,
                frozen_server=inst.machine_id in self.faults.freeze_server,
            )
        return self._hosts[inst.id]

    def container_env(self, inst: Instance) -> dict[str, str]:
        """The container's environment (PID 1 and onstart see it; SSH sessions do not)."""
        env = dict(inst.env)
        for key, port in inst.ports.items():
            number, proto = key.split("/")
            env[f"VAST_{proto.upper()}_PORT_{number}"] = str(port)
        env.update(
            CONTAINER_ID=str(inst.id),
            VAST_CONTAINERLABEL=f"C.{inst.id}",
            PUBLIC_IPADDR=network.PUBLIC_HOST,
            GPU_COUNT=str(inst.offer.get("num_gpus") or 1),
            SSH_PUBLIC_KEY=inst.authorized_keys[-1] if inst.authorized_keys else "",
        )
        return env

    def start_host(self, inst: Instance) -> None:
        """Boot the instance's host: null -> scheduling -> created -> loading -> running, as the faults allow."""
        boot = asyncio.get_running_loop().create_task(self._boot(inst), name=f"boot-{inst.id}")
        self._tasks.setdefault(inst.id, []).append(boot)

    def _set_status(self, inst: Instance, status: str | None, msg: str | None) -> None:
        inst.status, inst.status_msg = status, msg
        self.save()

    async def _boot(self, inst: Instance, restart: bool = False) -> None:
        # Never cancelled: each step runs in a thread that a cancel would not stop, so after each one
        # the boot looks whether the instance was destroyed meanwhile and, if so, ends what it started.
        third = self.settings.provision_delay_s / 3
        steps = ((None, None), ("scheduling", "Scheduling instance"), ("created", "Container created"))
        for status, msg in steps[1:] if restart else steps:
            self._set_status(inst, status, msg)
            await asyncio.sleep(third)
            if inst.id not in self.state.instances:
                return
        if inst.machine_id in self.faults.oci_error:
            self._set_status(
                inst,
                "created",
                "Error response from daemon: failed to create task for container: failed to create shim task: "
                "OCI runtime create failed: runc create failed: unable to start container process: "
                "error during container init: nvidia-container-cli: initialization error",
            )
            return
        self._set_status(inst, "loading", f"Pulling image {inst.image}")
        host = self.host_for(inst)
        env = self.container_env(inst)
        boot_steps = [host.prepare, host.start_platform_sshd if inst.ssh_mode else lambda: host.start_entrypoint(env)]
        if not await self._host_steps(inst, boot_steps):
            return
        if inst.machine_id in self.faults.stuck_loading:
            return
        await asyncio.sleep(self.settings.loading_delay_s)
        if inst.id not in self.state.instances:
            return
        net = self._network(inst)
        await net.start()
        if inst.id not in self.state.instances:
            await net.stop()
            return
        inst.running_at = time.time()
        self._set_status(inst, "running", f"success, running {inst.image}/{'ssh' if inst.ssh_mode else 'args'}")
        watch = asyncio.get_running_loop().create_task(self._watch(inst), name=f"watch-{inst.id}")
        self._tasks.setdefault(inst.id, []).append(watch)
        # The platform's init installs the account's keys (late: "if authentication fails, try again after
        # a few seconds") and then runs onstart.
        await asyncio.sleep(self.settings.key_lag_s)
        if inst.id not in self.state.instances:
            return
        later = []
        if inst.ssh_mode:
            later.append(lambda: host.install_keys(inst.authorized_keys))
        if inst.onstart:
            later.append(lambda: host.run_onstart(inst.onstart or "", env))
        await self._host_steps(inst, later)

    async def _host_steps(self, inst: Instance, steps: list) -> bool:
        host = self.host_for(inst)
        for step in steps:
            try:
                await asyncio.to_thread(step)
            except HostError as e:
                log.error("instance %s failed to boot: %s", inst.id, e)
                self._set_status(inst, "exited", f"Error: {e}")
                return False
            finally:
                if inst.id not in self.state.instances:
                    await asyncio.to_thread(host.remove)
            if inst.id not in self.state.instances:
                return False
        return True

    def _network(self, inst: Instance) -> network.HostNetwork:
        if inst.id not in self._networks:
            targets = inst.targets()
            mappings = [
                network.Mapping(network.PUBLIC_HOST, external, inst.private_ip, targets[key])
                for key, external in inst.ports.items()
                if key.endswith("/tcp")
            ]
            if inst.ssh_mode:
                mappings.append(
                    network.Mapping(network.PROXY_HOST, inst.ssh_port, inst.private_ip, inst.internal_ssh_port)
                )
            self._networks[inst.id] = network.HostNetwork(mappings)
        return self._networks[inst.id]

    async def _watch(self, inst: Instance) -> None:
        """Apply the host faults that act on a running instance: exit, disappear, decode sag."""
        period = 0.1
        while inst.id in self.state.instances and inst.status == "running":
            running_for = time.time() - (inst.running_at or time.time())
            exit_after = self.faults.exit_after_s.get(inst.machine_id)
            if exit_after is not None and running_for >= exit_after:
                await asyncio.to_thread(self.host_for(inst).stop)
                await self._network(inst).stop()
                self._set_status(inst, "exited", "container exited unexpectedly")
                return
            vanish_after = self.faults.disappear_after_s.get(inst.machine_id)
            if vanish_after is not None and running_for >= vanish_after:
                await self._forget(inst.id)
                return
            offline_after = self.faults.offline_after_s.get(inst.machine_id)
            if offline_after is not None and running_for >= offline_after:
                # the host's network is gone (its processes run on, unreachable): every connection drops
                await self._network(inst).stop()
                self._set_status(inst, "offline", "host is offline")
                return
            if inst.machine_id in self.faults.host_key_change:
                self.faults.host_key_change.remove(inst.machine_id)
                await asyncio.to_thread(self.host_for(inst).new_host_key)
            sag = self.faults.decode_sag.get(inst.machine_id)
            share = sag.stop_share(running_for) if sag else 0.0
            if share > 0:
                pids = _llama_server_pids(inst.token)
                procs.pause(pids)
                await asyncio.sleep(period * share)
                procs.resume(pids)
                await asyncio.sleep(period * (1 - share))
            else:
                await asyncio.sleep(period)

    def _visible(self, inst: Instance, now: float) -> bool:
        """vast.ai's read path lags its create: a new instance is not shown or listed for a few seconds."""
        return now - inst.created_at >= self.settings.read_lag_s

    def get(self, instance_id: int) -> dict[str, Any] | None:
        """Show one instance. Not there (unknown, destroyed, or not yet visible): `{"instances": null}`
        or a 404, as vast.ai answers either."""
        inst = self.state.instances.get(instance_id)
        if inst is not None and self._visible(inst, time.time()):
            return self.row(inst)
        if instance_id % 2 and (inst is not None or instance_id in self.state.destroyed):
            raise ApiError(404, "no_such_instance", f"Instance {instance_id} not found.")
        return None

    def list_rows(self, params: dict[str, str]) -> dict[str, Any]:
        try:
            select_filters = json.loads(params.get("select_filters", "{}") or "{}")
            order_by = json.loads(params.get("order_by", "[]") or "[]")
            limit = query.parse_limit(json.loads(params.get("limit", "25")), 25, MAX_LIST_LIMIT)
            after = params.get("after_token")
            after_id = int(json.loads(after)) if after not in (None, "", "null") else None
            if not isinstance(select_filters, dict) or not isinstance(order_by, list):
                raise query.QueryError("select_filters must be an object and order_by a list")
            query.validate_filters(select_filters)
        except (ValueError, TypeError) as e:
            raise ApiError(400, "invalid_args", f"Invalid args: {e}") from None
        if limit <= 0:
            limit = 5
        for col in select_filters:
            if col in ("dph_total", "num_gpus"):
                raise ApiError(400, "invalid_args", f"Invalid args: cannot filter on computed column {col}")
        now = time.time()
        visible = [i for i in sorted(self.state.instances.values(), key=lambda i: i.id) if self._visible(i, now)]
        rows = [self.row(i) for i in visible]
        try:
            rows = [r for r in rows if query.matches(r, select_filters)]
        except query.QueryError as e:
            raise ApiError(400, "invalid_args", f"Invalid args: {e}") from None
        order = [(o.get("col", "id"), o.get("dir") == "desc") for o in order_by if isinstance(o, dict)]
        rows = query.sort_rows(rows, [*order, ("id", False)])
        if after_id is not None:
            index = next((n for n, r in enumerate(rows) if r["id"] == after_id), None)
            rows = rows[index + 1 :] if index is not None else []
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

    def manage(self, instance_id: int, body: Any) -> dict[str, Any]:
        inst = self.state.instances.get(instance_id)
        if inst is None:
            raise ApiError(404, "no_such_instance", f"Instance {instance_id} not found.")
        if not isinstance(body, dict):
            raise ApiError(400, "invalid_args", "Invalid args: invalid json body")
        if "label" in body:
            label = body["label"]
            if not isinstance(label, str) or len(label) > 1024:
                raise ApiError(
                    400,
                    "label_too_long" if isinstance(label, str) else "invalid_args",
                    "label must be a string of at most 1024 characters",
                )
            inst.label = label
            for charge in self.state.charges:
                if charge.instance_id == instance_id:
                    charge.label = label
            self.save()
            return {"success": True, "msg": f"label for {instance_id} set to '{label}'"}
        if "state" in body:
            if body["state"] not in ("running", "stopped"):
                raise ApiError(400, "invalid_args", "Invalid args: state must be running or stopped")
            if body["state"] != inst.intended_status:
                inst.intended_status = body["state"]
                self.save()
                step = self._stop if body["state"] == "stopped" else self._start
                task = asyncio.get_running_loop().create_task(step(inst), name=f"{body['state']}-{inst.id}")
                self._tasks.setdefault(inst.id, []).append(task)
            return {"success": True}
        raise ApiError(400, "invalid_args", "Invalid args: nothing to change")

    async def _stop(self, inst: Instance) -> None:
        """Stop: the host's processes end and its network goes, its disk stays; the GPU price stops and the
        disk's goes on (vast.ai: "Disk charges continue; no GPU charges")."""
        while inst.id in self.state.instances and self._booting(inst):
            await asyncio.sleep(0.1)  # a boot in flight ends first: its steps cannot be cut short
        if inst.id not in self.state.instances or inst.intended_status != "stopped" or inst.status == "stopped":
            return
        await asyncio.to_thread(self.host_for(inst).stop)
        net = self._networks.pop(inst.id, None)
        if net is not None:
            await net.stop()
        now = time.time()
        for charge in self.state.charges:
            if charge.instance_id == inst.id and charge.end is None:
                charge.end = now
        disk = float(inst.offer.get("storage_total_cost") or 0.0)
        self.state.charges.append(Charge(inst.id, inst.label, now, None, disk, kind="storage"))
        inst.running_at = None
        self._set_status(inst, "stopped", "Instance stopped")
        log.info("stopped instance %s", inst.id)

    def _booting(self, inst: Instance) -> bool:
        return any(t.get_name() == f"boot-{inst.id}" and not t.done() for t in self._tasks.get(inst.id, []))

    async def _start(self, inst: Instance) -> None:
        """Start a stopped instance: it waits in `scheduling` while its machine's GPU is taken, then boots
        through the platform's init and onstart again, on its kept disk, with new external ports (a
        restarted container is mapped anew); the GPU price runs again."""
        while inst.id in self.state.instances and inst.status != "stopped":
            if inst.intended_status != "running":
                return
            await asyncio.sleep(0.1)  # a stop in flight ends first
        if inst.id not in self.state.instances or inst.intended_status != "running":
            return
        self._set_status(inst, "scheduling", "Scheduling instance: waiting for the machine's GPU")
        while inst.machine_id in self.faults.gpu_taken:
            await asyncio.sleep(0.2)
            if inst.id not in self.state.instances or inst.intended_status != "running":
                return
        now = time.time()
        for charge in self.state.charges:
            if charge.instance_id == inst.id and charge.end is None:
                charge.end = now
        self.state.charges.append(Charge(inst.id, inst.label, now, None, inst.dph_total))
        inst.ssh_port = network.free_port(network.PROXY_HOST)
        inst.ports = {key: network.free_port() for key in inst.ports}
        boot = asyncio.current_task()
        if boot is not None:
            boot.set_name(f"boot-{inst.id}")  # a stop now waits for this boot, as for the first one
        await self._boot(inst, restart=True)

    async def destroy(self, instance_id: int) -> None:
        if instance_id not in self.state.instances:
            raise ApiError(404, "no_such_instance", f"Instance {instance_id} not found.")
        await self._forget(instance_id)

    async def _forget(self, instance_id: int) -> None:
        """Remove the instance: its boot and watch tasks, its forwarders, every process of its host, its directory."""
        inst = self.state.instances.pop(instance_id, None)
        if inst is None:
            return
        self.state.destroyed.append(instance_id)
        for task in self._tasks.pop(instance_id, []):
            if task is not asyncio.current_task() and task.get_name().startswith("watch-"):
                task.cancel()
        net = self._networks.pop(instance_id, None)
        if net is not None:
            await net.stop()
        await asyncio.to_thread(self.host_for(inst).remove)
        self._hosts.pop(instance_id, None)
        now = time.time()
        for charge in self.state.charges:
            if charge.instance_id == instance_id and charge.end is None:
                charge.end = now
        self.save()
        log.info("destroyed instance %s", instance_id)

    def _heartbeat(self, inst: Instance, now: float) -> str | None:
        """`offline`/`unknown` while the host's heartbeat is late, or None. A fault names a machine; without
        one, every third instance of a strict cloud misses its heartbeat once, soon after it runs."""
        if inst.status != "running" or inst.running_at is None:
            return None
        gap = self.faults.heartbeat_gap.get(inst.machine_id)
        if gap is None and not self.settings.kind and inst.id % 3 == 0:
            gap = HeartbeatGap(after_s=2.0, for_s=3.0, status="offline" if inst.id % 2 else "unknown")
        if gap and gap.after_s <= now - inst.running_at < gap.after_s + gap.for_s:
            return gap.status
        return None

    def row(self, inst: Instance) -> dict[str, Any]:
        """The instance as vast.ai's show-instance answers it."""
        o = inst.offer
        running = inst.status == "running"
        now = time.time()
        _, b, c, d = inst.private_ip.split(".")
        return {
            "id": inst.id,
            "actual_status": self._heartbeat(inst, now) or inst.status,
            "intended_status": inst.intended_status,
            "cur_state": "stopped" if inst.status == "stopped" else "running",
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
            "public_ipaddr": network.PUBLIC_HOST,
            "local_ipaddrs": f"10.{b}.{c}.{d} 172.17.0.1 \n",  # the machine's LAN: unreachable from outside
            "ports": self._listed_ports(inst) if running else None,
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
            "credit_balance": self.credit(),
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

    @staticmethod
    def _listed_ports(inst: Instance) -> dict[str, list[dict[str, str]]]:
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

    # ---- account -----------------------------------------------------------------------
    def credit(self) -> float:
        now = time.time()
        return STARTING_CREDIT_USD - sum(c.amount(now) for c in self.state.charges)

    def user(self) -> dict[str, Any]:
        return {
            "id": 1,
            "username": "local",
            "email": "local@localcloud.invalid",
            "credit": self.credit(),
            "balance": 0.0,
            "ssh_key": next((k["public_key"] for k in reversed(self.state.ssh_keys) if not k.get("deleted_at")), None),
            "host_agreement_accepted": False,
            "sid": None,
        }

    def charges(self, select_filters: dict[str, Any]) -> dict[str, Any]:
        day = select_filters.get("day") if isinstance(select_filters, dict) else None
        if not isinstance(day, dict) or "gte" not in day or "lte" not in day:
            raise ApiError(400, "invalid_args", "Must provide both 'day' gte and lte filters for instance charges")
        now = time.time()
        results = []
        for c in self.state.charges:
            end = c.end or now
            if end < float(day["gte"]) or c.start > float(day["lte"]):
                continue
            hours = (end - c.start) / 3600.0
            results.append(
                {
                    "start": c.start,
                    "end": end,
                    "type": "instance",
                    "source": f"instance-{c.instance_id}",
                    "description": f"Instance {c.instance_id} Charges",
                    "amount": c.amount(now),
                    "metadata": {"label": c.label, "instance_id": c.instance_id, "ongoing": c.end is None},
                    "items": [
                        {
                            "type": c.kind,
                            "description": f"{hours:.3f} hours at ${c.dph_total:.4f}/hour",
                            "amount": c.amount(now),
                        }
                    ],
                }
            )
        return {"success": True, "count": len(results), "total": len(results), "next_token": None, "results": results}

    def add_ssh_key(self, body: Any) -> dict[str, Any]:
        key = body.get("ssh_key") if isinstance(body, dict) else None
        if not isinstance(key, str) or not key.strip():
            raise ApiError(400, "invalid_args", "No ssh key provided")
        if not re.match(r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-\S+) [A-Za-z0-9+/=]+( .*)?$", key.strip()):
            raise ApiError(400, "invalid_args", "Invalid ssh key")
        entry = {
            "id": self.state.next_key_id,
            "user_id": 1,
            "public_key": key.strip(),
            "key": key.strip(),
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "deleted_at": None,
        }
        self.state.next_key_id += 1
        self.state.ssh_keys.append(entry)
        self.save()
        return entry

    def ssh_keys(self) -> list[dict[str, Any]]:
        """The account's keys, deleted ones with their `deleted_at`; an account that never had one: 404."""
        if not self.state.ssh_keys:
            raise ApiError(404, "not_found", "No SSH keys found for this account.")
        return self.state.ssh_keys

    def delete_ssh_key(self, key_id: int) -> None:
        key = next((k for k in self.state.ssh_keys if k["id"] == key_id and not k.get("deleted_at")), None)
        if key is None:
            raise ApiError(404, "not_found", f"ssh key {key_id} not found")
        key["deleted_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.save()

    def gpu_names(self) -> list[str]:
        return sorted({o["gpu_name"] for o in self.offers})

    # ---- whole cloud -----------------------------------------------------------------------
    async def resume_hosts(self) -> None:
        """After a restart, boot again every instance that was live (as a host reboot would)."""
        for inst in list(self.state.instances.values()):
            if inst.status not in ("exited", "stopped"):
                inst.status, inst.running_at = None, None
                self.start_host(inst)
        self.save()

    async def shutdown(self) -> None:
        """Stop every host's processes; the instances stay recorded, as when a region loses power."""
        for tasks in self._tasks.values():
            for task in tasks:
                task.cancel()
        for net in self._networks.values():
            await net.stop()
        self._networks.clear()
        # A boot step already in a thread still finishes (and may start sshd): wait for those threads,
        # then end every host's processes.
        await asyncio.get_running_loop().shutdown_default_executor()
        for inst in self.state.instances.values():
            self.host_for(inst).stop()
        self.save()


def _llama_server_pids(token: str) -> list[int]:
    pids = []
    for pid in procs.pids_with_marker(token):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "llama-server":
                pids.append(pid)
        except OSError:
            continue
    return pids


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
