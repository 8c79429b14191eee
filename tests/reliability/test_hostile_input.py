"""Hostile input: names, labels, URLs, file names and API answers with shell metacharacters, quotes, line
breaks, "..", NUL, huge strings, wrong types, missing fields and unknown values are refused or handled, and
nothing they contain is run. Hypothesis drives the offer and instance parsers, the filters, the GGUF
header reader and the config loader."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.core import config
from fleet.core.errors import FleetError
from fleet.economics import offers
from fleet.engines import registry
from fleet.localcloud import tinymodels
from fleet.market import MarketError, Offer
from fleet.market.answers import instance_from_row
from fleet.plan import gguf as ggufhead
from tests.fleetkit import ROOT, write_config

NASTY = [
    "; touch /tmp/fleet-pwned",
    "$(touch /tmp/fleet-pwned)",
    "`touch /tmp/fleet-pwned`",
    "a'b\"c",
    "line\nbreak",
    "../../etc/passwd",
    "..",
    "nul\x00byte",
    "x" * 100_000,
    "",
    "ünïcödé",
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=50),
    st.sampled_from(NASTY),
)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner))
OFFER_KEYS = [
    "id",
    "machine_id",
    "gpu_name",
    "num_gpus",
    "gpu_ram",
    "geolocation",
    "dph_total",
    "inet_up_cost",
    "inet_down_cost",
    "reliability",
    "reliability2",
    "cuda_max_good",
    "disk_space",
    "direct_port_count",
    "verification",
]
offer_rows = st.one_of(json_values, st.dictionaries(st.sampled_from(OFFER_KEYS), json_values))
REAL_OFFER = json.loads((ROOT / "offers" / "synthetic-eu-2026-11.json").read_text())[0]


@settings(max_examples=400, deadline=None)
@given(row=offer_rows, patch=st.dictionaries(st.sampled_from(OFFER_KEYS), scalars))
def test_the_offer_parser_takes_a_good_offer_or_says_malformed(row, patch):
    for candidate in (row, {**REAL_OFFER, **patch}):
        try:
            offer = Offer.from_raw(candidate)
        except MarketError as e:
            assert "\n" not in str(e) and len(str(e)) <= 300
            continue
        assert isinstance(offer.gpu_name, str) and isinstance(offer.id, int)
        assert all(math.isfinite(x) for x in (offer.dph_total, offer.reliability, offer.cuda_max_good))


@settings(max_examples=300, deadline=None)
@given(
    row=st.one_of(
        json_values,
        st.dictionaries(
            st.sampled_from(["id", "machine_id", "ports", "actual_status", "ssh_port", "public_ipaddr", "dph_total"]),
            json_values,
        ),
    )
)
def test_the_instance_parser_takes_a_good_row_or_says_malformed(row):
    try:
        instance = instance_from_row(row)
    except MarketError as e:
        assert "\n" not in str(e)
        return
    assert isinstance(instance.id, int) and all(isinstance(p, int) for p in instance.ports.values())


finite = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@st.composite
def parsed_offers(draw):
    return Offer(
        id=draw(st.integers(1, 10**9)),
        machine_id=draw(st.integers(1, 50)),
        gpu_name=draw(st.sampled_from(["RTX 3090", "RTX 4090", *NASTY[:6]])),
        num_gpus=draw(st.integers(1, 8)),
        gpu_ram_mb=draw(st.integers(0, 200_000)),
        geolocation=draw(st.sampled_from(["Sweden, SE", "Germany, DE", "US", "", "x, ZZ", *NASTY[:5]])),
        dph_total=draw(finite),
        inet_up_usd_per_gb=draw(finite),
        inet_down_usd_per_gb=draw(finite),
        reliability=draw(st.floats(0, 1)),
        cuda_max_good=draw(st.floats(0, 20)),
        disk_space_gb=draw(finite),
        direct_port_count=draw(st.integers(0, 1000)),
        verified=draw(st.booleans()),
    )


SETTINGS = registry.load(ROOT / "fleet.toml")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    found=st.lists(parsed_offers(), max_size=30), cap=st.one_of(st.none(), finite), excluded=st.sets(st.integers(1, 50))
)
def test_the_funnel_passes_only_what_every_filter_allows_cheapest_first(found, cap, excluded):
    profile = SETTINGS.profile("a4b")
    criteria = offers.Criteria(
        countries=frozenset(SETTINGS.region("eu")),
        filters=SETTINGS.filters,
        min_gpu_ram_gb=24,
        max_usd_per_hour=cap,
        excluded_machines=frozenset(excluded),
    )
    funnel = offers.funnel(found, criteria, profile)
    assert funnel.seen == len(found) and sum(n for _, n in funnel.removed) + len(funnel.passed) == len(found)
    f = SETTINGS.filters
    for o in funnel.passed:
        assert o.country in criteria.countries and o.machine_id not in excluded
        assert o.reliability > f.min_reliability and o.cuda_max_good >= f.min_cuda
        assert o.direct_port_count >= f.min_direct_ports and o.disk_space_gb >= f.min_disk_gb
        assert cap is None or o.dph_total <= cap
    prices = [offers.effective_price_per_hour(o, profile) for o in funnel.passed]
    assert prices == sorted(prices)


@pytest.fixture(scope="module")
def tiny_header(tmp_path_factory) -> bytes:
    path = tinymodels.generate("tiny", tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return path.read_bytes()[:8192]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_gguf_header_reader_reads_or_refuses_any_bytes(tiny_header, data):
    noise = data.draw(st.binary(max_size=512))
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(tiny_header) - 1), st.integers(0, 255)), max_size=8))
    mutated = bytearray(tiny_header)
    for at, byte in flips:
        mutated[at] = byte
    cut = data.draw(st.integers(0, len(mutated)))
    for candidate in (noise, b"GGUF" + noise, bytes(mutated), bytes(mutated[:cut])):
        try:
            header = ggufhead.parse(candidate)
        except (ggufhead.GgufError, ggufhead._NeedMore):
            continue
        assert isinstance(header.tensors, list)


CONFIG_KEYS = [
    ("provider", "url"),
    ("provider", "image"),
    ("database", "path"),
    ("timeouts", "pull"),
    ("caps", "max_hosts_total"),
    ("up", "max_attempts"),
    ("filters", "min_cuda"),
    ("rotation", "reprice_cron"),
    ("probes", "thermal_min_share"),
]
toml_values = st.one_of(
    st.integers(-10, 10**6).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.sampled_from(NASTY[:8]).map(lambda s: json.dumps(s.replace("\x00", ""))),
    st.just("[1, 2]"),
    st.just("{a = 1}"),
    st.just("true"),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), toml_values), max_size=3), junk=st.text(max_size=40))
def test_the_config_loader_loads_or_names_the_problem_in_one_line(tmp_path, edits, junk):
    text = (ROOT / "fleet.toml").read_text()
    for (section, key), value in edits:
        text += f"\n[{section}]\n{key} = {value}\n"  # a second table of the same name: TOML refuses it
    if junk:
        text += "\n" + junk
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    try:
        registry.load(path)
    except config.ConfigError as e:
        message = str(e)
        assert message.startswith(str(path)) and "\n" not in message.strip()
        assert e.exit_code == 2


TINY_FILE = 'file = "tiny-llama-bytes.gguf", revision = "main"'


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        (TINY_FILE, 'file = "..", revision = "main"', "file"),
        ('repo = "fleet-local/tiny-models"', 'repo = "../.."', "repo"),
        (TINY_FILE, 'file = "tiny-llama-bytes.gguf", revision = "main/../../x"', "revision"),
        (TINY_FILE, 'file = "tiny-llama-bytes.gguf", revision = "main?x=1"', "revision"),
        ('"--jinja"]', '"--jinja\\n--api-key"]', "args"),
        ("[models.tiny]", '[models."tiny; rm -rf /"]', "models"),
        ("[regions]\neu = [", '[regions]\n"eu\\nx" = [', "regions"),
    ],
)
def test_a_hostile_fleet_toml_exits_2_naming_the_key(tmp_path, cloud, old, new, key):
    text = (ROOT / "fleet.toml").read_text()
    assert old in text
    path = tmp_path / "fleet.toml"
    path.write_text(text.replace(old, new, 1))
    result = fleet_cli(tmp_path, cloud, "up", "--model", "tiny", "--region", "eu", "--config", str(path))
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2 and len(lines) == 1 and key in lines[0], result.stderr
    assert json.loads((cloud.info.state_dir / "state.json").read_text())["instances"] == {}


@pytest.mark.parametrize(
    "args",
    [
        ["up", "--model", "; touch /tmp/fleet-pwned", "--region", "eu"],
        ["up", "--model", "tiny", "--region", "$(touch /tmp/fleet-pwned)"],
        ["up", "--model", "tiny\nx", "--region", "eu"],
        ["up", "--model", "tiny", "--region", "eu", "--count", "-1"],
        ["destroy", "../../etc/passwd"],
        ["probe", "`touch /tmp/fleet-pwned`"],
        ["bench", "a'b\"c"],
        ["plan", "--model", "x" * 10_000],
    ],
)
def test_hostile_names_on_the_command_line_exit_2_in_one_line_and_run_nothing(tmp_path, cloud, args):
    write_config(tmp_path)
    result = fleet_cli(tmp_path, cloud, *args, "--config", str(tmp_path / "fleet.toml"))
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert not Path("/tmp/fleet-pwned").exists()
    assert json.loads((cloud.info.state_dir / "state.json").read_text())["instances"] == {}


def fleet_cli(tmp_path: Path, cloud, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLEET_LOCALCLOUD_DIR": str(cloud.info.state_dir)}
    return subprocess.run(
        [sys.executable, "-m", "fleet.cli", *args], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )


def test_fleet_errors_have_one_root_and_an_exit_code():
    assert issubclass(config.ConfigError, FleetError) and config.ConfigError.exit_code == 2
    assert issubclass(MarketError, FleetError) and MarketError.exit_code == 1
