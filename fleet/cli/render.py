"""Every table and line the commands print, and their JSON: people read stdout's tables (progress and
errors go to stderr), scripts read `--json`."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from fleet.core.config import Profile
from fleet.economics.offers import effective_price_per_hour

out = Console(soft_wrap=True)
if not out.is_terminal:
    out = Console(soft_wrap=True, width=160)  # piped or captured: no terminal width to fit
err = Console(stderr=True, soft_wrap=True)


def fmt(value: float | None, pattern: str) -> str:
    """A table cell: the value in `pattern`, or '-' when there is none."""
    return "-" if value is None else pattern.format(value)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


Part = str | tuple[str, str]  # plain text, or (text, style)


def clean(text: object, newlines: bool = False) -> str:
    """Text from outside (a host's log, the marketplace's words, a GPU's name) as the terminal may show it:
    no control character, no escape sequence (their ESC goes, the rest shows as text), and no line break unless
    `newlines`. Markup never applies to it: it is shown through Text, never parsed."""
    kept = []
    for ch in str(text):
        if ch == "\n" and newlines:
            kept.append(ch)
        elif ch in "\t\n\r":
            kept.append(" ")
        elif ch.isprintable():
            kept.append(ch)
    return "".join(kept)


def styled(*parts: Part, newlines: bool = False) -> Text:
    """A line made of plain parts (cleaned, never read as markup) and (text, style) parts."""
    return Text.assemble(*(clean(p, newlines) if isinstance(p, str) else (clean(p[0]), p[1]) for p in parts))


def line(*parts: Part, newlines: bool = False) -> None:
    out.print(styled(*parts, newlines=newlines), highlight=False)


def warn(*parts: Part) -> None:
    err.print(styled(*parts), highlight=False)


def table(columns: tuple[str, ...], rows: list[tuple[str, ...]], title: str | None = None, wrap: str = "") -> None:
    """A table of `rows` (each cell shown as text, never as markup); only the column named `wrap` may wrap. No
    cell is ever cut (a host's name or URL is pasted into the next command): written to a file or a pipe, the
    table takes the width it needs; on a terminal too narrow for it, each row is a block of `column: value`
    lines instead."""
    cells = [[clean(cell) for cell in row] for row in rows]
    t = Table(title=title)
    for column in columns:
        t.add_column(column, no_wrap=column != wrap)
    for row in cells:
        t.add_row(*(Text(cell) for cell in row))
    widths = [max([cell_len(c), *(cell_len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    need = sum(widths) + 3 * len(columns) + 1  # each cell's padding and the borders between
    if need <= out.width or wrap:
        out.print(t)
    elif not out.is_terminal:
        Console(file=out.file, soft_wrap=True, width=need).print(t)
    else:
        blocks(columns, cells, title)


def blocks(columns: tuple[str, ...], cells: list[list[str]], title: str | None) -> None:
    """Rows as blocks: the first column's value, then every other column's on a line of its own."""
    if title:
        out.print(Text(title, style="italic"))
    label = max(cell_len(c) for c in columns[1:]) if len(columns) > 1 else 0
    for row in cells:
        out.print(Text(row[0], style="bold"), soft_wrap=True)
        for column, cell in zip(columns[1:], row[1:], strict=True):
            out.print(Text(f"  {column.ljust(label)}  {cell}"), soft_wrap=True)


def offer_row(o: Any, profile: Profile) -> dict[str, Any]:
    return {
        "id": o.id,
        "machine_id": o.machine_id,
        "gpu_name": o.gpu_name,
        "num_gpus": o.num_gpus,
        "gpu_ram_gb": round(o.gpu_ram_mb / 1024, 1),
        "geolocation": o.geolocation,
        "reliability": o.reliability,
        "cuda_max_good": o.cuda_max_good,
        "disk_space_gb": o.disk_space_gb,
        "direct_port_count": o.direct_port_count,
        "inet_up_usd_per_gb": o.inet_up_usd_per_gb,
        "inet_down_usd_per_gb": o.inet_down_usd_per_gb,
        "dph_total": o.dph_total,
        "effective_usd_per_hour": effective_price_per_hour(o, profile),
    }


def offers(title: str, rows: list[dict[str, Any]], funnel: Any) -> None:
    cells = [
        (
            str(r["id"]),
            str(r["machine_id"]),
            f"{r['num_gpus']}x {r['gpu_name']}",
            r["geolocation"][-2:],
            f"{r['reliability']:.3f}",
            f"{r['dph_total']:.4f}",
            f"{r['effective_usd_per_hour']:.4f}",
            f"{max(r['inet_up_usd_per_gb'], r['inet_down_usd_per_gb']):.3f}",
            f"{r['expected']['usd_per_voice_minute']:.5f}",
            r["expected"]["why"],
        )
        for r in rows
    ]
    columns = ("offer", "machine", "GPU", "country", "reliab.", "$/h", "eff. $/h", "$/GB", "$/voice-min", "why")
    table(columns, cells, title=title)
    line(f"funnel: {funnel.seen} offered" + (f" (the marketplace applied: {funnel.asked})" if funnel.asked else ""))
    for name, count in funnel.removed:
        line(f"  - {count:4d} removed by {name}")
    line(f"  = {len(rows)} pass")
    for what in funnel.unknown:
        line(("unknown", "yellow"), f": {what}")
    if funnel.truncated:
        dearest = max((o.dph_total for o in funnel.offers), default=0.0)
        line(
            ("the answer was full", "yellow"),
            f": the marketplace answers at most {funnel.limit} offers, cheapest "
            f"first; offers above ${dearest:.4f}/h went unseen (filters.search_limit, or narrow with --max-price)",
        )


def attempts_and_ready(result: Any) -> None:
    """`fleet up`'s outcome: each failed attempt, each READY host, why a requested host did not come up."""
    for a in result.attempts:
        if a.outcome != "ready":
            line(
                f"attempt {a.host}: offer {a.offer_id} (${a.dph_total:.4f}/h, ${a.inet_usd_per_gb:.3f}/GB) "
                f"failed in {a.phase}: {a.reason}"
            )
    for h in result.ready:
        line(("READY", "green"), f" {h.name} {h.api_url} {h.gpu_name} {h.geolocation} ${h.dph_total:.4f}/h")
    for f in result.failures:
        warn(("not up:", "red"), f" {f}")


def standby(rows: list[dict[str, Any]], failures: list[str]) -> None:
    for r in rows:
        line(
            ("STANDBY", "cyan"),
            f" {r['host']} {r['gpu_name']} {r['geolocation']}: "
            f"${r['storage_usd_per_hour']:.4f}/h stopped (${r['running_usd_per_hour']:.4f}/h running)",
        )
    for f in failures:
        warn(("not in the pool:", "red"), f" {f}")


def status(hosts: list[dict[str, Any]]) -> None:
    columns = (
        "name",
        "state",
        "instance",
        "GPU",
        "where",
        "$/h",
        "cost $",
        "calls (speakers)",
        "$/voice-min",
        "RAM GiB free (srv)",
        "contract ends",
        "endpoint",
    )
    rows = [
        (
            h["name"],
            h["state"],
            str(h["instance_id"] or "-"),
            h["gpu_name"],
            h["geolocation"][-2:],
            f"{h['usd_per_hour']:.3f}",
            f"{h['accrued_usd']:.4f}",
            held_calls(h),
            "-" if h["usd_per_voice_minute"] is None else f"{h['usd_per_voice_minute']:.5f}",
            host_memory(h),
            h["contract_end_at"][:16].replace("T", " ") if h["contract_end_at"] else "-",
            h["endpoint"] or "-",
        )
        for h in hosts
    ]
    table(columns, rows)


def host_memory(h: dict[str, Any]) -> str:
    """The last health sweep's read: the machine's RAM available, the server's resident set beside it."""
    if h.get("ram_available_mib") is None:
        return "-"
    server = "-" if h["server_rss_mib"] is None else f"{h['server_rss_mib'] / 1024:.1f}"
    return f"{h['ram_available_mib'] / 1024:.1f} ({server})"


def held_calls(h: dict[str, Any]) -> str:
    """What a host holds: calls in conversation, with the speakers at once beside them ("12 (4)")."""
    if h["capacity"] is None:
        return "-"
    speakers = f"{'>=' if h['capacity_at_least'] else ''}{h['capacity']}"
    if h.get("calls_capacity") is None:
        return f"- ({speakers})"
    return f"{'>=' if h['calls_at_least'] else ''}{h['calls_capacity']} ({speakers})"


def machines(found: list[Any]) -> None:
    columns = (
        "machine",
        "GPU",
        "where",
        "hosts",
        "READY",
        "pull MB/s",
        "to READY s",
        "decode tok/s",
        "thermal",
        "callers",
        "probes failed",
        "failures",
        "blacklisted",
    )
    rows = []
    for m in found:
        failed = ", ".join(f"{name} {c['failed']}" for name, c in m.probes.items() if c["failed"]) or "-"
        rows.append(
            (
                str(m.machine_id),
                m.gpu_name,
                m.geolocation[-2:],
                str(m.hosts),
                str(m.ready),
                fmt(m.pull_mb_s, "{:.1f}"),
                fmt(m.create_to_ready_s, "{:.0f}"),
                fmt(m.one_caller_decode_tok_s, "{:.1f}"),
                fmt(m.thermal_share, "{:.2f}"),
                fmt(m.capacity, "{}"),
                failed,
                ", ".join(f"{phase} {n}" for phase, n in m.failures.items()) or "-",
                f"{m.blacklistings} ({m.last_blacklist_reason})" if m.blacklistings else "-",
            )
        )
    table(columns, rows)


def destroyed(report: Any, session: Any) -> None:
    """`fleet destroy`: what was destroyed, what was left to another process, and the bill."""
    for h in report.done:
        line(f"{h.name}: {h.state} (instance {h.instance_id or '-'}, cost ${h.accrued_usd or 0:.4f})")
    for h in report.busy:
        line(
            f"{h.name}: left alone: {h.state} under another fleet process ({h.owner}) until "
            f"{h.lease_until:%H:%M:%S} UTC; run again once it is done"
        )
    if not report.done and not report.busy:
        line("nothing to destroy")
    if report.serve_paused:
        line(
            "the serve targets are paused (a daemon would rent their hosts again): `fleet serve --resume` resumes them"
        )
    if report.gateway_stopped:
        line(
            f"the gateway stopped (HAProxy pid {report.gateway_stopped}): its agents' connections are refused until"
            " `fleet gateway start` (--keep-gateway leaves it answering 503, no host)"
        )
    if session.lines:
        rows = [
            (
                b.host,
                b.gpu_name,
                b.geolocation[-2:],
                f"{b.hours:.3f}",
                f"{b.rent_usd:.4f}",
                f"{b.pull_usd:.4f}",
                f"{b.traffic_usd:.4f}",
                f"{b.total_usd:.4f}",
            )
            for b in session.lines
        ]
        columns = ("host", "GPU", "where", "hours", "rent $", "pull $", "traffic $", "total $")
        table(columns, rows, title="the bill")
        line(f"total: ${session.total_usd:.4f} (traffic at the profiles' expected rates)")
        for b in session.lines:
            if b.lost:
                warn(("lost:", "red"), f" {b.host}: {b.lost}")


def probe_results(results: list[Any]) -> None:
    for r in results:
        mark = ("pass", "green") if r.passed else ("FAIL", "red")
        shown = {k: v for k, v in r.metrics.items() if k != "series"}
        line(mark, f" {r.name}: {r.diagnosis}")
        line(f"     {json.dumps(shown, default=str)}")


def health(reports: list[Any]) -> None:
    for r in reports:
        mark = ("ok", "green") if r.healthy else (f"failing ({r.failures})", "red")
        extra = f"; replaced by {r.replaced_by}" if r.replaced_by else ""
        line(f"{r.name}: ", mark, f" {'' if r.healthy else r.reason}{extra}")
    if not reports:
        line("no READY host")


def reprice(moves: list[Any], dry_run: bool) -> None:
    rows = []
    for m in moves:
        moved = ("-" if not m.move else (m.new_host or "failed")) if not dry_run else ("yes" if m.move else "no")
        rows.append(
            (
                m.name,
                f"{m.current_usd_per_hour:.4f}",
                str(m.best_offer or "-"),
                "-" if m.best_usd_per_hour is None else f"{m.best_usd_per_hour:.4f}",
                f"{m.saving_percent:.1f}",
                f"{m.saving_usd_per_month:.2f}",
                moved,
                m.why,
            )
        )
    columns = ("host", "now $/h", "best offer", "best $/h", "saving %", "$/month net", "move", "why")
    table(columns, rows, title="reprice" + (" (dry run: nothing changed)" if dry_run else ""), wrap="why")


def reconciled(report: dict[str, Any]) -> None:
    line(
        f"checked {report['checked']} hosts; gone: {len(report['gone'])}; lost from the pool: {len(report['lost'])};"
        f" failed and destroyed: "
        f"{len(report['failed'])}; destroys finished: {len(report['destroyed'])}; adopted: {len(report['adopted'])};"
        f" strays destroyed: {len(report['strays_destroyed'])}; left to their owners: {len(report['busy'])};"
        f" not yet listed: {len(report['waiting'])}"
    )
    for lost in report["lost"]:
        warn(("lost:", "red"), f" {lost['host']}: {lost['why']}")


def pairs(data: dict[str, Any]) -> None:
    """A two-column table of keys and values."""
    t = Table(show_header=False)
    for key, value in data.items():
        t.add_row(Text(clean(key)), Text(clean(value)))
    out.print(t)
