"""The agents' door's certificate from an ACME CA (`[gateway.acme]`): one every client already trusts, so no
agent is taught fleet's CA. certbot (Debian's) asks for it over HTTP-01: the CA reaches this gateway's
`acme.http_port`, where HAProxy answers `/.well-known/acme-challenge/TOKEN` from a map in its memory that
certbot's manual hooks (acmehook.py) fill over the admin socket while it asks and empty after: nothing else on
the machine can answer a challenge. HAProxy starts on a provisional certificate fleet's CA signs for the
domain; the ACME one replaces it in place (HAProxy's admin socket: no restart, no call dropped), and again 30
days before it ends."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import shlex
import shutil
import sys
from pathlib import Path

from cryptography import x509

from fleet.core.config import Settings
from fleet.core.errors import FleetError
from fleet.core.tls import load_certificate
from fleet.gateway.acmehook import MAP_ENV, SOCKET_ENV
from fleet.gateway.files import RENEW_WITHIN, GatewayFiles, write_pem

CERT_NAME = "fleet-gateway"
ISSUE_TIMEOUT_S = 300.0


class AcmeError(FleetError):
    """The ACME CA gave no certificate (certbot's own words say why)."""

    prefix = "ACME"


def folder(files: GatewayFiles) -> Path:
    return files.directory / "acme"  # certbot's account, its work and its logs (private: the account key)


# A renewal the CA refused is asked again after a backoff, never at every daemon beat: an ACME CA limits failed
# validations (Let's Encrypt: 5 an hour per account and name), and certbot ran with --force-renewal every 2 s
FIRST_RETRY_S = 60.0
LAST_RETRY_S = 6 * 3600.0


def _failures(files: GatewayFiles) -> Path:
    return folder(files) / "failures"  # "COUNT NEXT_TRY_EPOCH": renewals refused in a row, and when to ask again


def may_try(files: GatewayFiles, now: float) -> bool:
    """Whether a renewal may ask the CA now: no refusal on record, or its backoff has run out."""
    try:
        _, next_try = _failures(files).read_text().split()
        return now >= float(next_try)
    except (OSError, ValueError):
        return True


def refused(files: GatewayFiles, now: float) -> float:
    """Count a refused renewal; the seconds until the next try (doubling from FIRST_RETRY_S to LAST_RETRY_S)."""
    try:
        count = int(_failures(files).read_text().split()[0]) + 1
    except (OSError, ValueError, IndexError):
        count = 1
    wait = min(FIRST_RETRY_S * 2 ** (count - 1), LAST_RETRY_S)
    folder(files).mkdir(mode=0o700, parents=True, exist_ok=True)
    _failures(files).write_text(f"{count} {now + wait:.0f}\n")
    return wait


def renewed(files: GatewayFiles) -> None:
    _failures(files).unlink(missing_ok=True)


def due(files: GatewayFiles, domain: str, provisional_issuer: x509.Name) -> bool:
    """Whether the agents' door needs a certificate from the ACME CA now: it serves the provisional one (signed by
    fleet's CA), one for another name, or one that ends within 30 days."""
    served = load_certificate(files.pem)
    if served is None or served.issuer == provisional_issuer:
        return True
    try:
        names = served.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return True
    if domain not in names.get_values_for_type(x509.DNSName):
        return True
    return served.not_valid_after_utc - dt.datetime.now(dt.UTC) < RENEW_WITHIN


async def issue(files: GatewayFiles, settings: Settings) -> None:
    """Ask the ACME CA for the domain's certificate with certbot and put it where HAProxy reads it (the caller
    hands it to the running HAProxy). AcmeError with certbot's last words when the CA gives none."""
    acme = settings.gateway.acme
    certbot = shutil.which("certbot") or shutil.which("certbot", path="/usr/bin")
    if certbot is None:
        raise AcmeError("certbot is not installed (Debian's certbot package: scripts/setup installs it)")
    home = folder(files)
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    home.chmod(0o700)
    hook = f"{shlex.quote(sys.executable)} -m fleet.gateway.acmehook"
    argv = [
        certbot, "certonly", "--non-interactive", "--agree-tos", "--manual", "--preferred-challenges", "http",
        "--manual-auth-hook", f"{hook} add", "--manual-cleanup-hook", f"{hook} del", "--server", acme.directory,
        "--config-dir", str(home / "config"), "--work-dir", str(home / "work"), "--logs-dir", str(home / "logs"),
        "--cert-name", CERT_NAME, "--key-type", "ecdsa", "--force-renewal", "-d", acme.domain,
        *(["--email", acme.email] if acme.email else ["--register-unsafely-without-email"]),
    ]  # fmt: skip
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        SOCKET_ENV: str(files.socket),  # the hooks' way to the running HAProxy
        MAP_ENV: str(files.acme_map),
        **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}),  # the hooks import fleet
    }
    if acme.ca_file:
        env["REQUESTS_CA_BUNDLE"] = os.path.expanduser(acme.ca_file)
    process = await asyncio.create_subprocess_exec(
        *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = await asyncio.wait_for(process.communicate(), ISSUE_TIMEOUT_S)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AcmeError(f"certbot gave no answer in {ISSUE_TIMEOUT_S:g}s (its log: {home / 'logs'})") from None
    live = home / "config" / "live" / CERT_NAME
    if process.returncode != 0 or not (live / "fullchain.pem").exists():
        said = [line.strip() for line in output.decode(errors="replace").splitlines() if line.strip()]
        raise AcmeError(f"no certificate for {acme.domain}: {' '.join(said[-3:])[:400]} (its log: {home / 'logs'})")
    write_pem(files.pem, (live / "fullchain.pem").read_bytes(), (live / "privkey.pem").read_bytes())
