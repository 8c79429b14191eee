"""The local marketplace's state and operations; the HTTP layer (api.py) only maps requests here.

State lives in one directory: `state.json` (state.py), `api_key` (mode 600), `faults.json`, and
`hosts/<id>/` for each live host. Every mutation is saved before the call returns, so `fleet` commands see
the same instances across restarts. Booting hosts is boot.py's, stopping and starting them power.py's,
the money billing.py's, and the rows vast.ai answers rows.py's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

from fleet.localcloud import billing, catalog, network, query, rows, toolchain
from fleet.localcloud.apierror import NO_SUCCESS, ApiError
from fleet.localcloud.billing import Charge
from fleet.localcloud.faults import FaultDice, Faults, late_heartbeat
from fleet.localcloud.hosts import LocalHost
from fleet.localcloud.hub import Link
from fleet.localcloud.instances import Instance, parse_create, pull_error
from fleet.localcloud.logs import InstanceLogs
from fleet.localcloud.power import Power
from fleet.localcloud.ratelimit import DAILY_SEARCH_QUOTA, RateLimiter
from fleet.localcloud.sshkeys import SshKeys
from fleet.localcloud.state import CloudSettings, StateWriter, load_state, write_json_atomic
from fleet.localcloud.steps import StepsInFlight

log = logging.getLogger("fleet.localcloud")


__all__ = ["ApiError", "Cloud", "CloudSettings"]


class Cloud(Power, SshKeys):
    def __init__(self, settings: CloudSettings) -> None:
        self.settings = settings
        self.state_dir = settings.state_dir
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        self.api_key = self._load_or_make_key()
        self.offers = catalog.load_offers(settings.offers_dir)
        self.state = load_state(self.state_dir / "state.json")
        self.writer = StateWriter(self.state_dir / "state.json", self.state)
        self.balance = billing.Balance(self.state.charges)
        self.faults = self._load_faults()
        self.dice = FaultDice()
        self._tasks: dict[int, list[asyncio.Task]] = {}
        self._hosts: dict[int, LocalHost] = {}
        self.logs = InstanceLogs()
        self._networks: dict[int, network.HostNetwork] = {}
        self._steps = StepsInFlight()
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

    def save(self) -> None:
        self.writer.mark()

    def _load_faults(self) -> Faults:
        path = self.state_dir / "faults.json"
        return Faults.from_dict(json.loads(path.read_text())) if path.exists() else Faults()

    def set_faults(self, data: dict[str, Any]) -> None:
        self.faults = Faults.from_dict(data)
        self.limiter.set_search_quota_left(
            self.faults.search_quota_left if self.faults.search_quota_left is not None else DAILY_SEARCH_QUOTA
        )
        write_json_atomic(self.state_dir / "faults.json", self.faults.to_dict())

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
            if inst.cur_state != "stopped":  # "Stopped instances have no GPU reservation" (docker-environment)
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
    def _missing_engine(self, image: str) -> str | None:
        """This machine's own limit, not vast.ai's: a vLLM image needs scripts/setup-vllm's vLLM to run. Looked
        for at each create, so that a cloud started before scripts/setup-vllm finished takes it once it has."""
        if toolchain.image_engine(image) != "vllm":
            return None
        if self.settings.vllm_python is None:
            self.settings.vllm_python = toolchain.vllm_python_path()
        if self.settings.vllm_python is None:
            return f"the local cloud cannot run {image[:80]}: vLLM is not installed here (run scripts/setup-vllm)"
        return None

    def create(self, offer_id: int, body: dict[str, Any]) -> int:
        asked = parse_create(offer_id, body)
        self.refuse_without_credit(offer_id)
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
        ended = isinstance(offer.get("end_date"), int | float) and offer["end_date"] <= time.time()
        if taken & set(offer.get("gpu_ids") or []) or not offer.get("rentable", True) or ended:
            raise ApiError(
                410,
                "no_such_ask",
                f"error 410/3907: no_such_ask Instance type {offer_id} is no longer available.",
                ask_id=offer_id,
            )

        priced = catalog.priced(offer, asked.disk)
        factor = self.faults.reprice_at_create.pop(offer_id, None)
        if factor is not None:
            priced = catalog.priced({**offer, "dph_base": float(offer.get("dph_base", 0.0)) * factor}, asked.disk)

        instance_id = self.state.next_instance_id
        self.state.next_instance_id += 1
        private_ip = network.private_address()
        inst = Instance(
            id=instance_id,
            offer=priced,
            label=asked.label,
            image=asked.image,
            env=asked.env,
            onstart=asked.onstart,
            disk=asked.disk,
            runtype=asked.runtype,
            created_at=time.time(),
            token=secrets.token_hex(16),
            private_ip=private_ip,
            internal_ssh_port=network.internal_ssh_port(private_ip),
            ssh_port=network.free_port(network.PROXY_HOST),
            ports={key: network.free_port() for key in asked.container_ports},
            authorized_keys=[k["public_key"] for k in self.state.ssh_keys if not k.get("deleted_at")],
            pull_error=pull_error(
                asked.image, asked.image_login, self.faults.missing_images, self.faults.private_images
            )
            or self._missing_engine(asked.image),
        )
        self.state.instances[instance_id] = inst
        # the disk bills from create; the GPU only once it runs (vast.ai: "not charged during loading")
        disk = float(priced.get("storage_total_cost") or 0.0)
        self.state.charges.append(Charge(instance_id, asked.label, inst.created_at, None, disk, kind="storage"))
        self.state.charges.append(
            Charge(
                instance_id,
                asked.label,
                inst.created_at,
                None,
                0.0,
                kind="bandwidth",
                usd_per_gb_down=float(priced.get("inet_down_cost") or 0.0),
                usd_per_gb_up=float(priced.get("inet_up_cost") or 0.0),
            )
        )
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

    def _visible(self, inst: Instance, now: float) -> bool:
        """vast.ai's read path lags its create: a new instance is not shown or listed for a few seconds."""
        lag = self.faults.read_lag_s if self.faults.read_lag_s is not None else self.settings.read_lag_s
        return now - inst.created_at >= lag

    def get(self, instance_id: int) -> dict[str, Any] | None:
        """Show one instance. Not yet visible: `{"instances": null}` or a 404. Destroyed: each form vast.ai
        answers, by id: null, a 404, or its last row saying `destroyed` (vast-cli's fixtures and self-test)."""
        inst = self.state.instances.get(instance_id)
        if inst is not None and self._visible(inst, time.time()):
            return self.row(inst, time.time())
        if instance_id in self.state.destroyed:
            if instance_id % 3 == 1:
                raise ApiError(404, "no_such_instance", f"Instance {instance_id} not found.")
            return self.state.destroyed_rows.get(instance_id)
        if instance_id % 2 and inst is not None:
            raise ApiError(404, "no_such_instance", f"Instance {instance_id} not found.")
        return None

    def list_rows(self, params: dict[str, str]) -> dict[str, Any]:
        now = time.time()
        visible = [i for i in sorted(self.state.instances.values(), key=lambda i: i.id) if self._visible(i, now)]
        return rows.list_page(visible, lambda i: self.row(i, now), params)

    def row(self, inst: Instance, now: float) -> dict[str, Any]:
        """The instance as vast.ai's show-instance answers it, now."""
        row = rows.instance_row(
            inst, late_heartbeat(self.faults, inst, not self.settings.kind, now) or inst.status, self.credit(), now
        )
        other = self.state.instances.get(self.faults.lying_ports.get(inst.machine_id, -1))
        if other is not None and row["ports"]:  # its listing names another instance's ports but its SSH
            lent = {k: v for k, v in rows.listed_ports(other).items() if not k.startswith("22/")}
            row["ports"] = {**row["ports"], **lent}
        return row

    def manage(self, instance_id: int, body: Any) -> dict[str, Any]:
        inst = self.state.instances.get(instance_id)
        if inst is None or not self._visible(inst, time.time()):  # writes lag a create as reads do
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
            if body["state"] == "running" and inst.intended_status != "running":
                self.refuse_without_credit()
                if inst.expired or inst.contract_ended(time.time()):
                    inst.expired = True
                    raise ApiError(400, "invalid_args", f"Instance {instance_id} has expired and cannot restart.")
            self.set_state(inst, body["state"])
            return {"success": True}
        raise ApiError(400, "invalid_args", "Invalid args: nothing to change")

    async def destroy(self, instance_id: int) -> None:
        if (inst := self.state.instances.get(instance_id)) is None or not self._visible(inst, time.time()):
            raise ApiError(404, "no_such_instance", f"Instance {instance_id} not found.", shape=NO_SUCCESS)
        await self._forget(instance_id)

    async def _forget(self, instance_id: int) -> None:
        """Remove the instance: its boot and watch tasks, its forwarders, every process of its host, its directory."""
        inst = self.state.instances.pop(instance_id, None)
        if inst is None:
            return
        self.state.destroyed.append(instance_id)
        if instance_id % 3 == 2:  # show goes on answering its last row, saying it is destroyed
            gone = {"actual_status": "destroyed", "intended_status": "destroyed", "next_state": "destroyed"}
            self.state.destroyed_rows[instance_id] = {
                **self.row(inst, time.time()),
                **gone,
                "cur_state": "unloaded",
                "ports": None,
            }
        for task in self._tasks.pop(instance_id, []):
            if task is not asyncio.current_task() and task.get_name().startswith("watch-"):
                task.cancel()
        net = self._networks.pop(instance_id, None)
        if net is not None:
            await net.stop()
        await self._steps.ended(instance_id)  # the boot takes no step after it: the instance is gone
        await asyncio.to_thread(self.host_for(inst).remove)
        self._hosts.pop(instance_id, None)
        billing.close_open(self.state.charges, instance_id, time.time(), kinds=("gpu", "storage", "bandwidth"))
        self.save()
        log.info("destroyed instance %s", instance_id)

    # ---- account -----------------------------------------------------------------------
    def credit(self) -> float:
        return self.balance.left(self.faults.credit_usd)

    def count_traffic(self, instance_id: int, down: int = 0, up: int = 0) -> None:
        """Bytes the instance received and sent: billed at its offer's $/GB whatever its state."""
        charge = self.balance.traffic(instance_id)  # in the balance within its period: no sum again for each piece
        if charge is not None:
            charge.bytes_down += down
            charge.bytes_up += up

    def link_of(self, address: str) -> Link | None:
        """The live instance whose host has this address, with its offer's download speed: the hub serves a
        host no faster than its link (`inet_down`, Mbit/s)."""
        for inst in self.state.instances.values():
            if inst.private_ip == address:
                mbps = inst.offer.get("inet_down")
                rate = float(mbps) * 1e6 / 8 if isinstance(mbps, int | float) and mbps > 0 else None
                return Link(inst.id, rate)
        return None

    def refuse_without_credit(self, offer_id: int | None = None) -> None:
        """vast.ai rents nothing to an account whose credit is spent."""
        if self.credit() <= 0:
            extra = {"ask_id": offer_id} if offer_id is not None else {}
            raise ApiError(
                400, "insufficient_credit", "Insufficient credit: add credit to your account to rent", **extra
            )

    # ---- logs ---------------------------------------------------------------------------------
    def request_logs(self, instance_id: int, tail: int) -> str:
        if (inst := self.state.instances.get(instance_id)) is None:
            raise ApiError(404, "no_such_instance", f"Instance {instance_id} not found.")
        console = inst.machine_id not in self.faults.logs_without_console
        return self.logs.request(inst, self.state_dir / "hosts" / str(instance_id), console, tail)

    def user(self) -> dict[str, Any]:
        # show_user.yaml's fields (id, key_id, email, balance, ssh_key, sid): no `credit`, which only the
        # authentication guide's example shows; the credit left is the balance (the harder reading)
        return {
            "id": 1,
            "key_id": 1,
            "username": "local",
            "email": "local@localcloud.invalid",
            "balance": self.credit(),
            "ssh_key": next((k["public_key"] for k in reversed(self.state.ssh_keys) if not k.get("deleted_at")), None),
            "host_agreement_accepted": False,
            "sid": None,
        }

    def charges(self, select_filters: dict[str, Any]) -> dict[str, Any]:
        return billing.charges_page(self.state.charges, select_filters)

    def gpu_names(self) -> list[str]:
        return sorted({o["gpu_name"] for o in self.offers})

    # ---- whole cloud -----------------------------------------------------------------------
    async def resume_hosts(self) -> None:
        """After a restart, boot again every instance that was live (as a host reboot would)."""
        for inst in list(self.state.instances.values()):
            if inst.status not in ("exited", "stopped") and inst.cur_state != "stopped":
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
            self.host_for(inst).shut_down()
        self.save()
        self.writer.flush()
