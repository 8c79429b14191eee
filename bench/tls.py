#!/usr/bin/env python3
"""What TLS costs a voice call: the same llama-server build serving plain HTTP and HTTPS, side by side in
one run, through a link with an added round trip (bench/keepalive.py's namespaces and delay line).

The recorded call is replayed turn by turn on one kept connection per call, as an agent talks to a host.
A warm turn rides the open connection: TLS adds only its record encryption, which the target holds under
1 ms. A cold connection pays the TLS 1.3 handshake on top of the TCP connect: one more round trip, shown
apart. The certificate comes from a CA made for the run, as fleet's CA signs a host's (fleet/core/tls.py),
and the client verifies it the way fleet's probes do.

Needs root (namespaces). Builds what is missing (scripts/build-llama-server).
Usage: sudo .venv/bin/python bench/tls.py [--rtt-ms 30,60] [--calls 3] [--turns 8]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import secrets
import statistics
import sys
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from keepalive import SERVER_IP, client_in, delayed_link, ensure_build, p95, replay_arguments, server_in

from fleet.core import tls
from fleet.localcloud import tinymodels, toolchain


def server_files(ca: tls.CertificateAuthority, directory: Path) -> tuple[Path, Path]:
    """A key made for the server and its certificate from `ca` for the server's address."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench")])
    request = x509.CertificateSigningRequestBuilder().subject_name(name).sign(key, hashes.SHA256())
    until = dt.datetime.now(dt.UTC) + dt.timedelta(hours=2)
    pem = tls.sign_host(ca, request.public_bytes(serialization.Encoding.PEM), SERVER_IP, "bench", until)
    key_path, cert_path = directory / "server.key", directory / "server.pem"
    encoded = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    key_path.write_bytes(encoded)
    key_path.chmod(0o600)
    cert_path.write_bytes(pem)
    return key_path, cert_path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    replay_arguments(parser)
    args = parser.parse_args()
    try:
        rtts = [float(x) for x in args.rtt_ms.split(",")]
    except ValueError:
        print(f"error: --rtt-ms takes numbers separated by commas, not {args.rtt_ms!r}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("error: bench/tls.py makes network namespaces: run it as root", file=sys.stderr)
        return 2
    binary = ensure_build(stock=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        directory.chmod(0o755)  # the client runs in its namespace as this user: it reads the CA from here
        model = tinymodels.ensure(directory / "models")["tiny"]
        key_file = directory / "key"
        key_file.write_text(secrets.token_urlsafe(24))
        key_file.chmod(0o600)
        ca = tls.ensure_ca(directory / "ca", "bench CA")
        files = server_files(ca, directory)
        for rtt in rtts:
            with delayed_link(rtt) as link:
                print(f"link: +{rtt:g} ms round trip, {link.mechanism}", file=sys.stderr)
                for scheme, tls_files, ca_file in (("http", None, None), ("https", files, ca.certificate_path)):
                    with server_in(link.server_ns, binary, model, key_file, tls_files) as url:
                        turns = client_in(
                            link.client_ns, url, key_file, args.calls, args.turns, args.system_chars, 0.0, ca_file
                        )
                    warm = [t for t in turns if t["turn"] > 0]
                    cold = [t for t in turns if t["connect_ms"] is not None]
                    rows.append(
                        {
                            "rtt_ms": rtt,
                            "scheme": scheme,
                            "warm_turns": len(warm),
                            "reconnects": sum(t["connect_ms"] is not None for t in warm),
                            "warm_p50": statistics.median(t["first_content_ms"] for t in warm),
                            "warm_p95": p95([t["first_content_ms"] for t in warm]),
                            "warm_outside_p50": statistics.median(t["first_content_ms"] - t["server_ms"] for t in warm),
                            "connect_ms": statistics.median(t["connect_ms"] for t in cold),
                            "handshake_ms": statistics.median(t["tls_ms"] or 0.0 for t in cold),
                            "cold_p50": statistics.median(t["first_content_ms"] for t in cold),
                        }
                    )
    print(f"\nllama.cpp {toolchain.llama_cpp_version()}, patch set p{toolchain.patchset_id()}, built with OpenSSL;")
    print(f"tiny model, one slot; recorded call: system prompt {args.system_chars} chars, 8 tokens a reply\n")
    print(
        "| added RTT | scheme | warm turns | reconnects | warm first content p50 | p95 | outside the server p50 "
        "| TLS costs a warm turn (outside the server) | cold: TCP connect | TLS handshake | cold first content p50 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        plain = next(r for r in rows if r["rtt_ms"] == row["rtt_ms"] and r["scheme"] == "http")
        cost = row["warm_outside_p50"] - plain["warm_outside_p50"]
        print(
            f"| {row['rtt_ms']:g} ms | {row['scheme']} | {row['warm_turns']} | {row['reconnects']} | "
            f"{row['warm_p50']:.1f} ms | {row['warm_p95']:.1f} ms | {row['warm_outside_p50']:.1f} ms | "
            + (f"{cost:+.2f} ms |" if row["scheme"] == "https" else "|")
            + f" {row['connect_ms']:.1f} ms | {row['handshake_ms']:.1f} ms | {row['cold_p50']:.1f} ms |"
        )
    worst = max(
        r["warm_outside_p50"]
        - next(p for p in rows if p["rtt_ms"] == r["rtt_ms"] and p["scheme"] == "http")["warm_outside_p50"]
        for r in rows
        if r["scheme"] == "https"
    )
    print(f"\nTLS on a kept connection: at most {worst:+.2f} ms a warm turn (target: under 1 ms).")
    print(
        "(Outside the server: first content less the server's prompt time and one decode step, from its own "
        "timings. The handshake is TLS 1.3: one round trip after the connect.)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
