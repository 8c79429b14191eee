"""Probe logic on recorded inputs: SSE parsing, first-content rules, nvidia-smi, verdicts, bench pooling."""

import asyncio
import json
from pathlib import Path

import pytest

from fleet.engines.replies import DECODE_SLACK, MOST_COUNT, Timings, count
from fleet.probes.bench import levels_up_to, percentile, summarize
from fleet.probes.cache import Rewrite, WarmTurn, judge_cache
from fleet.probes.gpu import GpuParseError, parse_query_csv
from fleet.probes.keepalive import judge_keepalive
from fleet.probes.renderings import Glue, PrefixBreak
from fleet.probes.server import Server
from fleet.probes.stream import ChatResult, Connection, SseParser, Timing
from fleet.probes.thermal import CardPoint, RatePoint, judge_thermal, one_caller_rate

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi-h200" / "query-gpu-csv.txt"
STREAM = (
    b": ping\n\n"
    b'data: {"choices":[{"delta":{"role":"assistant","content":null}}]}\n\n'
    b'data: {"choices":[{"delta":{"content":""}}]}\n\n'
    b'data: {"choices":[{"delta":{"reasoning_content":"hmm"}}]}\n\n'
    b'data: {"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}\n\n'
    b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
    b'data: {"choices":[{"delta":{"content":" there"},"finish_reason":"stop"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":2},"timings":{"cache_n":3}}\n\n'
    b"data: [DONE]\n\n"
)


def test_sse_parser_survives_any_split_and_skips_comments():
    whole = SseParser().feed(STREAM)
    assert len(whole) == 8 and whole[-1] == "[DONE]"
    for cut in range(1, len(STREAM)):
        parser = SseParser()
        assert parser.feed(STREAM[:cut]) + parser.feed(STREAM[cut:]) == whole
    byte_by_byte = SseParser()
    assert [e for i in range(len(STREAM)) for e in byte_by_byte.feed(STREAM[i : i + 1])] == whole


def test_sse_parser_joins_multi_line_data_and_handles_crlf():
    assert SseParser().feed(b"data: a\r\ndata: b\r\nid: 7\r\n\r\n") == ["a\nb"]


def test_only_non_empty_content_counts_as_first_content():
    result = ChatResult(status=200, timing=Timing(None, 0, None, 0, True))
    counted = [Connection._apply(result, e) for e in SseParser().feed(STREAM)[:-1]]
    assert counted == [False, False, False, False, True, True, False]
    assert result.content == "Hi there" and result.reasoning == "hmm" and result.tool_calls == 1
    assert result.usage["prompt_tokens"] == 10 and result.server_timings == {"cache_n": 3}
    assert result.finish_reason == "stop"


def test_nvidia_smi_parser_on_real_h200_output():
    samples = parse_query_csv(FIXTURE.read_text())
    assert len(samples) == 77 and all(s.name == "NVIDIA H200" for s in samples)
    assert all(s.fan_pct is None for s in samples)  # [N/A] stays missing, never zero
    first = samples[0]
    assert (first.gpu_c, first.memory_c, first.sm_mhz, first.power_limit_w) == (38.0, 38.0, 1980.0, 700.0)
    assert first.mem_total_mib == 143771.0 and first.throttle_mask == 0x1
    loaded = [s for s in samples if s.throttle_mask == 0x4]
    assert len(loaded) == 60 and all(s.sw_power_cap for s in loaded)
    assert max(s.power_w for s in samples) == 694.58 and max(s.gpu_c for s in samples) == 61.0
    assert not any(s.hw_thermal_slowdown or s.sw_thermal_slowdown for s in samples)


def test_nvidia_smi_parser_refuses_garbage():
    with pytest.raises(GpuParseError):
        parse_query_csv("hello, world\n1, 2\n")
    header = FIXTURE.read_text().splitlines()[0]
    with pytest.raises(GpuParseError):
        parse_query_csv(header + "\n1, 2, 3\n")
    assert parse_query_csv("") == []


def cards(temps):
    base = parse_query_csv(FIXTURE.read_text())[0]
    return [CardPoint(i, base.__class__(**{**base.__dict__, "gpu_c": t})) for i, t in enumerate(temps)]


def test_thermal_judges_by_share_not_by_absolute_rate():
    slow_but_steady = [RatePoint(0, 90.0), RatePoint(60, 89.0), RatePoint(120, 88.5)]
    assert judge_thermal(slow_but_steady, [], 0.8, 87, 95).passed
    sagging = [RatePoint(0, 218.6), RatePoint(600, 150.0), RatePoint(1440, 97.6)]
    result = judge_thermal(sagging, [], 0.8, 87, 95)
    assert not result.passed and "decode share fell to 0.45" in result.diagnosis
    assert result.metrics["decode_share"] == pytest.approx(0.446, abs=0.001)


def test_thermal_temperature_limits_and_missing_fields():
    steady = [RatePoint(0, 100.0), RatePoint(5, 100.0)]
    hot = judge_thermal(steady, cards([57, 80, 88]), 0.8, 87, 95)
    assert not hot.passed and "GPU reached 88 C" in hot.diagnosis
    ok = judge_thermal(steady, cards([57, 60]), 0.8, 87, 95)
    assert ok.passed and ok.metrics["gpu_c_max"] == 60 and ok.metrics["card_samples"] == 2
    assert not judge_thermal([RatePoint(0, 100.0)], [], 0.8, 87, 95).passed


def test_cache_verdicts():
    good = [WarmTurn(540, 47, 493, 47), WarmTurn(610, 47, 563, 47)]
    assert judge_cache(good, [], Rewrite(808, 803, 57), 24).passed
    broke = judge_cache([WarmTurn(610, 600, 10, 47)], [], None, 24)
    assert not broke.passed and "re-processed 600 tokens for 47 appended" in broke.diagnosis
    lost = judge_cache(good, [], Rewrite(808, 0, 860), 24)
    assert not lost.passed and "cache lost on a rewritten turn: cache_n 0 of 808" in lost.diagnosis
    rewritten = judge_cache(good, [PrefixBreak("whitespace", 1, 600, 516, " Okay", "Okay,")], None, 24)
    assert not rewritten.passed and "prefix breaks at token 516" in rewritten.diagnosis
    assert rewritten.metrics["prefix_breaks"][0]["shape"] == "whitespace"
    accepted = judge_cache(
        good, [PrefixBreak("whitespace", 1, 600, 516, " Okay", "Okay,")], None, 24, (), ["whitespace"]
    )
    assert accepted.passed and "accepted breaks: whitespace" in accepted.diagnosis


def test_glue_the_template_drops_lets_a_turn_re_process_the_reply_and_no_more():
    glue = [Glue("plain", "<|channel>thought\n<channel|>", 5)]
    # 47 appended + the 30-token reply and 5 tokens of glue re-processed: within 24 of allowance
    turn = WarmTurn(610, 47 + 30 + 5, 528, 47, previous_reply=30)
    assert not judge_cache([turn], [], None, 24).passed  # without the glue finding it is a break
    with_glue = judge_cache([turn], [], None, 24, glue)
    assert with_glue.passed and "re-processes the reply and 5 tokens of glue" in with_glue.diagnosis
    assert with_glue.metrics["glue"] == {"text": "<|channel>thought\n<channel|>", "tokens": 5, "shapes": ["plain"]}
    deeper = WarmTurn(610, 47 + 30 + 5 + 25, 503, 47, previous_reply=30)  # 25 more than reply and glue
    assert not judge_cache([deeper], [], None, 24, glue).passed
    # a rewritten reply keeps the prompt up to the glue, which history never had
    assert judge_cache([turn], [], Rewrite(808, 808 - 24 - 5, 60), 24, glue).passed
    assert not judge_cache([turn], [], Rewrite(808, 808 - 24 - 5 - 1, 60), 24, glue).passed


def test_keepalive_is_reported_and_gates_only_when_asked():
    closed = judge_keepalive(True, False, {"fresh_connect_ms": 0.2}, gate=False)
    assert closed.passed and "closed the connection" in closed.diagnosis
    assert closed.metrics["connection_reused"] is False
    assert not judge_keepalive(True, False, {}, gate=True).passed
    assert judge_keepalive(False, True, {}, gate=True).passed


def recorded(first_ms, decode, predicted, cache_n, prompt, status=200):
    r = ChatResult(status=status, timing=Timing(None, 1.0, first_ms, 50.0, True))
    r.server_timings = {"predicted_per_second": decode, "predicted_n": predicted, "cache_n": cache_n}
    r.usage = {"prompt_tokens": prompt}
    if status != 200:
        r.error = f"HTTP {status}"
    return r


def test_bench_pools_waves_and_counts_throughput_from_server_tokens():
    waves = [
        (0.5, [recorded(20, 100, 32, 900, 1000), recorded(40, 80, 32, 950, 1000)]),
        (0.5, [recorded(30, 90, 32, 990, 1000), recorded(0, 0, 0, 0, 0, status=503)]),
    ]
    level = summarize(2, waves, one_caller_decode=120.0, reconnects=3)
    assert level.requests == 4 and level.errors == 1
    assert level.first_content_p50_ms == 30 and level.first_content_p95_ms == pytest.approx(39.0)
    assert level.decode_per_caller_tok_s == 90 and level.decode_share == 0.75
    assert level.throughput_tok_s == (64 / 0.5 + 32 / 0.5) / 2
    assert level.cache_reuse == 0.95 and level.reconnects == 3
    assert json.loads(json.dumps(level.as_dict()))["callers"] == 2


def test_a_level_reports_the_share_of_drafted_tokens_the_target_accepted():
    """Issue 43: with a draft model llama-server's timings say how many tokens it drafted and how many the target
    accepted; a level pools them over its replies (not a mean of shares: a long reply weighs its tokens)."""
    drafted = [recorded(20, 100, 32, 900, 1000), recorded(30, 90, 32, 900, 1000), recorded(40, 90, 8, 0, 1000)]
    for r, (n, accepted) in zip(drafted, ((30, 24), (10, 1), (4, 4)), strict=True):
        r.server_timings |= {"draft_n": n, "draft_n_accepted": accepted}
    level = summarize(3, [(1.0, drafted)], one_caller_decode=None, reconnects=0)
    assert level.draft_acceptance == pytest.approx(29 / 44)
    assert summarize(1, [(1.0, [recorded(20, 100, 32, 900, 1000)])], None, 0).draft_acceptance is None
    # a host's claim is bounded: never more accepted than drafted, and what is not a count reads as none
    liar = recorded(20, 100, 32, 900, 1000)
    liar.server_timings |= {"draft_n": 5, "draft_n_accepted": 50}
    nonsense = recorded(20, 100, 32, 900, 1000)
    nonsense.server_timings |= {"draft_n": "many", "draft_n_accepted": -3}
    assert summarize(2, [(1.0, [liar, nonsense])], None, 0).draft_acceptance == 1.0


def test_a_number_no_reply_means_reads_as_none_and_stops_nothing():
    """Security round four: `"predicted_n": 1e400` from a host (JSON's infinity) raised OverflowError in int()
    past the probes and thermal, stopped `fleet up` "after an unexpected error" and blamed no machine. Every
    count a reply gives is a whole number from 0 to MOST_COUNT, every rate finite, or it is none."""
    event = (
        '{"choices":[{"delta":{"content":"hi"}}],'
        '"usage":{"prompt_tokens":1e400,"completion_tokens":-4,"total_tokens":12.5,'
        '"prompt_tokens_details":{"cached_tokens":NaN}},'
        '"timings":{"predicted_n":1e400,"prompt_n":Infinity,"cache_n":1099511627777,'
        '"predicted_per_second":1e400,"draft_n":NaN,"draft_n_accepted":3}}'
    )
    result = ChatResult(status=200, timing=Timing(None, 1.0, 10.0, 1010.0, True), max_tokens=32)
    assert Connection._apply(result, event)
    assert result.usage == {}  # no count in it was a count
    assert result.served == Timings()  # nor in its timings; the claimed rate is none
    assert result.decode_tok_s is None and result.whole_tok_s is None
    level = summarize(1, [(1.0, [result])], one_caller_decode=None, reconnects=0)
    assert level.throughput_tok_s == 0 and level.decode_per_caller_tok_s is None and level.draft_acceptance is None
    good = '{"usage":{"prompt_tokens":40,"completion_tokens":8.0,"prompt_tokens_details":{"cached_tokens":32}}}'
    assert Connection._apply(result, good) is False
    assert result.usage == {"prompt_tokens": 40, "completion_tokens": 8, "prompt_tokens_details": {"cached_tokens": 32}}
    assert count(MOST_COUNT) == MOST_COUNT and count(MOST_COUNT + 1) is None and count(True) is None


def test_levels_and_percentiles():
    assert levels_up_to(1) == [1] and levels_up_to(3) == [1, 2, 3] and levels_up_to(12) == [1, 2, 4, 8, 12]
    assert percentile([], 0.5) is None and percentile([5.0], 0.95) == 5.0


def test_fleets_own_query_output_from_a_real_h200_parses_and_judges():
    raw = (FIXTURE.parent.parent / "nvidia-smi-h200-fleet-query" / "query.csv").read_text()
    samples = parse_query_csv(raw)
    assert len(samples) == 25 and all(s.name == "NVIDIA H200" and s.fan_pct is None for s in samples)
    loaded = [s for s in samples if s.sw_power_cap]
    assert len(loaded) >= 10 and all(s.throttle_mask == 0x4 for s in loaded)
    assert max(s.power_w for s in loaded) > 600 and max(s.gpu_c for s in samples) == 63.0
    assert all(s.memory_c is not None and s.sm_mhz is not None for s in samples)
    cards = [CardPoint(i, s) for i, s in enumerate(samples)]
    steady = [RatePoint(0, 100.0), RatePoint(12, 99.0), RatePoint(24, 98.0)]
    verdict = judge_thermal(steady, cards, 0.8, 87, 95)
    assert verdict.passed and verdict.metrics["gpu_c_max"] == 63.0
    assert verdict.metrics["throttle_flags"] == ["sw_power_cap"]
    assert not judge_thermal(steady, cards, 0.8, 60, 95).passed  # the same card, a stricter limit


def test_a_replys_claimed_decode_is_bounded_by_what_arrived():
    """A host's timings may say anything; what arrived here in how long bounds them (with DECODE_SLACK for
    this client's lag), and its token count is no more than the request asked for."""
    liar = ChatResult(status=200, timing=Timing(None, 1.0, 100.0, 1100.0, True), max_tokens=64)
    liar.server_timings = {"predicted_per_second": 1000.0, "predicted_n": 64}
    liar.usage = {"completion_tokens": 10_000}  # more than asked for: counted as 64
    assert liar.decode_tok_s == pytest.approx(63 / 1.0 * DECODE_SLACK)
    honest = ChatResult(status=200, timing=Timing(None, 1.0, 100.0, 1100.0, True), max_tokens=64)
    honest.server_timings = {"predicted_per_second": 60.0, "predicted_n": 64}
    assert honest.decode_tok_s == 60.0
    level = summarize(2, [(1.0, [liar, honest])], one_caller_decode=None, reconnects=0)
    assert level.decode_per_caller_tok_s == pytest.approx((63 * DECODE_SLACK + 60) / 2)


def test_a_reply_without_a_stated_rate_is_read_over_its_whole_time_never_by_its_burst():
    """vLLM states no rate: its tokens over the reply's whole time (request to last byte) are its rate, a bound
    below its decode, whether they streamed or came in one piece (issue 37: a loaded client read 256 tokens
    "at 171,739 tok/s" and judged a healthy host collapsed). A server that states its rate keeps it, bounded by
    what arrived."""
    usage = {"completion_tokens": 256, "prompt_tokens": 40}
    burst = ChatResult(status=200, timing=Timing(None, 5.0, 4998.5, 5000.0, True, first_event_ms=4998.5))
    burst.usage = usage
    assert burst.delivered_tok_s is not None and burst.delivered_tok_s > 100_000  # what arrival said
    assert burst.decode_tok_s == pytest.approx(256 / 5.0)
    streamed = ChatResult(status=200, timing=Timing(None, 5.0, 100.0, 5100.0, True, first_event_ms=100.0))
    streamed.usage = usage
    assert streamed.decode_tok_s == pytest.approx(256 / 5.1)
    stated = ChatResult(status=200, timing=Timing(None, 5.0, 4998.5, 5000.0, True, first_event_ms=4998.5))
    stated.usage, stated.server_timings = usage, {"predicted_per_second": 52.0, "predicted_n": 256}
    assert stated.decode_tok_s == 52.0  # llama-server's own rate: a burst at the client changes nothing
    empty = ChatResult(status=200, timing=Timing(None, 5.0, None, 10.0, True))
    assert empty.decode_tok_s is None


async def test_a_burst_over_a_real_socket_reads_as_the_whole_replys_rate_in_the_thermal_probe():
    """A server in vLLM's shape (usage, no timings) that holds its reply a second and sends every token in one
    write, as vLLM's CPU build did under load: the thermal probe's one caller reads its 64 tokens over the
    whole second, not the thousands of tokens a second their arrival says."""
    replies = 0

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal replies
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            replies += 1
            events = [{"choices": [{"delta": {"content": "x"}}]} for _ in range(64)]
            events.append({"choices": [], "usage": {"completion_tokens": 64, "prompt_tokens": 10}})
            body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(1.0)
            data = body.encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with server:
            conn = Connection(Server(f"http://127.0.0.1:{port}"))
            try:
                result = await conn.chat({"messages": [], "max_tokens": 64})
            finally:
                await conn.close()
            assert result.status == 200 and result.usage["completion_tokens"] == 64
            assert result.delivered_tok_s is not None and result.delivered_tok_s > 1000
            assert result.decode_tok_s is not None and 10 < result.decode_tok_s <= 64
            rate = await one_caller_rate(Server(f"http://127.0.0.1:{port}"), 64)
            assert 10 < rate <= 64 and replies == 2
    finally:
        server.close()
