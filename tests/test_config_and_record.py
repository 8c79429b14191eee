"""Config validation, the llama-server argv a profile makes, and the schema the migrations build."""

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlmodel import SQLModel

from fleet import config, db
from fleet.hostops import server_argv

ROOT = Path(__file__).resolve().parents[1]


def test_the_shipped_config_is_valid_and_has_every_profile():
    settings = config.load(ROOT / "fleet.toml")
    assert set(settings.models) >= {"tiny", "a4b", "phonellm", "12b", "31b"}
    assert {"SE", "DE", "CH", "GB", "NO"} <= set(settings.region("eu"))
    assert settings.region("PL") == ["PL"]
    with pytest.raises(config.ConfigError, match="no region 'xx'"):
        settings.region("xx")


def test_profiles_fit_their_architecture():
    settings = config.load(ROOT / "fleet.toml")
    assert "--ctx-checkpoints" in settings.profile("a4b").args  # gemma: checkpoints off
    assert "--ctx-checkpoints" not in settings.profile("phonellm").args  # hybrid: would recompute every turn
    for name in ("a4b", "phonellm"):
        args = settings.profile(name).args
        assert args[args.index("--chat-template-kwargs") + 1] == '{"enable_thinking": false}'


def test_server_argv_fills_file_references_and_adds_port_and_alias():
    settings = config.load(ROOT / "fleet.toml")
    argv = server_argv(settings.profile("a4b"), 41000, {"main": "models/a.gguf", "draft": "models/d.gguf"})
    assert argv[:2] == ["-m", "models/a.gguf"]
    assert argv[argv.index("-md") + 1] == "models/d.gguf"
    assert argv[-4:] == ["--port", "41000", "-a", "a4b"]
    assert not any("{file." in a for a in argv)


def test_profile_may_not_set_what_fleet_sets(tmp_path):
    text = (ROOT / "fleet.toml").read_text().replace('"-t", "1", "--jinja"]', '"-t", "1", "--api-key", "x"]')
    (tmp_path / "fleet.toml").write_text(text)
    with pytest.raises(config.ConfigError, match=r"models\.tiny: args: --api-key is set by fleet"):
        config.load(tmp_path / "fleet.toml")


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
