"""Booting a rented instance into a real host on this machine, as vast.ai's platform does: null ->
scheduling -> created -> loading -> running, the container's init (sshd for the ssh launch modes, the
account's keys a moment late, onstart with the create call's environment) or its entrypoint, the NAT-style
forwarders, and, while it runs, the faults that act on a running instance (exit, vanish, go offline, a
changed host key, a decode that sags)."""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from pathlib import Path

from fleet.localcloud import billing, cardmodel, disks, network, procs, toolchain
from fleet.localcloud.billing import Charge
from fleet.localcloud.faults import Faults
from fleet.localcloud.hosts import HostError, LocalHost
from fleet.localcloud.instances import Instance
from fleet.localcloud.sag import DutyCycle
from fleet.localcloud.simboot import SimulatedLocalHost
from fleet.localcloud.state import CloudSettings, State
from fleet.localcloud.steps import StepsInFlight

log = logging.getLogger("fleet.localcloud")

MAPPING_TRIES = 5  # fresh external ports for a container whose picked ones were taken meanwhile
WATCH_PERIOD_S = 0.1  # a running instance's faults are looked at this often


class Booting:
    """The part of the Cloud that runs hosts: one LocalHost, one network and the boot and watch tasks per
    live instance."""

    settings: CloudSettings
    state: State
    faults: Faults
    _tasks: dict[int, list[asyncio.Task]]
    _hosts: dict[int, LocalHost | SimulatedLocalHost]
    _networks: dict[int, network.HostNetwork]
    _steps: StepsInFlight

    def save(self) -> None:
        raise NotImplementedError

    def credit(self) -> float:
        raise NotImplementedError

    def count_traffic(self, instance_id: int, down: int = 0, up: int = 0) -> None:
        raise NotImplementedError

    async def _stop(self, inst: Instance) -> None:
        raise NotImplementedError

    def _platform_stop_reason(self, inst: Instance) -> str | None:
        """Why vast.ai stops a running instance on its own now: its contract ended, or the credit is spent."""
        end = inst.offer.get("end_date")
        if isinstance(end, int | float) and time.time() >= end:
            return "expired"
        if self.credit() <= 0:
            return "credit balance is zero"
        return None

    async def _forget(self, instance_id: int) -> None:
        raise NotImplementedError

    def host_for(self, inst: Instance) -> LocalHost | SimulatedLocalHost:
        """The instance's host; one object per instance, so it remembers the PIDs it spawned."""
        directory = self.state_dir / "hosts" / str(inst.id)
        if inst.id not in self._hosts and self.settings.simulated_card:
            card = cardmodel.from_results(self.settings.simulated_card)
            self._hosts[inst.id] = SimulatedLocalHost(directory, inst.private_ip, inst.internal_ssh_port, card)
        if inst.id not in self._hosts:
            self._hosts[inst.id] = LocalHost(
                directory=directory,
                token=inst.token,
                private_ip=inst.private_ip,
                ssh_port=inst.internal_ssh_port,
                llama_server=self.settings.llama_server,
                frozen_server=inst.machine_id in self.faults.freeze_server,
                stale_image=inst.machine_id in self.faults.stale_image,
                disk_bytes=int(inst.disk * 1e9) - image_bytes(inst.image, self.faults.image_sizes),
                engine=toolchain.image_engine(inst.image),
                vllm_python=self.settings.vllm_python,
            )
        return self._hosts[inst.id]

    def start_host(self, inst: Instance) -> None:
        """Boot the instance's host: null -> scheduling -> created -> loading -> running, as the faults allow."""
        boot = asyncio.get_running_loop().create_task(self._boot(inst), name=f"boot-{inst.id}")
        boot.add_done_callback(lambda task: self._boot_ended(inst, task))
        self._tasks.setdefault(inst.id, []).append(boot)

    def _boot_ended(self, inst: Instance, boot: asyncio.Task) -> None:
        """A boot that raised what no step expects (this machine's fault, or the local cloud's own bug) is logged
        with its traceback. A container that never ran then exits, its processes and ports ended, as one that
        cannot start reads on vast.ai; one already running goes on running (a late step, the account's keys
        or onstart, failing stops no container), its faults still applied by its watch."""
        if boot.cancelled() or (error := boot.exception()) is None:
            return
        log.error("instance %s: its boot failed in state %s", inst.id, inst.status, exc_info=error)
        if inst.id not in self.state.instances or inst.status == "running":
            return
        ending = asyncio.get_running_loop().create_task(self._exit(inst, f"Error: {type(error).__name__}: {error}"))
        self._tasks.setdefault(inst.id, []).append(ending)

    async def _exit(self, inst: Instance, msg: str) -> None:
        """The container exits: its processes end, its ports close, it reads `exited` saying why."""
        await asyncio.to_thread(self.host_for(inst).stop)
        net = self._networks.pop(inst.id, None)
        if net is not None:
            await net.stop()
        if inst.id in self.state.instances:
            self._set_status(inst, "exited", msg)

    async def _pull_image(self, inst: Instance) -> None:
        """The machine downloads the image over its own link: the bytes are billed as download ("every byte sent
        or received") and take the time its `inet_down` gives them, scaled by the cloud's clock (a five-minute
        pull is seconds here, as boot phases are)."""
        size = image_bytes(inst.image, self.faults.image_sizes)
        self.count_traffic(inst.id, down=size)
        mbps = float(inst.offer.get("inet_down") or 0.0)
        if mbps > 0:
            await asyncio.sleep(size * 8 / (mbps * 1e6) * self.settings.pull_time_scale)

    def _go_offline(self, inst: Instance, msg: str) -> None:
        """The machine stops answering: vast.ai bills neither the GPU nor the disk of an offline instance ("You are
        not charged active rental or storage costs for instances that are currently offline")."""
        billing.close_open(self.state.charges, inst.id, time.time(), kinds=("gpu", "storage"))
        self._set_status(inst, "offline", msg)

    def _set_status(self, inst: Instance, status: str | None, msg: str | None) -> None:
        inst.status, inst.status_msg = status, msg
        self.save()
        log.info("instance %s is %s: %s", inst.id, status, msg)  # each step, however briefly it lasts

    async def _boot(self, inst: Instance, restart: bool = False) -> None:
        # After each wait the boot looks whether the instance was destroyed meanwhile, and if so takes no
        # further step: the destroy ends what the steps started (steps.py).
        third = self.settings.provision_delay_s / 3
        steps = ((None, None), ("scheduling", "Scheduling instance"), ("created", "Container created"))
        for status, msg in steps[1:] if restart else steps:
            self._set_status(inst, status, msg)
            await asyncio.sleep(third)
            if inst.id not in self.state.instances:
                return
        if inst.pull_error:
            # the registry refused the pull: the container stays `created` saying why; a moment later the
            # platform gives up (`stopped` intended), as vast.ai abandons a start
            self._set_status(inst, "created", inst.pull_error)
            await asyncio.sleep(third)
            if inst.id in self.state.instances:
                inst.intended_status = "stopped"
                self.save()
            return
        if _arch(inst.image) != (inst.offer.get("cpu_arch") or "amd64"):
            # an image of another architecture: Docker pulls it and warns, and its first exec fails (vast-cli's
            # self-test reads such a start as the image's failure); the platform then gives the start up
            platform = "linux/arm64/v8" if inst.offer.get("cpu_arch") == "arm64" else "linux/amd64"
            self._set_status(
                inst,
                "created",
                f"WARNING: The requested image's platform (linux/{_arch(inst.image)}) does not match the detected host "
                f"platform ({platform}) and no specific platform was requested; exec /bin/sh: exec format error",
            )
            await asyncio.sleep(third)
            if inst.id in self.state.instances:
                inst.intended_status = "stopped"
                self.save()
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
        if not restart:  # a restarted instance finds its image on the machine
            await self._pull_image(inst)
            if inst.id not in self.state.instances:
                return
            if image_bytes(inst.image, self.faults.image_sizes) + disks.MIN_BYTES > inst.disk * 1e9:
                # the allocation holds the image too, and cannot grow: its layers do not fit, and the platform
                # gives the start up
                self._set_status(
                    inst, "created", "Error response from daemon: failed to register layer: no space left on device"
                )
                inst.intended_status = "stopped"
                self.save()
                return
        # Docker publishes a container's ports as it starts it, and its processes learn them from their
        # environment (identity ports bind there): the mapping comes first, then the environment that names it
        net = await self._map_ports(inst)
        if net is None:
            return
        if inst.id not in self.state.instances:
            await net.stop()
            return
        host = self.host_for(inst)
        env = {**self.state.account_env, **inst.container_env()}  # the account's variables reach every container
        boot_steps = [host.prepare, host.start_platform_sshd if inst.ssh_mode else lambda: host.start_entrypoint(env)]
        if not await self._host_steps(inst, boot_steps):
            if self._networks.pop(inst.id, None) is not None:
                await net.stop()  # the container exited: nothing listens for it
            return
        if inst.machine_id in self.faults.stuck_loading:
            return
        await asyncio.sleep(self.settings.loading_delay_s)
        if inst.id not in self.state.instances:
            return  # the destroy stopped the network
        inst.running_at = time.time()
        billing.close_open(self.state.charges, inst.id, inst.running_at)  # the disk's charge while it loaded
        self.state.charges.append(Charge(inst.id, inst.label, inst.running_at, None, inst.dph_total))
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
        if inst.machine_id in self.faults.forged_host_key:
            later.append(host.announce_another_key)
        if inst.onstart:
            foreign = inst.machine_id in self.faults.foreign_host_key
            later.append(lambda: host.run_onstart(inst.onstart or "", env, foreign_key=foreign))
        await self._host_steps(inst, later)

    async def _host_steps(self, inst: Instance, steps: list) -> bool:
        """Run the host's steps one after another as long as the instance lives (steps.py)."""
        for step in steps:
            if inst.id not in self.state.instances:
                return False
            try:
                await self._steps.run(inst.id, step)
            except HostError as e:
                log.error("instance %s failed to boot: %s", inst.id, e)
                self._set_status(inst, "exited", f"Error: {e}")
                return False
        return inst.id in self.state.instances

    async def _map_ports(self, inst: Instance) -> network.HostNetwork | None:
        """Start the container's forwarders. Its external ports were free when create picked them, but any
        process on this machine may have bound one since (an outgoing connection's local port among them); a
        vast.ai machine hands out ports from its own range, none of them taken, so the container is mapped
        anew on free ports (listed once it runs, and in its environment). None, with the instance `exited`:
        no free ports found."""
        for _ in range(MAPPING_TRIES):
            net = self._network(inst)
            try:
                await net.start()
                return net
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                self._networks.pop(inst.id, None)
                log.info("instance %s: a port of its mapping was taken meanwhile (%s); mapped anew", inst.id, e)
                inst.ssh_port = network.free_port(network.PROXY_HOST)
                inst.ports = {key: network.free_port() for key in inst.ports}
                self.save()
        self._set_status(inst, "exited", f"Error: no free ports to map after {MAPPING_TRIES} tries")
        return None

    def _network(self, inst: Instance) -> network.HostNetwork:
        if inst.id not in self._networks:
            targets = inst.targets()
            unreachable = inst.machine_id in self.faults.unreachable_ports  # listed, and leading nowhere
            mappings = [
                network.Mapping(inst.public_ip, external, inst.private_ip, targets[key])
                for key, external in inst.ports.items()
                if key.endswith("/tcp") and not (unreachable and key != "22/tcp")
            ]
            if inst.ssh_mode:
                mappings.append(
                    network.Mapping(network.PROXY_HOST, inst.ssh_port, inst.private_ip, inst.internal_ssh_port)
                )
            self._networks[inst.id] = network.HostNetwork(
                mappings, lambda down, up, i=inst.id: self.count_traffic(i, down, up)
            )
        return self._networks[inst.id]

    async def _move_address(self, inst: Instance) -> None:
        """The machine's dynamic address changes under a running instance (offers list `static_ip`): its mappings
        answer at the new address alone, on the same ports, and the listing shows it; the instance's
        PUBLIC_IPADDR keeps the old one (vast.ai: it "is not updated if the IP changes")."""
        await self._network(inst).stop()
        self._networks.pop(inst.id, None)
        inst.public_ip = network.MOVED_HOST
        self.save()
        await self._network(inst).start()

    async def _watch(self, inst: Instance) -> None:
        """Apply the host faults that act on a running instance: exit, disappear, decode sag."""
        sag = DutyCycle(period_s=WATCH_PERIOD_S)
        try:
            await self._apply_faults(inst, sag)
        finally:
            sag.stop()

    async def _apply_faults(self, inst: Instance, sag: DutyCycle) -> None:
        """The watch's loop; the host's processes are ended only once the decode sag has let them run."""
        period = WATCH_PERIOD_S
        while inst.id in self.state.instances and inst.status == "running":
            running_for = time.time() - (inst.running_at or time.time())
            ended = self._platform_stop_reason(inst)
            if ended:
                # vast.ai stops it, not destroys it: "Whenever your credit balance hits zero or below, your
                # instances will be stopped automatically"; "When the rental end date is reached, the rental
                # contract expires and the instance is stopped"
                inst.intended_status = "stopped"
                inst.expired = inst.expired or ended == "expired"
                sag.stop()
                await self._stop(inst)
                inst.status_msg = f"Instance stopped: {ended}"
                self.save()
                return
            exit_after = self.faults.exit_after_s.get(inst.machine_id)
            if exit_after is not None and running_for >= exit_after:
                sag.stop()
                await asyncio.to_thread(self.host_for(inst).stop)
                await self._network(inst).stop()
                self._set_status(inst, "exited", "container exited unexpectedly")
                return
            vanish_after = self.faults.disappear_after_s.get(inst.machine_id)
            if vanish_after is not None and running_for >= vanish_after:
                # the machine is gone with everything on it: its processes (the unmount of its disk among them)
                # end before show stops finding it
                sag.stop()
                await asyncio.to_thread(self.host_for(inst).shut_down)
                await self._network(inst).stop()
                await self._forget(inst.id)
                return
            window = self.faults.maintenances.get(inst.machine_id)
            if window is not None and window[0] <= time.time() < window[0] + window[1] * 3600:
                # the announced maintenance: the machine goes down, and everything on it with it
                await self._network(inst).stop()
                self._go_offline(inst, "machine in scheduled maintenance")
                return
            offline_after = self.faults.offline_after_s.get(inst.machine_id)
            if offline_after is not None and running_for >= offline_after:
                # the host's network is gone (its processes run on, unreachable): every connection drops
                await self._network(inst).stop()
                self._go_offline(inst, "host is offline")
                return
            if inst.machine_id in self.faults.host_key_change:
                self.faults.host_key_change.remove(inst.machine_id)
                await asyncio.to_thread(self.host_for(inst).new_host_key)
            if inst.machine_id in self.faults.address_change:
                self.faults.address_change.remove(inst.machine_id)
                await self._move_address(inst)
            hot = self.faults.decode_sag.get(inst.machine_id)
            share = hot.stop_share(running_for) if hot else 0.0
            if share > 0:
                sag.set(_llama_server_pids(inst.token), share)
            else:
                sag.stop()
            await asyncio.sleep(period)


# The compressed size of each of fleet's images as built (CUDA's runtime and cuDNN under llama-server; vLLM's own
# image), and of any other image a test rents (fault `image_sizes` names others)
IMAGE_BYTES = {"llama-server": 5_000_000_000, "vllm": 12_000_000_000}
OTHER_IMAGE_BYTES = 1_000_000_000


def image_bytes(image: str, sizes: dict[str, int]) -> int:
    if image in sizes:
        return sizes[image]
    engine = toolchain.image_engine(image)
    return IMAGE_BYTES[engine] if "fleet-voice/" in image else OTHER_IMAGE_BYTES


def _arch(image: str) -> str:
    """The CPU architecture an image is built for: arm64 when its reference says so, else amd64 (fleet's)."""
    return "arm64" if "arm64" in image.lower() or "aarch64" in image.lower() else "amd64"


def _llama_server_pids(token: str) -> list[int]:
    pids = []
    for pid in procs.pids_with_marker(token):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "llama-server":
                pids.append(pid)
        except OSError:
            continue
    return pids
