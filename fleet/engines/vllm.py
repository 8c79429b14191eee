"""vLLM's OpenAI server: its argv from a profile, and which files of a repository it loads.

vLLM reads its key from the environment (fleet-serve puts it there from the key file: never on a command
line), takes the slots as --max-num-seqs and a slot's context as --max-model-len, and serves the profile's
name as the model. It has no `timings` and no /slots: a reply's `usage` says how many prompt tokens came from
its prefix cache (`prompt_tokens_details.cached_tokens`, with --enable-prompt-tokens-details), and /metrics
how many requests run and wait (fleet/engines/metrics.py).
"""

from __future__ import annotations

from fleet.core.config import Profile
from fleet.engines import TEMPLATE_FILE, TLS_CERT_FILE, TLS_KEY_FILE

# What a vLLM host pulls of a repository: the config, tokenizer and template files and the safetensors
# shards at its top level; never pickles (*.bin, *.pt), a GGUF, a README or the originals in a subdirectory.
SNAPSHOT_FILES = ("*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.tiktoken", "merges.txt", "vocab.txt")
BLOCK_TOKENS = 16  # vLLM's KV cache block on a GPU, unless --block-size says otherwise
PID_FILE = "vllm.pid"  # in RUN_DIR, as images/vllm/host/fleet-serve writes them
LOG_FILE = "vllm.log"


def flag_value(profile: Profile, flag: str, default: str) -> str:
    """What the profile's args give `flag` (`--flag VALUE` or `--flag=VALUE`), else `default`. The values fleet
    reads are checked when fleet.toml loads (fleet/core/profiles.py VLLM_NUMBERS)."""
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
