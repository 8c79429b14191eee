"""An instance as the local cloud keeps it, and a create call's body read as vast.ai reads it: the image,
the disk, the label, onstart, the launch mode, the environment with its `-p` port options."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from fleet.localcloud import network
from fleet.localcloud.apierror import ApiError

PORT_KEY = re.compile(r"^-p (\d{1,5}):(\d{1,5})(/tcp|/udp)?$")
MAX_PORTS = 64  # vast.ai: "a limit of 64 total open ports per container"


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
    cur_state: str = "running"  # the contract: running, or stopped (its disk kept, the GPU released)
    pull_error: str | None = None  # what the registry answered when the image could not be pulled
    expired: bool = False  # its rental contract ended: stopped, and it cannot start again
    public_ip: str = network.PUBLIC_HOST  # where its mappings answer: the machine's address, which may change

    def contract_ended(self, now: float) -> bool:
        """Its rental contract's end is past (vast.ai stops it then and never starts it again)."""
        end = self.offer.get("end_date")
        return isinstance(end, int | float) and now >= end

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

    def container_env(self) -> dict[str, str]:
        """The container's environment (PID 1 and onstart see it; SSH sessions do not)."""
        env = dict(self.env)
        for key, port in self.ports.items():
            number, proto = key.split("/")
            env[f"VAST_{proto.upper()}_PORT_{number}"] = str(port)
        env.update(
            CONTAINER_ID=str(self.id),
            VAST_CONTAINERLABEL=f"C.{self.id}",
            PUBLIC_IPADDR=network.PUBLIC_HOST,
            GPU_COUNT=str(self.offer.get("num_gpus") or 1),
            SSH_PUBLIC_KEY=self.authorized_keys[-1] if self.authorized_keys else "",
        )
        return env


@dataclass(frozen=True)
class CreateRequest:
    """A create call's body, checked: what the instance is made from."""

    image: str
    disk: float
    label: str | None
    onstart: str | None
    runtype: str
    env: dict[str, str]  # the plain variables (docker options removed)
    container_ports: list[str]  # "18080/tcp", "22/tcp" first when SSH is direct
    image_login: str | None  # a private registry's login, `-u USER -p TOKEN REGISTRY`; never stored


def pull_error(image: str, login: str | None, missing: list[str], private: dict[str, str]) -> str | None:
    """What the registry answers a pull of `image` with `login`: None when it pulls; else the daemon's words,
    as vast.ai shows them in status_msg."""
    if image in missing:
        return f"Error response from daemon: manifest for {image} not found: manifest unknown: manifest unknown"
    if image in private and login != private[image]:
        repo = image.rsplit(":", 1)[0]
        return (
            f"Error response from daemon: pull access denied for {repo}, repository does not exist or may "
            "require 'docker login': denied: requested access to the resource is denied"
        )
    return None


MAX_LAUNCH_CHARS = 4096
MAX_ENV_VALUE_CHARS = 256
MAX_ENV_CHARS = 32768


def parse_create(offer_id: int, body: Any) -> CreateRequest:
    """The create call's body as vast.ai reads it; ApiError 400 with its words for what it refuses."""
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
    # vast.ai's input validation (its OpenAPI's x-input-validation for create): args, args_str and onstart
    # together at most 4096 characters; each env value at most 256, all of env at most 32768
    launched = [body.get(k) for k in ("args", "args_str", "onstart")]
    launch_chars = sum(len(v) if isinstance(v, str) else len(json.dumps(v)) for v in launched if v is not None)
    if launch_chars > MAX_LAUNCH_CHARS:
        raise ApiError(
            400, "invalid_args", f"Invalid args: args, args_str and onstart exceed {MAX_LAUNCH_CHARS} characters",
            ask_id=offer_id,
        )  # fmt: skip
    if any(len(v) > MAX_ENV_VALUE_CHARS for v in env.values()):
        raise ApiError(
            400, "invalid_args", f"Invalid args: an env value exceeds {MAX_ENV_VALUE_CHARS} characters", ask_id=offer_id
        )
    if sum(len(k) + len(v) for k, v in env.items()) > MAX_ENV_CHARS:
        raise ApiError(400, "invalid_args", f"Invalid args: env exceeds {MAX_ENV_CHARS} characters", ask_id=offer_id)
    image_login = body.get("image_login")
    if image_login is not None and (not isinstance(image_login, str) or len(image_login) > 2048):
        raise ApiError(400, "invalid_args", "Invalid args: 'image_login' must be a string", ask_id=offer_id)

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
    return CreateRequest(image, disk, label, onstart, runtype, plain_env, container_ports, image_login or None)
