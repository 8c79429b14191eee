"""A host's root answering in place of llama-server, with the host's own TLS key and certificate: `drip`
sends every answer one byte at a time, each byte its own TLS record, so that every read "arrives in time";
`flood` answers /health with more bytes than anyone should read. The bytes a drip sent are counted in a file.

    python -m tests.dripper drip|flood ADDRESS PORT KEY CERT COUNT_FILE
"""

import asyncio
import logging
import ssl
import sys
from pathlib import Path

HEALTH = b'{"status":"ok"}'
DRIP_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n" + HEALTH
FLOOD_BYTES = 64 << 20


def write_count(count_file: Path, sent: int) -> None:
    """Replaces the file whole: a reader between a truncation and the write would read nothing (run 24)."""
    partial = count_file.with_suffix(".partial")
    partial.write_text(str(sent))
    partial.replace(count_file)


async def main(mode: str, address: str, port: int, key: str, cert: str, count_file: Path) -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    sent = 0

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        try:
            await reader.readuntil(b"\r\n\r\n")
            if mode == "drip":
                for byte in DRIP_ANSWER:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    sent += 1
                    write_count(count_file, sent)
                    await asyncio.sleep(0.5)
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
                writer.write(f"Content-Length: {FLOOD_BYTES}\r\n\r\n".encode())
                chunk = b" " * 65536
                for _ in range(FLOOD_BYTES // len(chunk)):
                    if writer.transport.is_closing():
                        break
                    writer.write(chunk)
                    await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            write_count(count_file, sent)
        finally:
            writer.close()

    server = await asyncio.start_server(answer, address, port, ssl=context)
    print("listening", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    mode, address, port, key, cert, count = sys.argv[1:7]
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # a client hanging up on a flood is the point
    asyncio.run(main(mode, address, int(port), key, cert, Path(count)))
