"""fleet.toml's [gateway]: the agents' one HTTPS endpoint per [[serve]] target (fleet/gateway/)."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from fleet.core.profiles import Strict
from fleet.core.tls import FLEET_DOMAIN, fleets_own, peer_tls_name

AGENT_NAME = r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}"  # an agent's name (no '/': the gateway's keys join names with it)

# what an HAProxy peer name and a certificate's DNS name may be: nothing that could end a config line
PEER_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}"
DNS_NAME = r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
ENV_NAME = r"[A-Z_][A-Z0-9_]{0,63}"


def _address(v: str) -> str:
    try:
        return str(ipaddress.ip_address(v))
    except ValueError:
        raise ValueError(f"{v[:80]!r}: an IP address (the gateway binds it)") from None


class Overflow(Strict):
    """Where a new call goes when its target is full: an OpenAI-compatible API (the hosted one a team falls
    back to). Empty url: no overflow, a new call on a full target gets 503 with Retry-After. The request goes
    as the agent sent it (HAProxy does not rewrite a body): the provider must take the target's model name,
    as a router in front of hosted models does."""

    url: str = ""  # https://HOST[:PORT][/PREFIX]: /v1/chat/completions goes to PREFIX/chat/completions
    key_env: Annotated[str, Field(pattern=f"^{ENV_NAME}$")] = "FLEET_OVERFLOW_KEY"
    ca_file: str = ""  # the CA its certificate is checked against (empty: the system's)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if v and not re.fullmatch(r"https://(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+)(:\d{1,5})?(/[A-Za-z0-9._~/-]*)?", v):
            raise ValueError(
                f"{v[:100]!r}: an https:// URL (host, port, path; no query): a call crosses in clear otherwise"
            )
        return v.rstrip("/")


class Acme(Strict):
    """The agents' door's certificate from an ACME CA, for `domain`: one every client already trusts (Let's Encrypt
    by default), obtained over HTTP-01 (the CA reaches this gateway at `http_port`, where HAProxy answers the
    challenge fleet's issuance put in its memory), renewed in place 30 days before its end."""

    domain: str = ""  # empty: no ACME (the team's own certificate, or one fleet's CA signs)
    directory: str = "https://acme-v02.api.letsencrypt.org/directory"
    email: str = ""  # the ACME account's contact (empty: none)
    ca_file: str = ""  # a private ACME server's own CA, to reach it over TLS (a test's Pebble)
    http_port: Annotated[int, Field(ge=1, le=65535)] = 80

    @field_validator("domain")
    @classmethod
    def _domain(cls, v: str) -> str:
        if v and (not re.fullmatch(DNS_NAME, v) or "." not in v):
            raise ValueError(f"{v[:80]!r}: a DNS name (ACME certifies names, not addresses)")
        if v and fleets_own(v):
            raise ValueError(f"{v!r}: {FLEET_DOMAIN} names are fleet's hosts' and peers' alone")
        return v.lower()

    @field_validator("directory")
    @classmethod
    def _directory(cls, v: str) -> str:
        if not re.fullmatch(r"https://[A-Za-z0-9.:\[\]-]+(/[A-Za-z0-9._~/-]*)?", v):
            raise ValueError(f"{v[:100]!r}: an ACME directory's https:// URL")
        return v

    @field_validator("email")
    @classmethod
    def _email(cls, v: str) -> str:
        if v and not re.fullmatch(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}", v):
            raise ValueError(f"{v[:80]!r}: an email address")
        return v


class Gateway(Strict):
    directory: str = ""  # its configuration, socket and certificate (default: gateway/ in fleet's state directory)
    listen: str = "127.0.0.1"  # the address the agents' endpoints bind (0.0.0.0: every interface)
    port: Annotated[int, Field(ge=1, le=65535)] = 8443  # the first target's; a [[serve]] table's `port` wins
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 9465  # HAProxy's Prometheus exporter, loopback (0: off)
    # The endpoints' certificate and key (PEM files). Empty: fleet makes one, signed by its CA, for `names`.
    certificate_file: str = ""
    key_file: str = ""
    names: list[str] = []  # DNS names or IPs the made certificate holds besides localhost and `listen`
    max_body_kb: Annotated[int, Field(ge=1, le=240)] = 192  # a request body past this is refused (413)
    slots: Annotated[int, Field(ge=1, le=256)] = 16  # hosts one target holds at once, draining ones included
    # HAProxy's threads: one keeps a stream's hops on one core (measured: +0.5 ms first content, against
    # +1.3 ms with two on a two-core machine); more only for thousands of streams
    threads: Annotated[int, Field(ge=1, le=64)] = 1
    check_every_s: Annotated[float, Field(ge=0.1, le=10)] = 1.0  # the health check of every host
    sync_every_s: Annotated[float, Field(ge=0.5, le=60)] = 2.0  # fleet daemon applies the record this often
    queue_timeout_s: Annotated[float, Field(ge=0.1, le=60)] = 5.0  # a turn waiting for its host's free slot
    retry_after_s: Annotated[int, Field(ge=1, le=3600)] = 1  # what a refused new call is told
    # a call with no turn for this long is over: a draining host waits (up to rotation.drain_timeout_s) for
    # the calls with a turn more recent than this
    call_idle_s: Annotated[int, Field(ge=1, le=3600)] = 20
    # an agent's new calls a second (over 10 s) before the gateway answers 429: turns of calls in progress never
    new_calls_per_agent_s: Annotated[int, Field(ge=1, le=10_000)] = 50
    # Several gateway instances share which host holds each call: every instance's name=ADDRESS:PORT, this one's
    # among them as `peer_name` (their stick tables travel over TLS with fleet's certificates)
    peers: list[str] = []
    peer_name: str = ""
    # This peer's certificate and key (PEM), made on the machine that holds fleet's CA key (`fleet gateway
    # peer-certificate NAME`). Empty: fleet's CA signs one here, which needs its key on this machine.
    peer_certificate_file: str = ""
    peer_key_file: str = ""
    overflow: Overflow = Overflow()
    acme: Acme = Acme()
    # A host reuses the prompt it cached for one agent only for that agent: the agents a group names share
    # theirs (one team's agents with one long system prompt). An agent is in one group at most.
    cache_groups: dict[str, list[str]] = {}

    @model_validator(mode="after")
    def _one_certificate(self) -> Gateway:
        if self.acme.domain and (self.certificate_file or self.key_file):
            raise ValueError("gateway.acme.domain and gateway.certificate_file: one source of the agents' certificate")
        return self

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        return _address(v)

    @field_validator("cache_groups")
    @classmethod
    def _cache_groups(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        seen: dict[str, str] = {}
        for group, agents in v.items():
            if not re.fullmatch(AGENT_NAME, group):
                raise ValueError(f"{group[:80]!r}: a group's name is letters, digits, _ . @ - (at most 64)")
            for agent in agents:
                if not re.fullmatch(AGENT_NAME, agent):
                    raise ValueError(f"{agent[:80]!r} in cache group {group!r}: not an agent's name")
                if agent in seen:
                    raise ValueError(f"agent {agent!r} is in cache groups {seen[agent]!r} and {group!r}: one at most")
                seen[agent] = group
        return v

    @field_validator("names")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        for name in v:
            try:
                ipaddress.ip_address(name)
            except ValueError:
                if not re.fullmatch(DNS_NAME, name):
                    raise ValueError(f"{name[:80]!r}: a DNS name or an IP address") from None
                if fleets_own(name):
                    raise ValueError(f"{name!r}: {FLEET_DOMAIN} names are fleet's hosts' and peers' alone") from None
        return v

    @field_validator("peers")
    @classmethod
    def _peers(cls, v: list[str]) -> list[str]:
        for peer in v:
            m = re.fullmatch(f"({PEER_NAME})=([0-9a-fA-F.:]+):(\\d{{1,5}})", peer)
            if not m:
                raise ValueError(f"{peer[:80]!r}: NAME=ADDRESS:PORT")
            _address(m.group(2))
        names = [peer_tls_name(p.split("=", 1)[0]) for p in v]
        if len(set(names)) != len(names):
            raise ValueError("two peers' names differ only in case or in '_' and '.': each needs a name of its own")
        return v

    @field_validator("peer_name")
    @classmethod
    def _peer_name(cls, v: str) -> str:
        if v and not re.fullmatch(PEER_NAME, v):
            raise ValueError(f"{v[:80]!r}: letters, digits, _ . - (at most 63)")
        return v
