"""The renderings check: does a chat template render back what the model said (DOMAIN.md trap 2)?

A warm turn reuses the server's cache only when its prompt starts with the previous prompt plus what the
model said. For six turn shapes of a voice call, the conversation is rendered before each assistant
message (with the generation prompt, as the server sent it) and after it (that message in history,
followed by what the agent sends next); what was rendered before, plus the model's text, must be an
exact prefix of what is rendered after. For a message with tool calls, the rendering after must also
keep each call's arguments in the order the model wrote them.

One thing is reported apart, not as a break: glue at the prompt's end that history does not repeat
(Google's Gemma 4 template with thinking off ends every prompt with an empty thought block,
`<|channel>thought\\n<channel|>`, and drops it from history). It is not a rewrite of what the model
said, but it costs every warm turn the model's whole last turn again (+14 ms a turn on a 3090 in the
field), and where it stands before a rewrite it hides it. fleet's repaired template keeps the block.

The check is pure of I/O: it takes a renderer, so the same check runs against a server's
`/apply-template` (the cache probe) and against the template text on this machine (fleet/probes/template.py,
before `fleet up` rents anything).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]
# (messages, tools, add_generation_prompt) -> the rendered prompt
Render = Callable[[list[Message], list[dict[str, Any]], bool], Awaitable[str]]
# text -> its token count (None when the renderer has no tokenizer)
CountTokens = Callable[[str], Awaitable[int | None]]


def _call(call_id: str, name: str, arguments: dict[str, str]) -> dict[str, Any]:
    # OpenAI's shape: arguments as the JSON text the model wrote, keys in its order
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


# The model writes these keys in an order a sorting template would change (date < time_of_day, city < date).
SLOTS_CALL = _call("call_1", "find_slots", {"time_of_day": "morning", "date": "tuesday"})
WEATHER_CALL = _call("call_2", "check_weather", {"date": "tuesday", "city": "Oslo"})
ONE_ARGUMENT_CALL = _call("call_1", "find_slots", {"date": "tuesday"})
SLOTS_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": '{"slots": ["10:00", "11:30"]}'}
WEATHER_RESULT = {"role": "tool", "tool_call_id": "call_2", "content": '{"forecast": "rain"}'}

# Each shape: what the agent appends after the first user turn. The check runs at each assistant message.
TURN_SHAPES: dict[str, list[Message]] = {
    "plain": [{"role": "assistant", "content": "Sure, one moment."}, {"role": "user", "content": "Thanks."}],
    "tool call": [{"role": "assistant", "content": "", "tool_calls": [SLOTS_CALL]}, SLOTS_RESULT],
    "tool result": [
        {"role": "assistant", "content": "", "tool_calls": [ONE_ARGUMENT_CALL]},
        SLOTS_RESULT,
        {"role": "assistant", "content": "Ten or half past eleven?"},
        {"role": "user", "content": "Ten."},
    ],
    "text before call": [
        {"role": "assistant", "content": "Let me check.", "tool_calls": [ONE_ARGUMENT_CALL]},
        SLOTS_RESULT,
    ],
    "whitespace": [{"role": "assistant", "content": " Okay, booked. \n"}, {"role": "user", "content": "Great."}],
    "multi-call": [
        {"role": "assistant", "content": "", "tool_calls": [SLOTS_CALL, WEATHER_CALL]},
        SLOTS_RESULT,
        WEATHER_RESULT,
        {"role": "assistant", "content": "Both work."},
        {"role": "user", "content": "Ten, then."},
    ],
}


@dataclass(frozen=True)
class PrefixBreak:
    """Where a rendering stopped extending the previous one: `before` is what was expected around
    `at_char` (a character of the later rendering), `after` what the template rendered there."""

    shape: str
    step: int
    at_char: int
    at_token: int | None
    before: str
    after: str

    def describe(self) -> str:
        where = f"token {self.at_token}" if self.at_token is not None else f"character {self.at_char}"
        return f"{self.shape}, step {self.step}: the prefix breaks at {where}: {self.before!r} became {self.after!r}"


@dataclass(frozen=True)
class Glue:
    """Text the generation prompt ends with that history does not repeat: re-processed every turn."""

    shape: str
    text: str
    tokens: int | None


@dataclass(frozen=True)
class Renderings:
    breaks: list[PrefixBreak]
    glue: list[Glue]
    shapes: list[str]

    def unaccepted(self, accepted: list[str] | tuple[str, ...] = ()) -> list[PrefixBreak]:
        return [b for b in self.breaks if b.shape not in accepted]


def first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _common_prefix(a: str, b: str) -> str:
    return a[: first_difference(a, b)]


def _order_break(region: str, calls: list[dict[str, Any]]) -> tuple[int, str] | None:
    """(offset in region, the key the model wrote there) where a call's arguments are rendered in another
    order than the model wrote them; None when they keep it or the template does not render them."""
    cursor = 0
    for call in calls:
        function = call["function"]
        start = region.find(function["name"], cursor)
        if start < 0:
            return None
        keys = list(json.loads(function["arguments"]))
        at = [region.find(key, start) for key in keys]
        if any(i < 0 for i in at):
            return None
        rendered = sorted(at)
        for i, position in enumerate(rendered):
            if at[i] != position:  # the i-th argument the model wrote is not the i-th one rendered
                return position, keys[i]
        cursor = max(at)
    return None


async def check_renderings(
    render: Render, count_tokens: CountTokens, system: str, first_user: str, tools: list[dict[str, Any]]
) -> Renderings:
    """Render every turn shape through `render` and find where a rendering stops extending the last."""
    breaks: list[PrefixBreak] = []
    glue: list[Glue] = []
    for shape, appended in TURN_SHAPES.items():
        messages: list[Message] = [{"role": "system", "content": system}, {"role": "user", "content": first_user}]
        for step, message in enumerate(appended, start=1):
            if message["role"] == "assistant":
                history = await render(messages, tools, False)
                before = await render(messages, tools, True)
                # A trailing assistant message would render as a prefill (left open), so render it in
                # history, followed by what the agent sends next.
                after = await render([*messages, *appended[step - 1 : step + 1]], tools, True)
                base = before
                if before.startswith(history) and after.startswith(history):
                    prompt_end = before[len(history) :]
                    kept = _common_prefix(prompt_end, after[len(history) :])
                    if kept != prompt_end and "\n" in kept:
                        # end what history keeps at a line end, not inside a marker both happen to start
                        # with (`<|` of `<|channel>` and `<|tool_call>`)
                        kept = kept[: kept.rfind("\n") + 1]
                    if kept != prompt_end:
                        lost = prompt_end[len(kept) :]
                        glue.append(Glue(shape, lost, await count_tokens(lost)))
                        base = history + kept
                expected = base + (message.get("content") or "")
                found: PrefixBreak | None = None
                if not after.startswith(expected):
                    at = first_difference(expected, after)
                    found = PrefixBreak(
                        shape,
                        step,
                        at,
                        await count_tokens(after[:at]),
                        expected[max(0, at - 12) : at + 12],
                        after[max(0, at - 12) : at + 12],
                    )
                elif message.get("tool_calls"):
                    reordered = _order_break(after[len(expected) :], message["tool_calls"])
                    if reordered is not None:
                        at = len(expected) + reordered[0]
                        found = PrefixBreak(
                            shape,
                            step,
                            at,
                            await count_tokens(after[:at]),
                            after[max(0, at - 12) : at] + reordered[1],
                            after[max(0, at - 12) : at + 12],
                        )
                if found is not None:
                    breaks.append(found)
                    break
            messages.append(message)
    return Renderings(breaks, glue, list(TURN_SHAPES))
