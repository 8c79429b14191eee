"""A profile's chat template on this machine: find its text, render it as llama-server's `--jinja` does,
and run the renderings check on it before anything is rented.

The text is the profile's `chat_template` (a file fleet ships in fleet/templates/, named by file name,
or a path of the user's) or, when it names none, the one in the main GGUF's header
(`tokenizer.chat_template`, read with range requests for the planner anyway). Rendering uses Jinja2
with the settings chat templates are written for (trim_blocks, lstrip_blocks, `raise_exception`), tool
call arguments as objects, and the profile's `--chat-template-kwargs`.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fleet.core.config import Profile
from fleet.core.errors import BadInput
from fleet.probes.call import load_call
from fleet.probes.renderings import Message, Renderings, check_renderings

BOS_TOKEN = "<bos>"  # what stands for the model's BOS token: the check compares renderings with each other


class TemplateError(BadInput):
    """A chat template that cannot be read or rendered, or that breaks the prompt cache unaccepted."""


def bundled(name: str) -> str:
    """The text of a template fleet ships (fleet/templates/NAME)."""
    return resources.files("fleet.templates").joinpath(name).read_text()


def template_text(profile: Profile, config_dir: Path, gguf_template: str | None) -> tuple[str | None, str]:
    """(text, where it came from) of the template llama-server will use for this profile: the profile's
    file, else the model file's own (None when it carries none: llama-server falls back to its default)."""
    name = profile.chat_template
    if name is None:
        return (gguf_template, "the model file's header") if gguf_template else (None, "none")
    if "/" not in name:
        try:
            return bundled(name), f"fleet/templates/{name}"
        except FileNotFoundError:
            raise TemplateError(f"models.{profile.name}.chat_template: fleet ships no template {name!r}") from None
    path = (config_dir / Path(name).expanduser()).resolve()
    try:
        return path.read_text(), str(path)
    except OSError as e:
        raise TemplateError(f"models.{profile.name}.chat_template: cannot read {path}: {e.strerror}") from None


def template_kwargs(profile: Profile) -> dict[str, Any]:
    """What `--chat-template-kwargs` passes to the template (`{"enable_thinking": false}`)."""
    args = profile.args
    if "--chat-template-kwargs" not in args:
        return {}
    raw = args[args.index("--chat-template-kwargs") + 1 :][:1]
    try:
        value = json.loads(raw[0]) if raw else None
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise TemplateError(f"models.{profile.name}.args: --chat-template-kwargs takes a JSON object")
    return value


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _with_object_arguments(messages: list[Message]) -> list[Message]:
    """Tool call arguments as objects (keys in the model's order), as llama-server hands them to templates."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


class LocalRenderer:
    """Renders one template text the way the renderings check asks (fleet/probes/renderings.Render)."""

    def __init__(self, text: str, kwargs: dict[str, Any]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise
        try:
            self.template = env.from_string(text)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"the chat template does not parse: line {e.lineno}: {e.message}") from None
        self.kwargs = kwargs

    async def __call__(self, messages: list[Message], tools: list[dict[str, Any]], generation_prompt: bool) -> str:
        try:
            return self.template.render(
                messages=_with_object_arguments(messages),
                tools=tools or None,
                add_generation_prompt=generation_prompt,
                bos_token=BOS_TOKEN,
                eos_token="",
                **self.kwargs,
            )
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template failed to render: {e}") from None


async def _no_tokenizer(text: str) -> int | None:
    return None


async def check_text(text: str, kwargs: dict[str, Any]) -> Renderings:
    """The renderings check on a template's text, rendered here (no server, no GPU)."""
    call = load_call()
    return await check_renderings(
        LocalRenderer(text, kwargs), _no_tokenizer, call.system, call.user_turns[0], call.tools
    )


def refusal(profile: Profile, source: str, result: Renderings) -> str | None:
    """The one-line reason `fleet up` refuses this profile, or None when every break is accepted."""
    breaks = result.unaccepted(profile.accept_template_breaks)
    if not breaks:
        return None
    first = breaks[0]
    more = f" (and {len(breaks) - 1} more shape(s): {', '.join(b.shape for b in breaks[1:])})" if breaks[1:] else ""
    return (
        f"{profile.name}: its chat template ({source}) breaks the prompt cache: {first.describe()}{more}; "
        f"name a repaired template in models.{profile.name}.chat_template, or accept the break in "
        f"models.{profile.name}.accept_template_breaks"
    )
