"""The chat template a profile's hosts use, and its renderings check before anything is rented: the profile's
own file, else the one its payload carries (a GGUF file's metadata, a repository's chat_template.jinja or
tokenizer_config.json)."""

from __future__ import annotations

from fleet.context import Context
from fleet.core.config import Profile
from fleet.host.payloads import payload_of
from fleet.probes import template as chat_templates
from fleet.probes.renderings import Renderings


async def template(ctx: Context, profile: Profile) -> tuple[str | None, str]:
    """(text, source) of the template the server will use: the profile's file, else the payload's own (None
    when it carries none: the server falls back to its default)."""
    if profile.name not in ctx.templates:
        embedded = None
        if profile.chat_template is None:
            embedded = await payload_of(profile).embedded_template(ctx, profile)
        ctx.templates[profile.name] = chat_templates.template_text(profile, ctx.settings.source.parent, embedded)
    return ctx.templates[profile.name]


async def chat_template(ctx: Context, profile: Profile) -> str | None:
    """The text of the template fleet puts on the host (the profile's file), or None."""
    return (await template(ctx, profile))[0] if profile.chat_template else None


async def check_template(ctx: Context, profile: Profile) -> Renderings | None:
    """The renderings check on the profile's template, here, before anything is rented; raises
    TemplateError (nothing created) when a shape the profile does not accept breaks the prefix."""
    text, source = await template(ctx, profile)
    if text is None:
        return None
    result = await chat_templates.check_text(text, chat_templates.template_kwargs(profile))
    reason = chat_templates.refusal(profile, source, result)
    if reason is not None:
        raise chat_templates.TemplateError(reason)
    return result
