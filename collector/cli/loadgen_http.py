"""The load generator's HTTP client: one keep-alive HTTP/1.1 connection on asyncio
streams, cheap in CPU (it shares the machine with the collector it measures)."""

from __future__ import annotations

import asyncio
import os


class KeepAliveConnection:
    """One keep-alive HTTP/1.1 connection on asyncio streams, used by one request at a
    time: the load generator must cost little CPU, since it shares the machine with
    the collector it measures. Nodes that share a connection queue on its lock, first
    come first served (asyncio.Lock is FIFO; a shared pool behind an asyncio.Queue is
    not: a woken waiter loses its slot to a newcomer, and under load some nodes starved
    for 10 s and more, which the collector then saw as dead ranks)."""

    def __init__(self, host: str, port: int, timeout_s: float = 30.0) -> None:
        self.host, self.port = host, port
        self.timeout = timeout_s
        token = os.environ.get("TRAINWARDEN_TOKEN")  # an ingest token, as agents take it
        self.auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self.lock = asyncio.Lock()
        self.retry_after: float | None = None  # the last answer's Retry-After, in seconds
        # Opened on first use, again after the server closes it.
        self.conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, path: str, body: bytes, headers: str = "") -> tuple[int, bytes]:
        """``headers``: more header lines, each ending in CRLF. The answer's status and
        body; its ``Retry-After`` (seconds), if any, is then ``retry_after``."""
        async with self.lock:
            try:
                try:
                    return await self._exchange(path, body, headers)
                except (ConnectionError, asyncio.IncompleteReadError):
                    if self.conn is None:
                        raise
                    # The server closed an idle keep-alive connection: once more on a new one.
                    self.close()
                    return await self._exchange(path, body, headers)
            except BaseException:
                self.close()
                raise

    async def _exchange(self, path: str, body: bytes, headers: str) -> tuple[int, bytes]:
        if self.conn is None:
            self.conn = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.conn
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"{self.auth}{headers}Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        # One timeout for the whole answer (each wait_for is a task: the client's CPU).
        return await asyncio.wait_for(self._answer(reader), self.timeout)

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length, chunked = 0, False
        self.retry_after = None
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"retry-after" and value.strip().isdigit():
                self.retry_after = float(value)
        if chunked:
            return status, await self._chunks(reader)
        return status, await reader.readexactly(length)

    @staticmethod
    async def _chunks(reader: asyncio.StreamReader) -> bytes:
        """A chunked body (a server may send one), read to its end."""
        parts = []
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
            pass
        return b"".join(parts)

    def close(self) -> None:
        if self.conn is not None:
            self.conn[1].close()
            self.conn = None
