"""HAProxy's configuration for a gateway instance, rendered once at its start: the hosts come and go at
run time (sync.py), never by a reload.

Per [[serve]] target:
  frontend agents_tN    the agents' HTTPS endpoint: /v1/models answered here, /v1/chat/completions checked
                        (agent key, body), named (the agent's name, then X-Session-Id, else the body's user or
                        prompt_cache_key: a call is its agent's) and admitted (admission.lua): a turn of a
                        call goes on, a new call needs a free place
  backend calls_tN      one server per slot, each the internal door of one host_tN_S section: least
                        connections, a stick table from call to server (shared with peers), a retry before
                        the first byte on another server, a health check through the door every second,
                        and what the agents feel per host (observe.lua: first content, warm turns' cache)
  listen host_tN_S      one host, behind its slot's internal door (a Unix socket of mode 600 in a private
                        folder: no other user reaches it): its key set on the request (from a map that lives
                        in HAProxy's memory alone), TLS to it verified against fleet's CA and its name,
                        connections kept warm
  backend overflow_tN   the hosted API a full target's new calls go to, if one is configured
A request HAProxy answers itself (refused, /v1/models) never touches a host.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from fleet.core.config import Settings
from fleet.core.tls import peer_tls_name
from fleet.engines import CACHE_SALT_HEADER
from fleet.gateway import answers
from fleet.gateway.files import GatewayFiles
from fleet.gateway.targets import Target

REVOKED = "revoked_keys"  # observe.lua reads this table by its name
BUFFER_BYTES = 262_144  # a request body is read whole before a host is chosen: the largest one allowed fits
STICK_ENTRIES = 200_000
STICK_KEY_BYTES = 128
CALL_ID_BYTES = STICK_KEY_BYTES - 64 - 1  # an agent's name is at most 64 bytes (AGENT_NAME), then '/'
HEADERS_BYTES = 16_384  # an agent's request headers, all of them
# the intermediate profile of Mozilla's server-side TLS guidelines, less the DHE suites (no DH parameters here)
TLS12_CIPHERS = ":".join(
    f"ECDHE-{kind}-{cipher}"
    for cipher in ("AES128-GCM-SHA256", "AES256-GCM-SHA384", "CHACHA20-POLY1305")
    for kind in ("ECDSA", "RSA")
)
TLS13_SUITES = "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256"


def render(settings: Settings, targets: list[Target], files: GatewayFiles, ca_file: str) -> str:
    g = settings.gateway
    lines = [
        "global",
        f"  stats socket {files.socket} mode 600 level admin",
        f"  lua-load {files.lua}",
        f"  lua-load {files.observe_lua}",
        f"  tune.bufsize {BUFFER_BYTES}",
        f"  nbthread {g.threads}",
        "  ssl-server-verify required",
        # Linux lets a second HAProxy (another install's gateway on this machine) bind the same port with
        # SO_REUSEPORT and share out its connections: it must fail to start instead
        "  noreuseport",
        "  log stdout format raw local0 info",  # HAProxy runs in the foreground, its output the access log
        # every TLS hop, the agents' and fleet's own: TLS 1.3, or 1.2 with forward secrecy and an AEAD cipher
        f"  ssl-default-bind-ciphers {TLS12_CIPHERS}",
        f"  ssl-default-bind-ciphersuites {TLS13_SUITES}",
        "  ssl-default-bind-options ssl-min-ver TLSv1.2 no-tls-tickets",
        f"  ssl-default-server-ciphers {TLS12_CIPHERS}",
        f"  ssl-default-server-ciphersuites {TLS13_SUITES}",
        "  ssl-default-server-options ssl-min-ver TLSv1.2 no-tls-tickets",
        *([f"  localpeer {g.peer_name}"] if g.peers else []),
        "",
        "",
        "defaults",
        "  mode http",
        "  option http-no-delay",  # each streamed token leaves at once, never held to fill a packet
        "  timeout connect 3s",
        "  timeout client 120s",
        "  timeout http-request 10s",
        "  timeout http-keep-alive 120s",
        "  timeout server 120s",
        f"  timeout queue {int(g.queue_timeout_s * 1000)}ms",
        "  timeout check 2s",
        # what HAProxy answers itself when a host fails under a request: OpenAI's shape, never its HTML page
        f"  http-error {answers.HOST_FAILED.rule(g.retry_after_s)}",
        f"  http-error {answers.HOST_GONE.rule(g.retry_after_s)}",
        f"  http-error {answers.HOST_TIMEOUT.rule(g.retry_after_s)}",
        "",
    ]
    if g.peers:
        lines += _peers(settings, files, ca_file)
    if g.metrics_port:
        lines += [
            "frontend metrics",
            f"  bind 127.0.0.1:{g.metrics_port}",
            "  http-request use-service prometheus-exporter if { path /metrics }",
            "  http-request return status 404",
            "",
        ]
    lines += [
        f"backend {REVOKED}",  # the agents' keys revoked (their SHA-256): refused, and their streams ended
        f"  stick-table type string len 64 size 100k expire 24d store gpc0{' peers fleet' if g.peers else ''}",
        "",
    ]
    if g.acme.domain:
        lines += _acme(settings, files)
    for target in targets:
        lines += _frontend(settings, target, files)
        lines += _backend(settings, target, files, ca_file)
        if g.overflow.url:
            lines += _overflow(settings, target)
    return "\n".join(lines) + "\n"


def _frontend(settings: Settings, target: Target, files: GatewayFiles) -> list[str]:
    g = settings.gateway
    limit = g.max_body_kb * 1024
    t = f"t{target.index}"
    after = g.retry_after_s
    full = "{ var(txn.admit) -m str full none }"
    one_model = f"/v1/models/{target.alias}"
    return [
        f"frontend agents_{t}",
        f"  bind {g.listen}:{target.port} ssl crt {files.pem} alpn h2,http/1.1",
        "  option http-buffer-request",
        "  log global",
        f'  log-format "{_access_log_format(target, files)}"',
        f'  error-log-format "at=%Ts.%ms target={target.alias} client=%ci status=- connection_error=%[fc_err]"',
        f"  http-request return {answers.NOT_FOUND.rule(after)}"
        " unless { path /v1/chat/completions /v1/models } || { path_beg /v1/models/ }",
        '  http-request set-var(txn.agent_key) req.hdr(authorization),regsub("^Bearer ",""),sha2(256),hex,lower',
        f"  http-request set-var(txn.agent) var(txn.agent_key),map({files.agent_map})",
        # a key revoked on any gateway (its peers carry the revocation at once) is refused before the next sync
        f"  http-request return {answers.BAD_KEY.rule(after)}"
        f" if !{{ var(txn.agent) -m found }} || {{ var(txn.agent_key),table_gpc0({REVOKED}) gt 0 }}",
        f"  http-request return {answers.HEADERS_TOO_LARGE.rule(after)} if {{ req.hdrs,length gt {HEADERS_BYTES} }}",
        f"  http-request return status 200 content-type application/json file {files.models(target.index)}"
        " if { path /v1/models } METH_GET",
        f"  http-request return status 200 content-type application/json file {files.model(target.index)}"
        f" if {{ path {one_model} }} METH_GET",
        f"  http-request return {answers.not_served(target.alias).rule(after)} if {{ path_beg /v1/models/ }} METH_GET",
        f"  http-request return {answers.NOT_ALLOWED.rule(after)} if {{ path_beg /v1/models }} || !METH_POST",
        # a body must say its length: a chunked one is judged by the part the buffer holds, which large headers
        # keep under the limit while the rest streams on to the host (1 MiB passed behind 80 KB of headers)
        f"  http-request return {answers.NO_LENGTH.rule(after)} unless {{ req.hdr_cnt(content-length) eq 1 }}",
        f"  http-request return {answers.too_large(g.max_body_kb).rule(after)}"
        f" if {{ req.hdr_val(content-length) gt {limit} }} || {{ req.body_size gt {limit} }}",
        f"  http-request return {answers.NOT_CHAT.rule(after)}"
        " unless { req.body,json_query('$.messages[0].role') -m found }",
        # a call takes no slot of its choosing (another call's) and one completion (one admitted call would
        # take every slot with n)
        f"  http-request return {answers.NOT_OURS.rule(after)} if {{ req.body,json_query('$.id_slot') -m found }}",
        *(
            line
            for field in ("n", "n_cmpl")  # each read from the body once
            for line in (
                f"  http-request set-var(txn.{field}) req.body,json_query('$.{field}')",
                f"  http-request return {answers.ONE_COMPLETION.rule(after)}"
                f" if {{ var(txn.{field}) -m found }} !{{ var(txn.{field}) -m int 1 }}",
            )
        ),
        "  http-request set-var(txn.model) req.body,json_query('$.model')",
        f"  http-request return {answers.not_served(target.alias).rule(after)}"
        f" if {{ var(txn.model) -m found }} !{{ var(txn.model) -m str {target.alias} }}",
        "  http-request set-var(txn.call) req.hdr(x-session-id) if { req.hdr(x-session-id) -m found }",
        "  http-request set-var(txn.call) req.body,json_query('$.user') if !{ var(txn.call) -m found }",
        "  http-request set-var(txn.call) req.body,json_query('$.prompt_cache_key') if !{ var(txn.call) -m found }",
        # a call id fits the stick table's key beside its agent's name (64 bytes, '/'): a longer one, cut there,
        # would make one call of two
        f"  http-request return {answers.CALL_ID_TOO_LONG.rule(after)}"
        f" if {{ var(txn.call),length gt {CALL_ID_BYTES} }}",
        # a call is its agent's: another agent naming the same id makes a call of its own (an agent's name
        # holds no '/', so the key is read one way)
        "  http-request set-var(txn.call) var(txn.agent),concat(/,txn.call) if { var(txn.call) -m found }",
        f"  http-request set-var(txn.admit) lua.fleet_admit({target.backend})",
        # an agent's new calls (a turn of a call in progress is never refused), at most new_calls_per_agent_s
        # a second over 10 s: one agent's flood neither fills the hosts nor holds HAProxy's thread for others
        f"  http-request track-sc2 var(txn.agent) table new_calls_{t} unless {{ var(txn.admit) -m str turn }}",
        f"  http-request return {answers.TOO_MANY_NEW_CALLS.rule(after)} if !{{ var(txn.admit) -m str turn }}"
        f" {{ sc2_http_req_rate(new_calls_{t}) gt {g.new_calls_per_agent_s * 10} }}",
        f"  http-request track-sc1 var(txn.admit) table counts_{t}",
        *(
            [f"  use_backend overflow_{t} if {full}"]
            if g.overflow.url
            else [
                f"  http-request return {answers.NO_HOST.rule(after)} if {{ var(txn.admit) -m str none }}",
                f"  http-request return {answers.FULL.rule(after)} if {{ var(txn.admit) -m str full }}",
            ]
        ),
        f"  default_backend {target.backend}",
        "",
        f"backend counts_{t}",  # how many requests were new calls, turns, and full: fleet gateway status reads it
        "  stick-table type string len 8 size 8 store http_req_cnt",
        "",
        f"backend new_calls_{t}",  # each agent's new calls over the last 10 s
        "  stick-table type string len 64 size 100k expire 20s store http_req_rate(10s)",
        "",
    ]


CALL_KEY_ENV = "FLEET_CALL_LOG_KEY"  # HAProxy's environment alone holds the access log's key (base64)
SALT_KEY_ENV = "FLEET_CACHE_SALT_KEY"  # and the key of the agents' cache salts (base64)
CALL_HEADER = "x-fleet-call"  # from a target's backend to its slot's door, which counts the calls it carries


def _access_log_format(target: Target, files: GatewayFiles) -> str:
    """A line a request, never its content: when, which agent, which call (its key hashed), admitted how, the
    host that served it (as its certificate names it), the status, the times and the bytes sent back."""
    fields = {
        "at": "%Ts.%ms",  # the connection's arrival, or its previous request's end: this one came idle_ms later
        "idle_ms": "%Ti",
        "target": target.alias,
        "client": "%ci",
        "agent": "%[var(txn.agent)]",
        # keyed: a call's name is often a phone number or an email, which an unkeyed hash lets a reader guess
        "call": f"%[var(txn.call),hmac(sha256,${{{CALL_KEY_ENV}}}),bytes(0,8),hex,lower]",
        "admit": "%[var(txn.admit)]",
        "host": f"%[srv_name,regsub(^s,{target.section_prefix}),map({files.name_map})]",
        "status": "%ST",
        "queue_ms": "%Tw",
        "connect_ms": "%Tc",
        "response_ms": "%Tr",
        "first_content_ms": "%[var(txn.first_content_ms)]",
        "cached_tokens": "%[var(txn.cached_tokens)]",  # the prompt tokens the host took from its cache
        "processed_tokens": "%[var(txn.processed_tokens)]",  # and those it processed
        "total_ms": "%Ta",
        "bytes_out": "%B",
        "end": "%tsc",
    }
    return " ".join(f"{name}={value}" for name, value in fields.items())


def _backend(settings: Settings, target: Target, files: GatewayFiles, ca_file: str) -> list[str]:
    g = settings.gateway
    check = f"check inter {int(g.check_every_s * 1000)}ms fall 2 rise 2"
    lines = [
        f"backend {target.backend}",
        "  balance leastconn",
        "  filter lua.fleet_observe",  # first content and warm turns' cache hits, per host (observe.lua)
        # which host holds each call (its turns go there); how many calls each host holds, its slot's door counts
        f"  stick-table type string len {STICK_KEY_BYTES} size {STICK_ENTRIES} expire 1h"
        f"{' peers fleet' if g.peers else ''}",
        "  stick on var(txn.call)",
        "  option redispatch 1",
        "  retries 1",
        "  retry-on conn-failure empty-response 502 503",
        "  option httpchk GET /health",
        "  http-check expect status 200",
        "  http-request del-header authorization",  # the agent's key stays here; a host gets its own
        "  http-request lua.fleet_forward_only_needed",  # and every header a host does not need (admission.lua)
        # a host reuses what it cached for this agent (or its cache group) alone: no agent learns from a cache
        # hit, a prompt's timings or its first token's time how much of its guess another agent's prompt held
        f"  http-request set-var(txn.cache_scope) var(txn.agent),map({files.cache_groups_map})",
        "  http-request set-var(txn.cache_scope) str(agent/),concat(,txn.agent)"
        " unless { var(txn.cache_scope) -m found }",
        f"  http-request set-header {CACHE_SALT_HEADER}"
        f' "%[var(txn.cache_scope),hmac(sha256,${{{SALT_KEY_ENV}}}),hex,lower]"',  # HAProxy reads $ within quotes
        # the call, hashed, for its slot's door to count (and take off): a header of fleet's, set after the
        # agent's own were dropped
        f"  http-request set-header {CALL_HEADER} %[var(txn.call),sha2(256),hex] if {{ var(txn.call) -m found }}",
        *(
            f"  server s{slot} unix@{files.door(target.index, slot)} disabled maxconn 1 {check}"
            for slot in range(g.slots)
        ),
        "",
    ]
    # HAProxy 2.6 keeps no idle connection to a server added at run time: each slot's server is written here,
    # in maintenance, and fleet sets its address when a host takes the slot. The name its certificate must
    # hold goes with the request as SNI, which HAProxy checks the certificate against.
    for slot in range(g.slots):
        lines += [
            f"listen {target.slot_section(slot)}",
            f"  bind unix@{files.door(target.index, slot)} mode 600",
            # the calls in conversation on this slot's host: each call whose turn came through within the call
            # idle time, one entry each, forgotten that long after its last turn. Admission and a drain read
            # how many there are (the table's `used`), never the entries: the same cost at 10 calls or 200,000
            f"  stick-table type string len 64 size {STICK_ENTRIES} expire {g.call_idle_s}s"
            f"{' peers fleet' if g.peers else ''}",
            f"  http-request track-sc0 req.hdr({CALL_HEADER}) if {{ req.hdr({CALL_HEADER}) -m found }}",
            f"  http-request del-header {CALL_HEADER}",
            "  http-reuse always",
            f'  http-request set-header authorization "Bearer %[fe_name,map({files.host_map})]"',
            f"  server host 127.0.0.1:1 disabled ssl verify required ca-file {ca_file}"
            f" sni fe_name,map({files.name_map}) {check} observe layer4 error-limit 1 on-error mark-down"
            " pool-purge-delay 50s",
            "",
        ]
    return lines


def _acme(settings: Settings, files: GatewayFiles) -> list[str]:
    """Where the ACME CA checks that this gateway answers for the domain (HTTP-01): HAProxy answers a challenge
    itself, from the map fleet's issuance fills over the admin socket while it asks (acme.py, acmehook.py), so
    no one else on this machine can answer one (a loopback port handed the challenge to whoever held it, and
    a local user got a certificate for the domain that way); anything else is refused here."""
    g = settings.gateway
    not_found = answers.NOT_AGENTS.rule(g.retry_after_s)
    challenge = f"var(txn.acme_token),map({files.acme_map})"
    return [
        "frontend acme_http",
        f"  bind {g.listen}:{g.acme.http_port}",
        f"  http-request return {not_found} unless {{ path_reg ^/[.]well-known/acme-challenge/[A-Za-z0-9_-]+$ }}",
        "  http-request set-var(txn.acme_token) path,field(4,/)",
        f'  http-request return status 200 content-type text/plain lf-string "%[{challenge}]"'
        f" if {{ {challenge} -m found }}",
        f"  http-request return {not_found}",
        "",
    ]


def _overflow(settings: Settings, target: Target) -> list[str]:
    o = settings.gateway.overflow
    url = urlsplit(o.url)
    host = url.hostname or ""
    port = url.port or 443
    address = f"[{host}]" if ":" in host else host
    ca = o.ca_file or "@system-ca"
    lines = [
        f"backend overflow_t{target.index}",
        "  filter lua.fleet_blind",  # the API's cached tokens are not the agent's to read (observe.lua)
        "  http-request lua.fleet_forward_only_needed",  # nor its headers the provider's (admission.lua)
        f'  http-request set-header authorization "Bearer ${{{o.key_env}}}"',
        f"  http-request set-header host {host}",
        f"  http-request set-path {url.path}/chat/completions",
        f"  server overflow {address}:{port} ssl verify required ca-file {ca} sni str({host}) verifyhost {host}",
        "",
    ]
    return lines


def _peers(settings: Settings, files: GatewayFiles, ca_file: str) -> list[str]:
    """The peers' door takes a client only with a certificate of fleet's CA made for connecting (a gateway's:
    a host's serves alone), and each peer is reached only if its certificate names that peer."""
    g = settings.gateway
    lines = ["peers fleet"]
    for peer in g.peers:
        name, address = peer.split("=", 1)
        if name == g.peer_name:
            lines.append(f"  bind {address} ssl crt {files.peer_pem} ca-file {ca_file} verify required")
    lines.append(f"  default-server ssl verify required ca-file {ca_file} crt {files.peer_pem}")
    for peer in g.peers:
        name, address = peer.split("=", 1)
        if name == g.peer_name:
            lines.append(f"  server {name}")
        else:
            lines.append(f"  server {name} {address} sni str({peer_tls_name(name)}) verifyhost {peer_tls_name(name)}")
    return [*lines, ""]
