"""A host's boot steps run in worker threads (each one starts processes or writes the host's folder, and
blocks while it does). A thread cannot be stopped, so each instance's step in flight is kept where a destroy
finds it: the destroy waits it out before it removes the host, since a step that started sshd after the
removal would leave it running for no instance."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class StepsInFlight:
    def __init__(self) -> None:
        self._running: dict[int, asyncio.Future] = {}

    async def run(self, instance_id: int, step: Callable[[], object]) -> None:
        """Run `step` in a thread and wait for it; a cancelled wait (the cloud's shutdown) leaves it running,
        still found by `ended`. Raises what the step raised."""
        running = asyncio.ensure_future(asyncio.to_thread(step))
        running.add_done_callback(_read)
        self._running[instance_id] = running
        await asyncio.shield(running)

    async def ended(self, instance_id: int) -> None:
        """Return once the instance's step in flight, if any, has ended, whatever it raised."""
        running = self._running.pop(instance_id, None)
        if running is not None:
            await asyncio.wait([running])


def _read(step: asyncio.Future) -> None:
    """A step's error is its boot's to handle; one whose boot was cancelled meanwhile is read here, so that it
    is not reported as never retrieved."""
    if not step.cancelled():
        step.exception()
