"""The record: every host, attempt, event, offer seen and blacklisted machine, as SQLModel tables.

Schema changes go through alembic migrations in migrations/; these classes and the migrations
must agree (a test compares them).
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime

from sqlalchemy import BigInteger, Index, text
from sqlmodel import Field, SQLModel


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(moment: datetime) -> datetime:
    """A stored time as an aware UTC one (SQLite hands back naive datetimes)."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


class HostState(enum.StrEnum):
    """One name per state; the order is the path a host takes."""

    CREATING = "creating"  # intent written, create call in flight
    BOOTING = "booting"  # instance exists, waiting for `running`
    CONNECTING = "connecting"  # SSH, host key pinned
    PULLING = "pulling"  # model files with aria2c
    STARTING = "starting"  # llama-server loading
    PROBING = "probing"
    READY = "ready"
    STOPPING = "stopping"  # brought up and probed for the standby pool: stop asked, waiting for `stopped`
    STANDBY = "standby"  # stopped at the marketplace: weights verified on its disk, the disk alone billed
    DRAINING = "draining"  # replaced: out of the endpoints, finishing what it serves, then destroyed
    FAILED = "failed"  # a phase failed; the instance is being or has been destroyed
    DESTROYING = "destroying"
    DESTROYED = "destroyed"


# The allowed moves, next to the states: Record.transition applies one only from these (compare-and-set).
# FAILED and DESTROYED are where a host ends; its bill is closed separately, and only once the marketplace
# confirms the instance gone (Record.close sets destroyed_at).
TRANSITIONS: dict[HostState, frozenset[HostState]] = {
    HostState.CREATING: frozenset({HostState.DESTROYING, HostState.BOOTING, HostState.FAILED, HostState.DESTROYED}),
    HostState.BOOTING: frozenset({HostState.DESTROYING, HostState.CONNECTING, HostState.FAILED, HostState.DESTROYED}),
    HostState.CONNECTING: frozenset({HostState.DESTROYING, HostState.PULLING, HostState.FAILED, HostState.DESTROYED}),
    HostState.PULLING: frozenset({HostState.DESTROYING, HostState.STARTING, HostState.FAILED, HostState.DESTROYED}),
    HostState.STARTING: frozenset({HostState.DESTROYING, HostState.PROBING, HostState.FAILED, HostState.DESTROYED}),
    HostState.PROBING: frozenset(
        {HostState.DESTROYING, HostState.READY, HostState.STOPPING, HostState.FAILED, HostState.DESTROYED}
    ),
    HostState.STOPPING: frozenset({HostState.STANDBY, HostState.DESTROYING, HostState.FAILED, HostState.DESTROYED}),
    # taken from the pool: started again, it boots, connects, verifies its files and is probed like a new one
    HostState.STANDBY: frozenset({HostState.BOOTING, HostState.DESTROYING, HostState.FAILED, HostState.DESTROYED}),
    HostState.READY: frozenset({HostState.DRAINING, HostState.DESTROYING, HostState.FAILED, HostState.DESTROYED}),
    HostState.DRAINING: frozenset({HostState.DESTROYING, HostState.FAILED, HostState.DESTROYED}),
    HostState.DESTROYING: frozenset({HostState.DESTROYED, HostState.FAILED}),
    HostState.FAILED: frozenset(),
    HostState.DESTROYED: frozenset(),
}


# A host on its way to READY, and one in the standby pool (stopped on purpose, still ours and billed).
COMING_UP = (
    HostState.CREATING,
    HostState.BOOTING,
    HostState.CONNECTING,
    HostState.PULLING,
    HostState.STARTING,
    HostState.PROBING,
)
POOL = (HostState.STOPPING, HostState.STANDBY)
LIVE_STATES = (*COMING_UP, HostState.READY, *POOL, HostState.DRAINING, HostState.DESTROYING)

LABEL_PREFIX = "fleet:"  # every instance fleet rents carries it at the start of its label


class Host(SQLModel, table=True):
    __tablename__ = "hosts"
    # one open host per gateway slot of a model and region (migration 0013)
    __table_args__ = (
        Index(
            "ux_hosts_gateway_slot",
            "model",
            "region",
            "gateway_slot",
            unique=True,
            sqlite_where=text("destroyed_at IS NULL AND gateway_slot IS NOT NULL"),
            postgresql_where=text("destroyed_at IS NULL AND gateway_slot IS NOT NULL"),
        ),
    )

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True)
    run_id: str = Field(index=True)
    model: str = Field(index=True)
    region: str
    state: str = Field(index=True, default=HostState.CREATING)
    provider_url: str
    label: str
    instance_id: int | None = Field(default=None, index=True)
    offer_id: int
    machine_id: int
    gpu_name: str
    num_gpus: int
    gpu_ram_mb: int
    geolocation: str
    dph_total: float
    inet_up_usd_per_gb: float
    inet_down_usd_per_gb: float
    effective_usd_per_hour: float
    ssh_host: str | None = None
    ssh_port: int | None = None
    host_key: str | None = None  # the SSH host key pinned at first connect
    api_url: str | None = None
    # llama-server's key is derived from a secret outside the database and this nonce (fleet/core/apikeys.py);
    # api_key is a key in clear, kept only by a host started before the nonce existed, until it is replaced
    api_key_nonce: str | None = None
    api_key: str | None = None
    slots: int = 1
    created_at: datetime = Field(default_factory=utcnow)
    running_at: datetime | None = None
    connected_at: datetime | None = None
    pulled_at: datetime | None = None
    # the model files' size (20 GB does not fit PostgreSQL's INTEGER): with connected_at and pulled_at, the pull rate
    pulled_bytes: int | None = Field(default=None, sa_type=BigInteger)
    started_at: datetime | None = None
    ready_at: datetime | None = None
    destroyed_at: datetime | None = None
    failed_phase: str | None = None
    failure_reason: str | None = None
    accrued_usd: float | None = None  # closed cost, set when the host is destroyed
    # The disk alone, what a stopped instance bills (the offer's price for the profile's disk), and the time
    # the instance has spent stopped: hours of stops that ended, and the start of the one under way.
    storage_usd_per_hour: float = 0.0
    stopped_hours: float = 0.0
    stopped_at: datetime | None = None
    # vast.ai stops an instance when its rental contract ends (the offer's end_date at rental) and never
    # starts it again: a host is replaced before then.
    contract_end_at: datetime | None = None
    # when the certificate fleet signed for its server ends: the host is replaced before then, as for a contract
    certificate_until: datetime | None = None
    # the DNS name that certificate holds (core/tls.py host_tls_name): every client of the host checks it, so
    # that no other host's certificate passes for this one's; None for a host signed before names (its
    # address alone is checked)
    tls_name: str | None = None
    inet_down_mbps: float = 0.0  # the link speed its offer advertised: the pull's deadline scales with it
    # its image's compressed size, pulled by the machine at create (billed as download; the boot waits for it)
    image_bytes: int = Field(default=0, sa_type=BigInteger)
    health_failures: int = 0  # consecutive failed health sweeps
    last_health_at: datetime | None = None
    replaces: int | None = Field(default=None, foreign_key="hosts.id")  # the host this one was brought up to replace
    # Who is working on the host (a bring-up, a drain, a destroy) and until when, renewed while it works.
    # Housekeeping acts only on a host with no owner, an expired lease, or an owner it knows is dead.
    owner: str | None = Field(default=None, index=True)
    lease_until: datetime | None = None
    # When the create request left (None: it never did, so a host cut short before it bought nothing).
    create_sent_at: datetime | None = None
    # Its server in its target's gateway backend, the same in every gateway instance (one per open host of a
    # model and region: a unique index holds it), kept while it drains
    gateway_slot: int | None = None
    # held from new calls until then (its gateway door drains): a thermal re-probe waits for its calls to end
    held_until: datetime | None = None
    # what the last health sweep read of its memory (None: not read, or the read failed): the machine's RAM as
    # its /proc/meminfo says (a container sees the machine's, not its share) and the server's resident set
    ram_total_mib: float | None = None
    ram_available_mib: float | None = None
    server_rss_mib: float | None = None


def host_age_s(host: Host) -> float:
    """Seconds since the host's intent was written."""
    return (utcnow() - as_utc(host.created_at)).total_seconds()


class Attempt(SQLModel, table=True):
    __tablename__ = "attempts"

    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(index=True)
    host_id: int | None = Field(default=None, foreign_key="hosts.id", index=True)
    model: str
    offer_id: int
    machine_id: int
    dph_total: float
    inet_usd_per_gb: float
    started_at: datetime = Field(default_factory=utcnow)
    ended_at: datetime | None = None
    outcome: str | None = None  # ready | failed
    phase: str | None = None
    reason: str | None = None


class Event(SQLModel, table=True):
    __tablename__ = "events"

    id: int | None = Field(default=None, primary_key=True)
    at: datetime = Field(default_factory=utcnow, index=True)
    host_id: int | None = Field(default=None, foreign_key="hosts.id", index=True)
    kind: str  # intent | answer | info | error
    action: str  # create | destroy | phase | reconcile ...
    detail: str = ""


class OfferSeen(SQLModel, table=True):
    __tablename__ = "offers_seen"

    id: int | None = Field(default=None, primary_key=True)
    seen_at: datetime = Field(default_factory=utcnow, index=True)
    provider_url: str
    offer_id: int = Field(index=True)
    machine_id: int
    gpu_name: str
    num_gpus: int
    geolocation: str
    dph_total: float
    inet_up_usd_per_gb: float
    inet_down_usd_per_gb: float
    reliability: float


class Blacklist(SQLModel, table=True):
    __tablename__ = "blacklist"

    id: int | None = Field(default=None, primary_key=True)
    provider_url: str
    machine_id: int = Field(index=True)
    phase: str
    reason: str
    created_at: datetime = Field(default_factory=utcnow)
    expires_at: datetime


class ProbeRun(SQLModel, table=True):
    """One probe's result on one host, with its measurements (JSON)."""

    __tablename__ = "probe_runs"

    id: int | None = Field(default=None, primary_key=True)
    host_id: int = Field(foreign_key="hosts.id", index=True)
    at: datetime = Field(default_factory=utcnow, index=True)
    name: str
    passed: bool
    diagnosis: str
    metrics: str = "{}"


class BenchRun(SQLModel, table=True):
    """One `fleet bench` of one host: the target, every level measured (JSON), the capacity found, and what
    a call-minute costs on the host at that capacity."""

    __tablename__ = "bench_runs"

    id: int | None = Field(default=None, primary_key=True)
    host_id: int = Field(foreign_key="hosts.id", index=True)
    at: datetime = Field(default_factory=utcnow, index=True)
    first_content_p95_ms_target: float
    decode_tok_s_target: float
    capacity: int  # speakers: concurrent turns
    capacity_at_least: bool  # every level asked for met the target: the host may hold more
    usd_per_voice_minute: float | None  # over its calls where they were measured, else its speakers
    levels: str = "[]"
    # the conversation load: calls in conversation at the target, with a turn_gap_s between their turns
    calls_capacity: int | None = None
    calls_at_least: bool | None = None
    calls_predicted: int | None = None  # from the speakers and the measured duty (fleet/economics/duty.py)
    calls_duty: float | None = None
    turn_gap_s: float | None = None
    calls_levels: str = "[]"


class JobRun(SQLModel, table=True):
    """A scheduled job's tick, claimed by the one daemon that runs it (several may share PostgreSQL)."""

    __tablename__ = "job_runs"

    job: str = Field(primary_key=True)
    tick: int = Field(primary_key=True)
    daemon: str
    started_at: datetime = Field(default_factory=utcnow)


class Install(SQLModel, table=True):
    """This database's install of fleet (one row): its id is in the label of every instance it rents."""

    __tablename__ = "install"

    id: int | None = Field(default=None, primary_key=True)
    install_id: str
    # the SHA-256 of the CA certificate its hosts were signed by (migration 0015): set by the first process to
    # use a CA, after which no machine without that CA makes one of its own
    ca_sha256: str | None = None
    # since when the [[serve]] targets are paused (`fleet destroy --all`, `fleet serve --pause`): no daemon rents
    # or pools a host for them until `fleet serve --resume` (migration 0018)
    serve_paused_at: datetime | None = None


class MarketPace(SQLModel, table=True):
    """One marketplace endpoint's turn for every process of the install (fleet/core/marketpace.py), in epoch
    seconds: when its next call may start, until when a call in flight holds it, the starts of its latest calls
    where the endpoint counts calls a minute."""

    __tablename__ = "market_pace"

    key: str = Field(primary_key=True)  # the endpoint and the marketplace's URL
    next_at: float = 0.0
    held_until: float = 0.0  # a call in flight, until its answer (or, when its process died, this time)
    recent: str = "[]"  # JSON: epoch seconds of the calls within the last minute


class AgentKey(SQLModel, table=True):
    """A voice agent's key to the gateway: its SHA-256 alone is kept (the key is shown once, at `add`)."""

    __tablename__ = "agent_keys"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True)
    sha256: str = Field(unique=True)
    created_at: datetime = Field(default_factory=utcnow)
    revoked_at: datetime | None = None
