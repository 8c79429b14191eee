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


def block_tokens(profile: Profile) -> int:
    """The tokens of one cache block: the prefix cache keeps whole blocks alone."""
    args = profile.args
    for i, a in enumerate(args):
        value = args[i + 1] if a == "--block-size" and i + 1 < len(args) else a.partition("=")[2]
        if (a == "--block-size" or a.startswith("--block-size=")) and value.isdigit() and int(value) > 0:
            return int(value)
    return BLOCK_TOKENS


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
