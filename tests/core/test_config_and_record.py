"""Config validation, the llama-server argv a profile makes, and the schema the migrations build."""

import asyncio
import re
import sqlite3
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlmodel import SQLModel

from fleet.core import config, schema
from fleet.core import record as db
from fleet.core.models import Event, JobRun, OfferSeen, utcnow
from fleet.core.retention import prune
from fleet.engines import registry
from fleet.engines.llama_server import cache_args, server_argv, without_draft
from fleet.probes import template as chat_template
from tests.economics.test_machines import host as machine_host

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_config_is_valid_and_has_every_profile():
    settings = registry.load(ROOT / "fleet.toml")
    assert set(settings.models) >= {"tiny", "a4b", "phonellm", "12b", "31b"}
    assert {"SE", "DE", "CH", "GB", "NO"} <= set(settings.region("eu"))
    assert settings.region("PL") == ["PL"]
    with pytest.raises(config.ConfigError, match="no region 'xx'"):
        settings.region("xx")


def test_profiles_fit_their_architecture():
    settings = registry.load(ROOT / "fleet.toml")
    assert "--ctx-checkpoints" in settings.profile("a4b").args  # gemma: checkpoints off
    assert "--ctx-checkpoints" not in settings.profile("phonellm").args  # hybrid: would recompute every turn
    for name in ("a4b", "phonellm"):
        args = settings.profile(name).args
        assert args[args.index("--chat-template-kwargs") + 1] == '{"enable_thinking": false}'


def test_server_argv_fills_file_references_and_adds_port_and_alias():
    settings = registry.load(ROOT / "fleet.toml")
    argv = server_argv(settings.profile("a4b"), 41000, {"main": "models/a.gguf", "draft": "models/d.gguf"})
    assert argv[:2] == ["-m", "models/a.gguf"]
    assert argv[argv.index("-md") + 1] == "models/d.gguf"
    assert argv[-4:] == ["--port", "41000", "-a", "a4b"]
    assert {"--no-slots", "--no-webui", "--metrics"} <= set(argv)  # no transcript through /slots, drain by /metrics
    assert argv[argv.index("--chat-template-file") + 1] == "fleet-run/chat-template.jinja"
    assert not any("{file." in a for a in argv)
    assert "--chat-template-file" not in server_argv(settings.profile("tiny"), 41000, {"main": "m.gguf"})


def test_a_host_past_draft_max_slots_starts_without_its_draft_model():
    """Issue 43: at 64 streams on an H100 the a4b replica's draft cost 36% of the decode; a profile says the most
    slots at which its draft pays, and a host with more (fill_card on a big card) runs without it."""
    settings = registry.load(ROOT / "fleet.toml")
    a4b = settings.profile("a4b").model_copy(update={"draft_max_slots": 16})
    files = {"main": "m.gguf", "draft": "d.gguf"}
    within = server_argv(a4b, 41000, files)
    assert within[within.index("-md") + 1] == "d.gguf" and within[within.index("--spec-type") + 1] == "draft-mtp"
    past = server_argv(registry.engine_of(a4b).with_slots(a4b, 17), 41000, files)
    assert not any(a in past for a in ("-md", "d.gguf", "--spec-type", "draft-mtp", "--spec-draft-n-max"))
    assert past[past.index("-np") + 1] == "17" and past[past.index("--top-k") + 1] == "64"  # the rest as it was
    drafted = ["-ngl", "99", "--model-draft=x", "--spec-draft-backend-sampling", "-ngld", "99", "-fa", "on"]
    assert without_draft(drafted) == ["-ngl", "99", "-fa", "on"]
    with pytest.raises(ValueError, match="draft_max_slots: the args name no draft model"):
        registry.engine_of(a4b).check_profile(settings.profile("tiny").model_copy(update={"draft_max_slots": 4}))


def test_a_multi_slot_host_gets_a_kv_stream_per_slot_unless_the_profile_asks_for_one_shared_cache():
    settings = registry.load(ROOT / "fleet.toml")
    a4b = settings.profile("a4b")  # 3 slots of 32k, says --no-cache-idle-slots itself
    argv = server_argv(a4b, 41000, {"main": "m.gguf", "draft": "d.gguf"})
    assert "-no-kvu" in argv and "-kvu" not in argv and "--kv-unified-per-slot" not in argv
    assert argv.count("--no-cache-idle-slots") == 1
    assert cache_args(settings.profile("tiny")) == []  # one slot: one stream
    # a stream per slot: no idle slot's state copied into the RAM prompt cache at each launch, its cells on the card
    assert cache_args(settings.profile("12b")) == ["-no-kvu", "--no-cache-idle-slots"]
    kept = settings.profile("12b").model_copy(update={"args": [*settings.profile("12b").args, "--cache-idle-slots"]})
    assert cache_args(kept) == ["-no-kvu"]  # its own idle-slot choice stands
    assert cache_args(a4b.model_copy(update={"args": [*a4b.args, "-no-kvu"]})) == []  # its own word stands
    # a profile that says -kvu gets each slot held to its planned context and keeps its idle calls on the card
    said = a4b.model_copy(update={"args": [a for a in a4b.args if a != "--no-cache-idle-slots"] + ["-kvu"]})
    assert cache_args(said) == ["--kv-unified-per-slot", "32768", "--no-cache-idle-slots"]
    idle = a4b.model_copy(
        update={"args": [a for a in a4b.args if a != "--no-cache-idle-slots"] + ["-kvu", "--cache-idle-slots"]}
    )
    assert cache_args(idle) == ["--kv-unified-per-slot", "32768"]
    own = a4b.model_copy(update={"args": [*a4b.args, "--kv-unified", "--kv-unified-per-slot", "16384"]})
    assert cache_args(own) == []  # its own per-slot context stands


def test_every_shipped_profile_passes_its_template_check_or_accepts_the_break():
    settings = registry.load(ROOT / "fleet.toml")
    for name in ("a4b", "12b", "31b", "phonellm"):
        profile = settings.profile(name)
        text, source = chat_template.template_text(profile, ROOT, None)
        result = asyncio.run(chat_template.check_text(text, chat_template.template_kwargs(profile)))
        assert chat_template.refusal(profile, source, result) is None, name
    assert settings.profile("phonellm").accept_template_breaks == ["whitespace"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            'chat_template = "gemma 4"',
            r"models\.tiny\.chat_template: 'gemma 4': a file fleet ships is named NAME\.jinja",
        ),
        ('chat_template = ""', r"models\.tiny\.chat_template: an empty name"),
        (
            'accept_template_breaks = ["trailing"]',
            r"models\.tiny\.accept_template_breaks: \['trailing'\]: the turn shapes",
        ),
    ],
)
def test_bad_template_keys_are_named(tmp_path, line, message):
    text = (ROOT / "fleet.toml").read_text().replace('"-t", "1", "--jinja"]\n', f'"-t", "1", "--jinja"]\n{line}\n', 1)
    assert line in text
    (tmp_path / "fleet.toml").write_text(text)
    with pytest.raises(config.ConfigError, match=message):
        registry.load(tmp_path / "fleet.toml")


def test_a_template_that_is_missing_or_does_not_parse_is_one_line(tmp_path):
    profile = registry.load(ROOT / "fleet.toml").profile("tiny")
    missing = profile.model_copy(update={"chat_template": "no-such.jinja"})
    with pytest.raises(chat_template.TemplateError, match=r"^models\.tiny\.chat_template: fleet ships no template"):
        chat_template.template_text(missing, tmp_path, None)
    mine = profile.model_copy(update={"chat_template": "./mine.jinja"})
    with pytest.raises(chat_template.TemplateError, match=r"cannot read .*/mine\.jinja: No such file"):
        chat_template.template_text(mine, tmp_path, None)
    (tmp_path / "mine.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    text, source = chat_template.template_text(mine, tmp_path, None)
    assert source == str(tmp_path / "mine.jinja")
    with pytest.raises(chat_template.TemplateError, match=r"^the chat template does not parse: line 1"):
        asyncio.run(chat_template.check_text(text, {}))


def test_profile_may_not_set_what_fleet_sets(tmp_path):
    text = (ROOT / "fleet.toml").read_text().replace('"-t", "1", "--jinja"]', '"-t", "1", "--api-key", "x"]')
    (tmp_path / "fleet.toml").write_text(text)
    with pytest.raises(config.ConfigError, match=r"models\.tiny: args: --api-key is set by fleet"):
        registry.load(tmp_path / "fleet.toml")
    text = (ROOT / "fleet.toml").read_text().replace('"-t", "1", "--jinja"]', '"-t", "1", "--chat-template", "x"]')
    (tmp_path / "fleet.toml").write_text(text)
    with pytest.raises(
        config.ConfigError, match=r"--chat-template is set by fleet.*name the template in chat_template"
    ):
        registry.load(tmp_path / "fleet.toml")
    for flag in ('"--cache-ram", "0"', '"-cram=0"'):
        text = (ROOT / "fleet.toml").read_text().replace('"-t", "1", "--jinja"]', f'"-t", "1", {flag}]')
        (tmp_path / "fleet.toml").write_text(text)
        with pytest.raises(config.ConfigError, match=r"models\.tiny: args: -(-cache-ram|cram) is set by fleet from"):
            registry.load(tmp_path / "fleet.toml")


def test_off_the_local_cloud_the_image_is_pinned_by_digest(tmp_path):
    text = (ROOT / "fleet.toml").read_text().replace('url = "local"', 'url = "https://market.example"')
    digest = "@sha256:" + "0123456789abcdef" * 4
    image = re.search(r'^image = "([^"]+)"$', text, re.M)
    assert image
    (tmp_path / "tag.toml").write_text(text)
    with pytest.raises(config.ConfigError, match="pin it off the local cloud, by digest"):
        registry.load(tmp_path / "tag.toml")
    pinned = text.replace(image.group(0), f'image = "{image.group(1)}{digest}"')
    (tmp_path / "one.toml").write_text(pinned)
    with pytest.raises(config.ConfigError, match="vllm_image: pin it off the local cloud"):  # the vLLM image too
        registry.load(tmp_path / "one.toml")
    vllm = re.search(r'^vllm_image = "([^"]+)"$', text, re.M)
    assert vllm
    (tmp_path / "digest.toml").write_text(pinned.replace(vllm.group(0), f'vllm_image = "{vllm.group(1)}{digest}"'))
    loaded = registry.load(tmp_path / "digest.toml")
    assert loaded.provider.image == image.group(1) + digest
    assert registry.ENGINES["vllm"].image(loaded.provider) == vllm.group(1) + digest
    assert registry.ENGINES["llama-server"].image(loaded.provider) == image.group(1) + digest


def test_off_the_local_cloud_an_image_by_tag_is_pinned_by_its_manifest(tmp_path):
    text = (ROOT / "fleet.toml").read_text().replace('url = "local"', 'url = "https://market.example"')
    image = re.search(r'^image = "([^"]+)"$', text, re.M)
    vllm = re.search(r'^vllm_image = "([^"]+)"$', text, re.M)
    assert image and vllm and "@sha256:" not in image.group(1)
    proof = "sha256:" + "0123456789abcdef" * 4
    proven = text.replace(image.group(0), f'{image.group(0)}\nimage_proof = "{proof}"')
    (tmp_path / "one.toml").write_text(proven)
    with pytest.raises(config.ConfigError, match="vllm_image: pin it off the local cloud"):  # each image its own
        registry.load(tmp_path / "one.toml")
    proven = proven.replace(vllm.group(0), f'{vllm.group(0)}\nvllm_image_proof = "{proof}"')
    (tmp_path / "both.toml").write_text(proven)
    loaded = registry.load(tmp_path / "both.toml")
    assert registry.ENGINES["llama-server"].image(loaded.provider) == image.group(1)
    assert registry.ENGINES["llama-server"].image_proof(loaded.provider) == proof
    assert registry.ENGINES["vllm"].image_proof(loaded.provider) == proof
    (tmp_path / "bad.toml").write_text(proven.replace(f'image_proof = "{proof}"', 'image_proof = "sha256:abc"', 1))
    with pytest.raises(config.ConfigError, match="image_proof"):
        registry.load(tmp_path / "bad.toml")


def test_a_vllm_profile_needs_the_vllm_image_and_a_repository(tmp_path):
    text = (ROOT / "fleet.toml").read_text()
    vllm = re.search(r'^vllm_image = "([^"]+)"\n', text, re.M)
    assert vllm
    (tmp_path / "none.toml").write_text(text.replace(vllm.group(0), ""))
    with pytest.raises(config.ConfigError, match=r"models\.tiny-vllm: engine = 'vllm' needs provider\.vllm_image"):
        registry.load(tmp_path / "none.toml")
    snapshot = 'snapshot = { repo = "fleet-local/tiny-llama-hf", revision = "main" }'
    assert snapshot in text
    (tmp_path / "files.toml").write_text(text.replace(snapshot, 'files = [{ key = "main", repo = "a/b", file = "c" }]'))
    with pytest.raises(config.ConfigError, match="give snapshot"):
        registry.load(tmp_path / "files.toml")
    flags = '"--block-size", "32"]'
    assert flags in text
    (tmp_path / "flag.toml").write_text(text.replace(flags, '"--block-size", "32", "--max-model-len", "9"]'))
    with pytest.raises(config.ConfigError, match="--max-model-len is not the profile's to give"):
        registry.load(tmp_path / "flag.toml")


def test_migrations_build_exactly_the_models_schema(tmp_path):
    engine = db.open_database(tmp_path / "fleet.db")
    with engine.connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection), SQLModel.metadata)
    assert diff == []
    with engine.connect() as connection:
        mode = connection.exec_driver_sql("PRAGMA journal_mode").scalar()
    assert mode == "wal"
    assert oct((tmp_path / "fleet.db").stat().st_mode & 0o777) == "0o600"
    db.migrate(engine)  # again: a no-op


def test_a_database_at_the_newest_migration_opens_without_loading_alembic(tmp_path):
    """Every fleet command opens the database: one whose schema is already there is read in one query, with
    alembic's package and migration files never loaded (a quarter of a second of every command's CPU)."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", str(ROOT / "migrations"))
    assert schema.head_revision() == ScriptDirectory.from_config(config).get_current_head()
    opened = (
        "import sys; from pathlib import Path; from fleet.core import record; "
        "record.open_database(Path({path!r})); print('alembic' in sys.modules)"
    )
    first = subprocess.run([sys.executable, "-c", opened.format(path=str(tmp_path / "new.db"))], capture_output=True,
                           text=True, timeout=120, check=True)  # fmt: skip
    again = subprocess.run([sys.executable, "-c", opened.format(path=str(tmp_path / "new.db"))], capture_output=True,
                           text=True, timeout=120, check=True)  # fmt: skip
    assert (first.stdout.strip(), again.stdout.strip()) == ("True", "False")  # migrated once, then only read


def test_migrations_upgrade_a_database_that_holds_records(tmp_path):
    """A record made by the first schema survives every later migration (SQLite copies tables to alter
    them; foreign keys must not fire while it does)."""
    from sqlalchemy import text

    engine = db.make_engine(tmp_path / "old.db")
    db.migrate(engine, "0001")
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO hosts (id, name, run_id, model, region, state, provider_url, label, offer_id, machine_id,"
                " gpu_name, num_gpus, gpu_ram_mb, geolocation, dph_total, inet_up_usd_per_gb, inet_down_usd_per_gb,"
                " effective_usd_per_hour, slots, created_at) VALUES (1, 'h1', 'r', 'tiny', 'eu', 'ready', 'local',"
                " 'fleet:h1', 7, 8, 'RTX 3090', 1, 24576, 'Sweden, SE', 0.2, 0, 0, 0.2, 1, '2026-11-29 10:00:00')"
            )
        )
        for id_, state in ((1, "ready"), (2, "destroyed")):
            conn.execute(
                text(
                    "INSERT INTO hosts (id, name, run_id, model, region, state, provider_url, label, offer_id,"
                    " machine_id, gpu_name, num_gpus, gpu_ram_mb, geolocation, dph_total, inet_up_usd_per_gb,"
                    " inet_down_usd_per_gb, effective_usd_per_hour, slots, created_at, api_key) VALUES"
                    f" ({id_ + 1}, 'k{id_}', 'r', 'tiny', 'eu', '{state}', 'local', 'fleet:k{id_}', 7, 8, 'RTX 3090',"
                    f" 1, 24576, 'Sweden, SE', 0.2, 0, 0, 0.2, 1, '2026-11-29 10:00:00', 'clear-key-{id_}')"
                )
            )
        conn.execute(
            text(
                "INSERT INTO attempts (run_id, host_id, model, offer_id, machine_id, dph_total,"
                " inet_usd_per_gb, started_at) VALUES ('r', 1, 'tiny', 7, 8, 0.2, 0, '2026-11-29 10:00:00')"
            )
        )
        conn.execute(
            text(
                "INSERT INTO events (at, host_id, kind, action, detail) VALUES"
                " ('2026-11-29 10:00:00', 1, 'intent', 'create', '{}')"
            )
        )
    db.migrate(engine)
    with engine.connect() as conn:
        head = max(p.name[:4] for p in (ROOT / "migrations" / "versions").glob("0*.py"))
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == head
        assert conn.execute(text("SELECT name, health_failures FROM hosts WHERE id = 1")).all() == [("h1", 0)]
        # a closed host's key in clear is erased; a live one keeps it until it is replaced (nothing derives it)
        keys = conn.execute(text("SELECT name, api_key FROM hosts WHERE id > 1 ORDER BY id")).all()
        assert keys == [("k1", "clear-key-1"), ("k2", None)]
        assert conn.execute(text("SELECT count(*) FROM attempts WHERE host_id = 1")).scalar() == 1
        assert conn.execute(text("SELECT count(*) FROM events WHERE host_id = 1")).scalar() == 1
        assert compare_metadata(MigrationContext.configure(conn), SQLModel.metadata) == []
    assert [h.name for h in db.Record(engine).hosts()] == ["h1", "k1", "k2"]


def test_opening_the_database_again_keeps_the_locks_this_process_holds_on_it(tmp_path):
    """Every command, and every tick of the daemon, opens the database: that must never open the file behind
    SQLite's back, which would drop this process's POSIX locks on it (and let another process delete the WAL
    under its connections)."""
    path = tmp_path / "fleet.db"
    engine = db.open_database(path)
    db.Record(engine).hosts()  # a connection in WAL mode holds a read lock on the file

    def locks() -> int:
        inode = f":{path.stat().st_ino} "
        return sum(1 for line in Path("/proc/locks").read_text().splitlines() if inode in line)

    held = locks()
    assert held >= 1
    assert db.open_database(path) is engine  # one engine per database in a process
    db.make_engine(path).dispose()  # even a second engine of its own never touches the file
    assert locks() == held


def test_housekeeping_rows_are_pruned_after_the_retention_and_host_history_stays(tmp_path):
    """What a day of a daemon writes (a tick per job run, a credit event per reconcile, every offer each search
    saw) is deleted once older than the retention, in batches; hosts, their events and every newer row stay."""
    record = db.Record(db.open_database(tmp_path / "fleet.db"))
    now = utcnow()
    old, new = now - timedelta(days=40), now - timedelta(days=1)
    host = record.add(machine_host(1, 1, name="kept-host"))
    offer = dict(provider_url="local", machine_id=1, gpu_name="RTX 3090", num_gpus=1, geolocation="Sweden, SE",
                 dph_total=0.2, inet_up_usd_per_gb=0.0, inet_down_usd_per_gb=0.0, reliability=0.99)  # fmt: skip
    record.add_all(
        [JobRun(job="health", tick=i, daemon="d", started_at=old) for i in range(25)]
        + [JobRun(job="health", tick=1000 + i, daemon="d", started_at=new) for i in range(3)]
        + [Event(kind="info", action="credit", at=old) for _ in range(30)]
        + [Event(kind="info", action="credit", at=new)]
        + [Event(kind="intent", action="create", at=old, host_id=host.id)]
        + [OfferSeen(offer_id=i, seen_at=old, **offer) for i in range(40)]
        + [OfferSeen(offer_id=999, seen_at=new, **offer)]
    )
    pruned = prune(record, now - timedelta(days=28), batch=7)  # several batches each
    assert pruned.rows == {"job_runs": 25, "events": 30, "offers_seen": 40}
    with sqlite3.connect(tmp_path / "fleet.db") as plain:
        tables = ("job_runs", "events", "offers_seen")
        counts = {t: plain.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in tables}
        kept_event = plain.execute("SELECT action FROM events WHERE host_id IS NOT NULL").fetchall()
        hosts = plain.execute("SELECT name FROM hosts").fetchall()
    assert counts == {"job_runs": 3, "events": 2, "offers_seen": 1}
    assert kept_event == [("create",)] and hosts == [("kept-host",)]  # a host's history stays
    assert prune(record, now - timedelta(days=28)).total() == 0
