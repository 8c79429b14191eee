"""The secrets scan itself finds what it must: a key in a log, on a command line, in a command's output, and a
database others can read (so a clean session means something)."""

import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fleet.core.apikeys import host_api_key
from tests.secrets_watch import SecretsWatch

# a "host" serving /slots in clear, to anyone
PLAIN_SLOTS = (
    "import http.server, sys\n"
    "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(b'[]')\n"
    "http.server.HTTPServer(('127.0.0.1', port), H).serve_forever()\n"
)


def test_the_scan_finds_a_planted_secret_everywhere_it_looks():
    # outside the session's own directory: the session's scan must not take these planted keys for its own
    with tempfile.TemporaryDirectory() as name:
        planted_and_found(Path(name))


def planted_and_found(tmp_path: Path) -> None:
    cloud = tmp_path / "localcloud"
    cloud.mkdir()
    vast_key = "v" * 40
    (cloud / "api_key").write_text(vast_key)
    (cloud / "api_key").chmod(0o600)
    database = tmp_path / "run" / "fleet.db"
    database.parent.mkdir()
    secret = tmp_path / "run" / "secret" / "host-api-keys"
    secret.parent.mkdir()
    secret.write_bytes(b"s" * 32)
    secret.chmod(0o600)
    derived = host_api_key(b"s" * 32, "h1", "n" * 32)
    with sqlite3.connect(database) as db:
        db.execute("CREATE TABLE hosts (name TEXT, api_key_nonce TEXT, api_key TEXT)")
        db.execute("INSERT INTO hosts VALUES (?, ?, ?)", ("h1", "n" * 32, None))
        db.execute("INSERT INTO hosts VALUES (?, ?, ?)", ("h0", None, "k" * 43))  # a key in clear
    database.chmod(0o644)  # readable by others: must be found
    (tmp_path / "run" / "server.log").write_text(f"started with {vast_key}\n")

    watch = SecretsWatch(tmp_path)
    watch.start()
    try:
        watch.register("t" * 37)
        host_env = {"PATH": "/usr/bin:/bin", "FLEET_HOST_KEY_DIR": str(tmp_path / "h" / "etc"), "HF_TOKEN": "t" * 37}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        clear = [sys.executable, "-c", PLAIN_SLOTS, "/x/llama-server", "--host", "127.0.0.1", "--port", str(port)]
        with (
            subprocess.Popen(["sh", "-c", "sleep 1.5", derived]),
            subprocess.Popen(["sleep", "1.5"], env=host_env),
            subprocess.Popen(clear, env=host_env) as plain_host,
        ):
            time.sleep(2.5)  # the watch reads command lines twice a second, and asks a host's server once up
            plain_host.kill()
        subprocess.run([sys.executable, "-c", f"print('{vast_key}')", "fleet.cli"], capture_output=True, text=True)
    finally:
        watch.stop()
    found = "\n".join(watch.findings())
    assert f"vast.ai API key in {tmp_path / 'run' / 'server.log'}" in found
    assert "llama-server key on a command line" in found
    assert "token in a host's environment" in found
    assert f"a host's server at ('127.0.0.1', {port}) answered plain HTTP" in found
    assert "vast.ai API key in a command's output" in found
    assert f"{database} is readable by others" in found
    assert f"llama-server key in {database}" in found  # a database holds nonces, never a key
