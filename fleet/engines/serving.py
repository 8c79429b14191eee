"""Which engine serves a profile, and what fleet asks of it whatever it is: the server's argv and where the
image's fleet-serve keeps the server's PID and log on the host."""

from __future__ import annotations

from fleet.core.config import Profile
from fleet.engines import llama_server, vllm

SERVER_NAMES = {"llama-server": "llama-server", "vllm": "vLLM"}


def server_argv(profile: Profile, port: int, files: dict[str, str]) -> list[str]:
    """What fleet-serve runs the server with: for llama-server its GGUF files by key, for vLLM the
    directory of the repository (`files["main"]`)."""
    if profile.engine == "vllm":
        return vllm.server_argv(profile, port, files["main"])
    return llama_server.server_argv(profile, port, files)


def host_ram_gb(profile: Profile) -> float:
    """The system RAM (GB) an offer must give a host of this profile (vLLM's host side is its profile's alone)."""
    return profile.host_ram_gb if profile.engine == "vllm" else llama_server.host_ram_gb(profile)


def pid_file(profile: Profile) -> str:
    return vllm.PID_FILE if profile.engine == "vllm" else "llama-server.pid"


def log_file(profile: Profile) -> str:
    return vllm.LOG_FILE if profile.engine == "vllm" else "llama-server.log"


def server_name(profile: Profile) -> str:
    return SERVER_NAMES[profile.engine]
