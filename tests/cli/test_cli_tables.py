"""The commands' tables as people read them (fleet/cli/render.py): a cell is never cut, whatever the width."""

import io

from rich.console import Console

from fleet.cli import render

COLUMNS = ("host", "state", "model", "region", "$/h", "slots", "calls", "url", "machine", "RAM GiB free (srv)")
ROWS = [
    ("tiny-eu-3242abcdef12", "READY", "tiny", "eu", "0.2100", "4", "3", "https://127.0.0.1:41234/v1", "1234", "12.1"),
    ("tiny-eu-99887766aa01", "DRAINING", "tiny", "eu", "0.2300", "4", "0", "https://127.0.0.1:41299/v1", "88", "3.0"),
]


def printed(monkeypatch, console: Console) -> str:
    monkeypatch.setattr(render, "out", console)
    render.table(COLUMNS, ROWS, title="hosts")
    return console.file.getvalue()


def test_a_narrow_terminal_gets_each_host_as_a_block_with_nothing_cut(monkeypatch):
    """Issue 45: `fleet status` cut host names to `tiny-eu-3242…`, which no command takes back."""
    shown = printed(monkeypatch, Console(file=io.StringIO(), width=60, force_terminal=True, color_system=None))
    assert "…" not in shown
    for row in ROWS:
        assert row[0] in shown and row[7] in shown
    lines = shown.splitlines()
    block = lines.index("tiny-eu-99887766aa01")
    assert lines[block + 1].split() == ["state", "DRAINING"]
    assert lines[block + 7].split() == ["url", "https://127.0.0.1:41299/v1"]


def test_a_pipe_gets_the_whole_table_however_wide(monkeypatch):
    shown = printed(monkeypatch, Console(file=io.StringIO(), width=60, soft_wrap=True))
    assert "…" not in shown and "┃ host" in shown  # a table still, as wide as it needs
    for row in ROWS:
        assert all(cell in shown for cell in row)


def test_a_table_that_fits_is_a_table(monkeypatch):
    shown = printed(monkeypatch, Console(file=io.StringIO(), width=200, force_terminal=True, color_system=None))
    assert "┃ host" in shown and "…" not in shown
