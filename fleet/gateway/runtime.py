"""HAProxy's Runtime API over its admin socket (private to fleet's user): one connection per batch of
commands, answers bounded and parsed strictly."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from pathlib import Path

from fleet.core.errors import FleetError
from fleet.gateway.observed import SlotObserved, parse_observed

MAX_ANSWER = 4 * 1024 * 1024
TIMEOUT_S = 5.0
SAFE_ARGUMENT = re.compile(r"[A-Za-z0-9_.:@/=+()-]{1,512}")


class RuntimeApiError(FleetError):
    """HAProxy's admin socket did not answer, or answered what fleet did not ask for."""


@dataclass(frozen=True)
class ServerState:
    backend: str
    id: int
    name: str
    address: str
    port: int
    admin_state: int  # HAProxy's bits: 0x01 maintenance forced, 0x08 drain forced
    weight: int

    @property
    def in_maintenance(self) -> bool:
        return bool(self.admin_state & 0x01)


def checked(*arguments: str) -> str:
    """One command line from parts each of which is a plain word: nothing a record or a host said can add a
    command (`;`), a line, or a space to what HAProxy runs."""
    for a in arguments:
        if not SAFE_ARGUMENT.fullmatch(a):
            raise RuntimeApiError(f"refused to send {a[:40]!r} to HAProxy: not a plain word")
    return " ".join(arguments)


class Runtime:
    def __init__(self, socket: Path) -> None:
        self.socket = socket

    async def run(self, *commands: str) -> list[str]:
        """Each command's answer, in order: one connection each (HAProxy's `;` form runs several, but its
        answers cannot be told apart)."""
        return [await self._send(command) for command in commands]

    async def must(self, command: str) -> str:
        """The command's answer; raises when HAProxy says it failed."""
        (text,) = await self.run(command)
        if refusal(text):
            raise RuntimeApiError(f"HAProxy refused `{' '.join(command.split()[:3])} ...`: {refusal(text)}")
        return text

    async def replace_certificate(self, path: Path, pem: bytes) -> None:
        """Give HAProxy new bytes for a certificate it loaded from `path` (chain and key, PEM), taken by every
        new handshake at once: no restart, no call dropped."""
        text = pem.decode("ascii").strip()
        if "\n\n" in text:
            raise RuntimeApiError(f"{path}: a PEM with an empty line cannot go through the admin socket")
        said = await self.must(f"{checked('set', 'ssl', 'cert', str(path))} <<\n{text}\n")
        if "Transaction" not in said:
            raise RuntimeApiError(f"HAProxy did not take the certificate for {path}: {said.strip()[:200]}")
        said = await self.must(checked("commit", "ssl", "cert", str(path)))
        if "Success" not in said:
            await self.run(checked("abort", "ssl", "cert", str(path)))
            raise RuntimeApiError(f"HAProxy did not commit the certificate for {path}: {said.strip()[:200]}")

    async def _send(self, line: str) -> str:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(self.socket)), TIMEOUT_S)
        except (OSError, TimeoutError) as e:
            raise RuntimeApiError(f"HAProxy's admin socket {self.socket}: {e}") from None
        try:
            writer.write(line.encode() + b"\n")
            await writer.drain()
            data = await asyncio.wait_for(reader.read(MAX_ANSWER + 1), TIMEOUT_S)
            while data and len(data) <= MAX_ANSWER:
                more = await asyncio.wait_for(reader.read(MAX_ANSWER + 1 - len(data)), TIMEOUT_S)
                if not more:
                    break
                data += more
        except (OSError, TimeoutError) as e:
            raise RuntimeApiError(f"HAProxy's admin socket {self.socket}: {e}") from None
        finally:
            writer.close()
        if len(data) > MAX_ANSWER:
            raise RuntimeApiError(f"HAProxy answered over {MAX_ANSWER} bytes")
        return data.decode("utf-8", errors="replace")

    async def servers(self, backend: str | None = None) -> list[ServerState]:
        """Every server's state, or one backend's."""
        (text,) = await self.run(checked("show", "servers", "state", *([backend] if backend else [])))
        return parse_servers_state(text)

    async def stats(self) -> list[dict[str, str]]:
        """`show stat`: a row per frontend, backend and server, by HAProxy's column names."""
        (text,) = await self.run("show stat")
        lines = text.splitlines()
        if not lines or not lines[0].startswith("# "):
            raise RuntimeApiError(f"HAProxy's statistics are not CSV: {text[:100]!r}")
        names = lines[0][2:].split(",")
        return [dict(zip(names, line.split(","), strict=False)) for line in lines[1:] if line]

    async def map_entries(self, map_file: Path) -> dict[str, str]:
        (text,) = await self.run(checked("show", "map", str(map_file)))
        return parse_map(text)

    async def map_entries_if_loaded(self, map_file: Path) -> dict[str, str] | None:
        """The map's entries; None when this HAProxy has no such map (one an older fleet started)."""
        (text,) = await self.run(checked("show", "map", str(map_file)))
        return None if refusal(text) else parse_map(text)

    async def observed(self) -> list[SlotObserved]:
        """What observe.lua counted per target backend and host slot (`fleet metrics`); nothing from an HAProxy
        started without it."""
        (text,) = await self.run("fleet metrics")
        if refusal(text):  # an HAProxy an older fleet started, without observe.lua: nothing observed
            return []
        return parse_observed(text)

    async def table(self, name: str) -> dict[str, dict[str, str]]:
        (text,) = await self.run(checked("show", "table", name))
        return parse_table(text)

    async def tables_used(self) -> dict[str, int]:
        """How many entries each stick table holds (`show table` without a name: a line a table, never its
        entries, whatever their number)."""
        (text,) = await self.run("show table")
        return parse_tables_used(text)


REFUSALS = ("Unknown command", "Require ", "No such", "Can't find", "Permission denied", "'", "Failed", "Unable")


def refusal(answer: str) -> str | None:
    """What HAProxy said when an answer says a command failed (None: it did not)."""
    first = answer.strip().splitlines()[0] if answer.strip() else ""
    return first[:200] if first.startswith(REFUSALS) else None


def parse_servers_state(text: str) -> list[ServerState]:
    lines = [line for line in text.splitlines() if line.strip()]
    header = next((line for line in lines if line.startswith("# be_id")), None)
    if header is None:
        if lines and ("No such" in lines[0] or "Can't find" in lines[0]):
            raise RuntimeApiError(lines[0][:200])
        return []
    names = header[2:].split()
    out = []
    for line in lines:
        if line.startswith("#") or line == "1":
            continue
        fields = dict(zip(names, line.split(), strict=False))
        try:
            out.append(
                ServerState(
                    backend=fields["be_name"],
                    id=int(fields["srv_id"]),
                    name=fields["srv_name"],
                    address=fields["srv_addr"],
                    port=int(fields.get("srv_port", "0") or 0),
                    admin_state=int(fields["srv_admin_state"]),
                    weight=int(fields["srv_uweight"]),
                )
            )
        except (KeyError, ValueError):
            raise RuntimeApiError(f"HAProxy's server state line is not one fleet reads: {line[:200]!r}") from None
    return out


def parse_map(text: str) -> dict[str, str]:
    """`show map` lines: `0xADDR KEY VALUE`."""
    out = {}
    for line in text.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0].startswith("0x"):
            out[parts[1]] = parts[2]
    return out


TABLE_LINE = re.compile(r"# table: ([A-Za-z0-9_.-]+), type: \w+, size:\d+, used:(\d+)")


def parse_tables_used(text: str) -> dict[str, int]:
    """`show table`'s summary: `# table: NAME, type: T, size:N, used:M` a line."""
    return {m.group(1): int(m.group(2)) for line in text.splitlines() if (m := TABLE_LINE.match(line))}


def parse_table(text: str) -> dict[str, dict[str, str]]:
    """`show table` entries: `0xADDR: key=K use=0 exp=... name=value ...`."""
    out = {}
    for line in text.splitlines():
        if not line.startswith("0x"):
            continue
        fields = dict(p.split("=", 1) for p in line.split()[1:] if "=" in p)
        if "key" in fields:
            out[fields.pop("key")] = fields
    return out
