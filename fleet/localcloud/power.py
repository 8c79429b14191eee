"""Stop and start, and a contract's end, as vast.ai does them: a stopped instance's processes end and its
network goes, its disk stays, the GPU's price stops and the disk's runs on; a start waits in `scheduling` while
its machine's GPU is taken, then boots through the platform's init again on new external ports; a contract
ends on its date, its host may move that date forward, and an expired instance is deleted 48 h later; a
machine's announced maintenance takes it down for its window."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fleet.localcloud import billing, network
from fleet.localcloud.apierror import ApiError
from fleet.localcloud.billing import Charge
from fleet.localcloud.boot import Booting
from fleet.localcloud.instances import Instance

log = logging.getLogger("fleet.localcloud")


STOP_FORMS = ("exited", "stopped", "offline")
EXPIRED_KEPT_S = 48 * 3600  # vast.ai deletes an expired instance this long after its contract ended
# vast.ai lets a balance go below zero by "a short grace period ... calculated based on your account's average
# daily spend" before it deletes the instances of an account with no card; its share is not published
CREDIT_BUFFER_DAYS = 0.25


class Power(Booting):
    """The part of the Cloud that stops and starts instances (PUT /instances/{id}/ with a state)."""

    def set_state(self, inst: Instance, wanted: str) -> None:
        """Ask for `running` or `stopped`; nothing happens when the instance already intends it."""
        if wanted == inst.intended_status:
            return
        inst.intended_status = wanted
        self.save()
        step = self._stop if wanted == "stopped" else self._start
        task = asyncio.get_running_loop().create_task(step(inst), name=f"{wanted}-{inst.id}")
        self._tasks.setdefault(inst.id, []).append(task)

    async def _stop(self, inst: Instance) -> None:
        """Stop: the host's processes end and its network goes, its disk stays; the GPU price stops and the
        disk's goes on (vast.ai: "Disk charges continue; no GPU charges")."""
        while inst.id in self.state.instances and self._booting(inst):
            await asyncio.sleep(0.1)  # a boot in flight ends first: its steps cannot be cut short
        if inst.id not in self.state.instances or inst.intended_status != "stopped" or inst.cur_state == "stopped":
            return
        await asyncio.to_thread(self.host_for(inst).stop)
        net = self._networks.pop(inst.id, None)
        if net is not None:
            await net.stop()
        now = time.time()
        billing.close_open(self.state.charges, inst.id, now)
        disk = float(inst.offer.get("storage_total_cost") or 0.0)
        self.state.charges.append(Charge(inst.id, inst.label, now, None, disk, kind="storage"))
        inst.running_at = None
        inst.cur_state = "stopped"
        # vast.ai says a stop in more than one way: `exited` (its CLI's status filter knows no `stopped`) or `stopped`
        # with stopped intended (SkyPilot reads both), or only in the contract's states, cur_state, intended_status
        # and next_state all `stopped` (what dstack reads), the container's own status on a machine that no
        # longer hears from it reading `offline`; each instance takes one, by its id
        self._set_status(inst, STOP_FORMS[inst.id % len(STOP_FORMS)], "Instance stopped")
        log.info("stopped instance %s", inst.id)

    def _booting(self, inst: Instance) -> bool:
        return any(t.get_name() == f"boot-{inst.id}" and not t.done() for t in self._tasks.get(inst.id, []))

    async def _start(self, inst: Instance) -> None:
        """Start a stopped instance: it waits in `scheduling` while its machine's GPU is taken, then boots
        through the platform's init and onstart again, on its kept disk, with new external ports (a
        restarted container is mapped anew); the GPU price runs again."""
        while inst.id in self.state.instances and inst.cur_state != "stopped":
            if inst.intended_status != "running":
                return
            await asyncio.sleep(0.1)  # a stop in flight ends first
        if inst.id not in self.state.instances or inst.intended_status != "running":
            return
        self._set_status(inst, "scheduling", "Scheduling instance: waiting for the machine's GPU")
        while inst.machine_id in self.faults.gpu_taken or self._gpu_held_by_another(inst):
            await asyncio.sleep(0.2)
            if inst.id not in self.state.instances or inst.intended_status != "running":
                return
        inst.cur_state = "running"  # scheduled: the GPU is its again, billed once it runs (boot.py)
        inst.ssh_port = network.free_port(network.PROXY_HOST)
        inst.ports = {key: network.free_port() for key in inst.ports}
        boot = asyncio.current_task()
        if boot is not None:
            boot.set_name(f"boot-{inst.id}")  # a stop now waits for this boot, as for the first one
        await self._boot(inst, restart=True)

    def _gpu_held_by_another(self, inst: Instance) -> bool:
        """Another instance (anyone's) holds a GPU of this stopped one's: it rented the machine meanwhile."""
        wanted = set(inst.offer.get("gpu_ids") or [])
        return any(
            other.id != inst.id
            and other.machine_id == inst.machine_id
            and other.cur_state != "stopped"
            and wanted & set(other.offer.get("gpu_ids") or [])
            for other in self.state.instances.values()
        )

    async def delete_unpaid(self) -> None:
        """vast.ai, for an account with no card on file (the local cloud's): once the balance is below zero by
        more than its buffer (fault `credit_buffer_usd`, else a share of its average daily spend), "your
        instances and stored data will be destroyed", stopped ones and their disks with them."""
        if not self.state.instances or (balance := self.credit()) >= 0:
            return  # every API request asks: the buffer is worked out only below zero
        buffer = self.faults.credit_buffer_usd
        if buffer is None:
            buffer = billing.daily_spend(self.state.charges, time.time()) * CREDIT_BUFFER_DAYS
        if balance >= -buffer:
            return
        for inst in list(self.state.instances.values()):
            log.info("instance %s deleted: the balance is %.4f, below the buffer of %.4f", inst.id, balance, buffer)
            await self._forget(inst.id)

    async def retire_expired(self) -> None:
        """vast.ai: "Expired instances may be deleted 48 hours after expiration" (the harder reading: they are,
        disk and all; fault `expired_kept_s` shortens the wait)."""
        now = time.time()
        kept = self.faults.expired_kept_s if self.faults.expired_kept_s is not None else EXPIRED_KEPT_S
        for inst in list(self.state.instances.values()):
            end = inst.offer.get("end_date")
            if isinstance(end, int | float) and now >= end + kept:
                log.info("instance %s expired %.0fs ago: deleted", inst.id, now - end)
                await self._forget(inst.id)

    def extend_contract(self, instance_id: int, end_date: float) -> dict[str, Any]:
        """What a host does when it moves its offer's end forward: the rental runs until then ("Instance contract
        extended"); a rental's end is locked when it is rented, so never sooner."""
        inst = self.state.instances.get(instance_id)
        if inst is None:
            raise ApiError(404, "no_such_instance", f"Instance {instance_id} not found.")
        end = inst.offer.get("end_date")
        if isinstance(end, int | float) and end_date < end:
            raise ApiError(400, "invalid_args", "a rental's end date may move forward only")
        inst.offer = {**inst.offer, "end_date": float(end_date)}
        self.save()
        return {"success": True, "end_date": inst.offer["end_date"]}

    def maintenances(self, machine_ids: list[int]) -> list[dict[str, Any]]:
        """The announced maintenance windows of these machines, as vast.ai lists them (`show maints`)."""
        rows = []
        for machine_id in machine_ids:
            window = self.faults.maintenances.get(machine_id)
            if window is not None and window[0] + window[1] * 3600 > time.time():
                start, hours = window
                rows.append(
                    {
                        "machine_id": machine_id,
                        "start_time": start,
                        "end_time": start + hours * 3600,
                        "duration_hours": hours,
                        "maintenance_category": "other",
                    }
                )
        return rows
