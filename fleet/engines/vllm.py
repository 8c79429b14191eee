"""vLLM's OpenAI server: its argv from a profile, and which files of a repository it loads.

vLLM reads its key from the environment (fleet-serve puts it there from the key file: never on a command
line), takes the slots as --max-num-seqs and a slot's context as --max-model-len, and serves the profile's
name as the model. It has no `timings` and no /slots: a reply's `usage` says how many prompt tokens came from
its prefix cache (`prompt_tokens_details.cached_tokens`, with --enable-prompt-tokens-details), and /metrics
how many requests run and wait (fleet/engines/metrics.py).
"""

from __future__ import annotations

from typing import ClassVar

from fleet.core.config import Profile
from fleet.engines import TEMPLATE_FILE, TLS_CERT_FILE, TLS_KEY_FILE
from fleet.engines.base import Engine, Payload
from fleet.engines.llama_server import COMPUTE_CAPS

# What a vLLM host pulls of a repository: the config, tokenizer and template files and the safetensors
# shards at its top level; never pickles (*.bin, *.pt), a GGUF, a README or the originals in a subdirectory.
SNAPSHOT_FILES = ("*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.tiktoken", "merges.txt", "vocab.txt")
BLOCK_TOKENS = 16  # vLLM's KV cache block on a GPU, unless --block-size says otherwise
PID_FILE = "vllm.pid"  # in RUN_DIR, as images/vllm/host/fleet-serve writes them
LOG_FILE = "vllm.log"


def flag_value(profile: Profile, flag: str, default: str) -> str:
    """What the profile's args give `flag` (`--flag VALUE` or `--flag=VALUE`), else `default`. The values fleet
    reads are checked when fleet.toml loads (NUMBERS)."""
    args = profile.args
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.partition("=")[2]
    return default


def block_tokens(profile: Profile) -> int:
    """The tokens of one cache block: the prefix cache keeps whole blocks alone."""
    return int(flag_value(profile, "--block-size", str(BLOCK_TOKENS)))


def gpu_memory_utilization(profile: Profile) -> float:
    return float(flag_value(profile, "--gpu-memory-utilization", "0.9"))


def kv_bytes(profile: Profile) -> int | None:
    """Bytes per KV cache element when --kv-cache-dtype says fp8; None: the weights' dtype ("auto")."""
    return 1 if flag_value(profile, "--kv-cache-dtype", "auto").startswith("fp8") else None


def server_argv(profile: Profile, port: int, model_dir: str) -> list[str]:
    """vLLM's arguments: the model directory, the profile's name, slots and context, its flags, the chat
    template fleet put on the host when the profile names one, the host's TLS key and certificate, the port."""
    template = ["--chat-template", TEMPLATE_FILE] if profile.chat_template else []
    return [
        "--model", model_dir,
        "--served-model-name", profile.name,
        "--max-num-seqs", str(profile.slots),
        "--max-model-len", str(profile.ctx_per_slot),
        "--enable-prompt-tokens-details",
        *profile.args,
        *template,
        "--ssl-keyfile", TLS_KEY_FILE,
        "--ssl-certfile", TLS_CERT_FILE,
        "--port", str(port),
    ]  # fmt: skip


# vLLM's flags fleet sets itself, and from what
SET_BY_FLEET = {
    "--api-key": "the host's key, in the server's environment",
    "--port": "the service port",
    "--host": "the image's listen address",
    "--model": "snapshot",
    "--served-model-name": "the profile's name",
    "--max-num-seqs": "slots",
    "--max-model-len": "ctx_per_slot",
    "--chat-template": "chat_template",
    "--ssl-keyfile": "the host's TLS key",
    "--ssl-certfile": "the certificate fleet's CA signs",
    "--enable-prompt-tokens-details": "always on: a warm turn reports its cached tokens",
    "--middleware": "fleet-serve's key check on every path",
    "--config": "a file of flags would pass the rest of this list by",
    "--uds": "the service port",
    "--root-path": "the paths the gateway and the probes use",
    "--tensor-parallel-size": "fleet serves a vLLM profile from one card, and rents by one card's memory",
    "-tp": "fleet serves a vLLM profile from one card, and rents by one card's memory",
}


def _share(value: str) -> bool:
    try:
        return 0 < float(value) <= 1
    except ValueError:
        return False


# vLLM's flags whose value fleet reads too (the planner, the cache probe): checked at load
NUMBERS = {"--gpu-memory-utilization": _share, "--block-size": lambda v: v.isdigit() and 0 < int(v) <= 4096}
NUMBER_RULES = {
    "--gpu-memory-utilization": "a share of the card above 0, at most 1",
    "--block-size": "tokens, 1-4096",
}


class Vllm(Engine):
    """vLLM's OpenAI server from a repository snapshot, on one card, --max-num-seqs slots of --max-model-len."""

    name = "vllm"
    server_name = "vLLM"
    payload = Payload.REPO_SNAPSHOT
    image_setting = "vllm_image"
    one_card = True  # fleet starts it without tensor parallelism
    reports_slots = False  # no /props: its slots and context are what fleet started it with
    renders_templates = False  # no /apply-template: fleet renders the repository's template itself
    pid_file = PID_FILE
    log_file = LOG_FILE
    # the image's own builds are vLLM's; a card the llama-server image is not built for is not rented for either
    compute_caps: ClassVar[tuple[int, ...]] = COMPUTE_CAPS

    def check_profile(self, profile: Profile) -> None:
        args = profile.args
        if profile.fill_card:
            raise ValueError("fill_card: a vllm profile's sequences are --max-num-seqs at its slots")
        if profile.snapshot is None or profile.files:
            raise ValueError("engine = 'vllm' serves a repository: give snapshot = { repo, revision }, not files")
        for i, arg in enumerate(args):
            flag = arg.split("=", 1)[0]
            if flag.startswith("--"):
                flag = "--" + flag[2:].replace("_", "-")  # vLLM reads --max_num_seqs as --max-num-seqs
            if flag in SET_BY_FLEET:
                raise ValueError(f"args: {flag} is not the profile's to give ({SET_BY_FLEET[flag]})")
            if flag in NUMBERS:
                value = arg.partition("=")[2] if "=" in arg else (args[i + 1 : i + 2] or [""])[0]
                if not NUMBERS[flag](value):
                    raise ValueError(f"args: {flag} {value[:20]!r}: {NUMBER_RULES[flag]}")

    def server_argv(self, profile: Profile, port: int, files: dict[str, str]) -> list[str]:
        return server_argv(profile, port, files["main"])

    def tokenize_body(self, text: str) -> dict[str, object]:
        return {"prompt": text, "add_special_tokens": False}

    def cache_block_tokens(self, profile: Profile) -> int:
        return block_tokens(profile)

    def card_share(self, profile: Profile) -> float:
        return gpu_memory_utilization(profile)

    def kv_bytes(self, profile: Profile) -> int | None:
        return kv_bytes(profile)
