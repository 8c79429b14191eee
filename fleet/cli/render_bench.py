"""`fleet bench`'s tables: the speaker levels, the conversation levels, both capacities and the cost."""

from __future__ import annotations

from typing import Any

from fleet.cli.render import fmt, line, table
from fleet.economics.capacity import judge_level


def bench(host: str, waves: int, report: Any) -> None:
    target = report.capacity.target
    columns = (
        "callers",
        "first content p50 ms",
        "p95 ms",
        "decode tok/s",
        "share",
        "throughput tok/s",
        "cache reuse",
        "draft accepted",
        "errors",
        "target",
    )
    rows = []
    for result in report.levels:
        level = result.as_dict()
        why = judge_level(result, target)
        rows.append(
            (
                str(level["callers"]),
                fmt(level["first_content_p50_ms"], "{:.1f}"),
                fmt(level["first_content_p95_ms"], "{:.1f}"),
                fmt(level["decode_per_caller_tok_s"], "{:.1f}"),
                fmt(level["decode_share"], "{:.2f}"),
                fmt(level["throughput_tok_s"], "{:.1f}"),
                fmt(level["cache_reuse"], "{:.0%}"),
                fmt(level["draft_acceptance"], "{:.0%}"),
                str(level["errors"]),
                "met" if why is None else f"missed: {why}",
            )
        )
    table(columns, rows, title=f"{host}: a voice call replayed, {waves} measured waves per level")
    held = report.capacity
    if report.kept_capacity is not None:
        line(f"(an earlier bench measured {report.kept_capacity} callers, more than this one tried: kept)")
    line(
        f"capacity: {'at least ' if held.exhausted else ''}{held.callers} concurrent callers at first content "
        f"p95 <= {target.first_content_p95_ms:g} ms and >= {target.decode_tok_s:g} tok/s per caller"
        + (f" ({held.callers + 1} missed: {held.why_missed})" if held.why_missed else "")
    )
    if report.calls is not None:
        bench_calls(host, report.calls, held.callers)
    if report.usd_per_voice_minute is not None:
        over = report.calls.capacity.callers if report.calls else held.callers
        line(
            f"cost: ${report.usd_per_voice_minute:.5f} per voice-minute "
            f"(${report.effective_usd_per_hour:.4f}/h with traffic, over {over} calls"
            + (" in conversation)" if report.calls else " speaking at once)")
        )


def bench_calls(host: str, calls: Any, speakers: int) -> None:
    """The conversation levels, the capacity in calls, and what the speakers predict at the duty measured."""
    target = calls.capacity.target
    columns = ("calls", "turns", "first content p50 ms", "p95 ms", "decode tok/s", "cache reuse", "draft accepted",
               "waited", "peak in flight", "duty", "target")  # fmt: skip
    rows = []
    for level in calls.levels:
        why = judge_level(level, target)
        rows.append(
            (
                str(level.calls),
                str(level.requests),
                fmt(level.first_content_p50_ms, "{:.1f}"),
                fmt(level.first_content_p95_ms, "{:.1f}"),
                fmt(level.decode_per_caller_tok_s, "{:.1f}"),
                fmt(level.cache_reuse, "{:.0%}"),
                fmt(level.draft_acceptance, "{:.0%}"),
                str(level.waited),
                str(level.peak_in_flight),
                fmt(level.duty, "{:.3f}"),
                "met" if why is None else f"missed: {why}",
            )
        )
    table(
        columns, rows, title=f"{host}: calls in conversation, {calls.turn_gap_s:g} s between a reply and the next turn"
    )
    held = calls.capacity
    line(
        f"capacity in calls: {'at least ' if held.exhausted else ''}{held.callers} calls in conversation "
        f"({speakers} speaking at once)"
        + (f" ({held.callers + 1} missed: {held.why_missed})" if held.why_missed else "")
    )
    if calls.predicted is not None:
        line(
            f"predicted from {speakers} speakers at duty {calls.duty:.3f}: {calls.predicted} calls (more than "
            f"{speakers} turns at once at most 5% of the time, within the slots)"
        )
