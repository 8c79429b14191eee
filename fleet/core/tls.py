"""fleet's certificate authority: the only one a client of fleet's hosts trusts.

Each host makes its own TLS key and hands fleet a certificate request over the pinned SSH session; fleet
takes nothing from the request but the public key (and checks the request's own signature): the name,
the address (from the marketplace, never from the host), the lifetime and the uses are fleet's. The CA's
key is made once, on this machine, beside fleet's SSH key and as private.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import re
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fleet.core.errors import FleetError
from fleet.core.files import write_private, write_public

MAX_REQUEST_BYTES = 8192  # a P-256 request is under 1 kB, a 4096-bit RSA one under 2 kB
CA_YEARS = 10
CLOCK_SKEW = dt.timedelta(minutes=5)  # a host whose clock lags a little still accepts a fresh certificate


# Names under `.invalid` (RFC 6761: never resolved by anyone) that fleet's CA alone gives: one per host, one per
# gateway peer. A client of a host checks the host's own name, not only its address, so that a certificate
# signed for one host (or an address a lying listing named) never stands in for another; a peer checks the
# other gateway's. A gateway's certificate for its agents never holds one of these.
HOSTS_DOMAIN = "hosts.fleet.invalid"
PEERS_DOMAIN = "peers.fleet.invalid"
FLEET_DOMAIN = "fleet.invalid"


def host_tls_name(host_name: str) -> str:
    """The DNS name a host's certificate holds and every client of it checks: its name, made a DNS label."""
    label = re.sub(r"[^a-z0-9-]", "-", host_name.lower()).strip("-")[:63]
    return f"{label}.{HOSTS_DOMAIN}"


def peer_tls_name(peer_name: str) -> str:
    """The DNS name a gateway's peer certificate holds and the other gateways check."""
    label = re.sub(r"[^a-z0-9-]", "-", peer_name.lower()).strip("-")[:63]
    return f"{label}.{PEERS_DOMAIN}"


def fleets_own(name: str) -> bool:
    """A name in fleet's own domain: only fleet's CA gives it, to a host or a peer."""
    name = name.lower().rstrip(".")
    return name == FLEET_DOMAIN or name.endswith("." + FLEET_DOMAIN)


class CertificateRequestRefused(FleetError):
    """A host's certificate request is not one fleet signs."""


@dataclass(frozen=True)
class CertificateAuthority:
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate
    certificate_path: Path  # what a client (fleet's own, or an agent) verifies hosts against


def ensure_ca(directory: Path, name: str) -> CertificateAuthority:
    """fleet's CA in `directory` (`ca.key`, 0600; `ca.pem`), made on first use."""
    key_path, cert_path = directory / "ca.key", directory / "ca.pem"
    if not key_path.exists():
        key = ec.generate_private_key(ec.SECP256R1())
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        if write_private(key_path, pem):
            cert_path.unlink(missing_ok=True)
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise FleetError(f"{key_path}: not fleet's CA key")
    if not cert_path.exists() or not _certifies(cert_path, key):
        write_public(cert_path, _self_signed(key, name).public_bytes(serialization.Encoding.PEM))
    return CertificateAuthority(key, x509.load_pem_x509_certificate(cert_path.read_bytes()), cert_path)


def public_key_sha256(certificate: x509.Certificate) -> str:
    """What names a CA whatever its certificate's dates: the SHA-256 of its public key (SubjectPublicKeyInfo)."""
    der = certificate.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(der).hexdigest()


def load_certificate(path: Path) -> x509.Certificate | None:
    """The certificate in a PEM file, or None when there is none (or it is not one)."""
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return None


def _certifies(cert_path: Path, key: ec.EllipticCurvePrivateKey) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except ValueError:
        return False
    return cert.public_key() == key.public_key() and cert.not_valid_after_utc > dt.datetime.now(dt.UTC)


def _self_signed(key: ec.EllipticCurvePrivateKey, name: str) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=365 * CA_YEARS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def sign_host(ca: CertificateAuthority, request_pem: bytes, address: str, name: str, not_after: dt.datetime) -> bytes:
    """A server certificate for the host `name` at `address` (the marketplace's word for it), valid until
    `not_after`, for the public key of `request_pem` and nothing else the request asks: its names are the
    address and `host_tls_name(name)`, its one use serving TLS (it can be no client, so no peer of a gateway)."""
    if len(request_pem) > MAX_REQUEST_BYTES:
        raise CertificateRequestRefused(f"the host's certificate request is over {MAX_REQUEST_BYTES} bytes")
    try:
        request = x509.load_pem_x509_csr(request_pem)
    except ValueError:
        raise CertificateRequestRefused("the host's certificate request is not a PEM certificate request") from None
    if not request.is_signature_valid:
        raise CertificateRequestRefused("the host's certificate request is not signed by its own key")
    public = request.public_key()
    if isinstance(public, ec.EllipticCurvePublicKey):
        if public.curve.name not in ("secp256r1", "secp384r1"):
            raise CertificateRequestRefused(f"the host's key is on {public.curve.name}, not P-256 or P-384")
    elif isinstance(public, rsa.RSAPublicKey):
        if public.key_size < 2048:
            raise CertificateRequestRefused(f"the host's RSA key has {public.key_size} bits, under 2048")
    else:
        raise CertificateRequestRefused(f"the host's key is a {type(public).__name__}, not EC or RSA")
    ip = ipaddress.ip_address(address)
    now = dt.datetime.now(dt.UTC)
    if not_after <= now:
        raise CertificateRequestRefused(f"the certificate would end before it starts ({not_after:%Y-%m-%d %H:%M})")
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.certificate.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ip), x509.DNSName(host_tls_name(name))]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
        .sign(ca.key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
    )


def client_context(ca_path: Path) -> ssl.SSLContext:
    """What every client of fleet's hosts verifies with: fleet's CA alone (no system roots), the host's
    address checked against its certificate, TLS 1.2 at least."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca_path))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def sign_server(ca: CertificateAuthority, names: list[str], days: int) -> tuple[bytes, bytes]:
    """A key made here and its certificate for `names` (DNS names or IPs), valid `days`: what the gateway's
    agents' door serves when no other certificate is given, verified by an agent with fleet's CA file. Never
    a name of fleet's own domain: a host's or a peer's. (key PEM, certificate PEM)"""
    if any(fleets_own(n) for n in names):
        raise CertificateRequestRefused(f"the names {names} hold one of fleet's own ({FLEET_DOMAIN})")
    return _sign_leaf(ca, names, days, [ExtendedKeyUsageOID.SERVER_AUTH])


def sign_peer(ca: CertificateAuthority, peer_name: str, days: int) -> tuple[bytes, bytes]:
    """A key made here and its certificate for the gateway peer `peer_name` (`peer_tls_name`), valid `days`:
    it serves the peers' door and connects to the other gateways'. (key PEM, certificate PEM)"""
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    return _sign_leaf(ca, [peer_tls_name(peer_name)], days, usages)


def _sign_leaf(
    ca: CertificateAuthority, names: list[str], days: int, usages: list[x509.ObjectIdentifier]
) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    now = dt.datetime.now(dt.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, certificate.public_bytes(serialization.Encoding.PEM)
