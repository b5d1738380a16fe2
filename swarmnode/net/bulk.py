"""The bulk lane: plain TCP connections beside gRPC that carry an all-reduce part's bytes and its
average (averaging.proto, `Exchange`; docs/design.md "The swarm").

gRPC stays the control plane: the call's header is admitted (and its signature checked) there, and
the reducer's answer names a port and a one-time ticket. The sender connects, writes the ticket, and
then only raw bytes travel: no protobuf framing, no HTTP/2 frames, no copies in or out of messages,
each byte received straight into the buffer it ends in (`receive_into`); docs/benchmarks.md "How the
all-reduce's costs divide" has what that saves.

A ticket binds a connection to the one admitted call that offered it: 16 random bytes, unknown to
anyone who did not read that call's metadata. A connection whose first 16 bytes are not a pending
ticket, or that does not send them within `TICKET_TIMEOUT_S`, is closed; one that does is answered
with one byte (`ACK`), and a sender moves its part to the lane only once it has that byte, so a lane
that the reducer did not take (too many strangers' connections pending, say) leaves the part on gRPC.

The lane is as private as the gRPC call it sits beside only where that call is not encrypted, so
nodes offer it only on plaintext swarms (with TLS everything stays on gRPC); chunk signatures travel
on the lane as on gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time

logger = logging.getLogger(__name__)

TICKET_BYTES = 16
TICKET_TIMEOUT_S = 5.0
"""How long an accepted connection may take to present its ticket."""
MAX_PENDING = 1024
"""Tickets offered and not yet used or withdrawn; an offer beyond this is not made (gRPC carries it)."""
MAX_ADMITTING = 64
"""Connections at once that have not yet presented a ticket; more are closed at once."""
DIAL_TIMEOUT_S = 2.0
LINGER_S = 10.0
"""How long an ended lane waits for its peer to close it (see `BulkListener._linger`)."""
UNREACHABLE_FOR_S = 300.0
"""How long a lane that could not be dialled is not tried again (its parts go over gRPC)."""
METADATA_KEY = "swarmnode-bulk"
ACK = b"\x01"
MAX_REMEMBERED = 1024
"""Unreachable lanes remembered at once (`dial`)."""


class BulkListener:
    """One node's listening socket for bulk lanes, and the tickets it has offered."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._pending: dict[bytes, asyncio.Future[socket.socket]] = {}
        self._accepting: asyncio.Task[None] | None = None
        self._admitting: set[asyncio.Task[None]] = set()
        self._lingering: set[asyncio.Task[None]] = set()
        self.port = 0
        self.connections = 0
        """Connections matched to a ticket so far."""

    async def start(self, host: str, port: int = 0) -> int:
        """Listens on HOST:PORT (0: a free port); returns the port. OSError if it cannot bind."""
        infos = await asyncio.get_running_loop().getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self.port = int(sock.getsockname()[1])
        self._accepting = asyncio.create_task(self._accept(sock), name="bulk-accept")
        return self.port

    async def close(self) -> None:
        tasks = [t for t in (self._accepting, *self._admitting, *self._lingering) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()

    def offer(self) -> tuple[bytes, asyncio.Future[socket.socket]] | None:
        """A fresh ticket and the future of the connection that presents it; None if not listening or
        too many are pending. The caller must `release` it."""
        if self._sock is None or len(self._pending) >= MAX_PENDING:
            return None
        ticket = secrets.token_bytes(TICKET_BYTES)
        future: asyncio.Future[socket.socket] = asyncio.get_running_loop().create_future()
        self._pending[ticket] = future
        return ticket, future

    def release(self, ticket: bytes, future: asyncio.Future[socket.socket]) -> None:
        """Forgets the ticket and ends its connection, if one came: what was written on it is still
        delivered (`_linger`)."""
        self._pending.pop(ticket, None)
        if not future.done() or future.cancelled():
            future.cancel()
            return
        task = asyncio.create_task(self._linger(future.result()), name="bulk-linger")
        self._lingering.add(task)
        task.add_done_callback(self._lingering.discard)

    async def _linger(self, conn: socket.socket) -> None:
        """Half-closes the connection and reads (discarding) until the peer closes it, for at most
        `LINGER_S`: closing a socket with unread bytes (a late sender's rest) resets the connection,
        which would destroy the average written to it just before."""
        try:
            conn.shutdown(socket.SHUT_WR)
            async with asyncio.timeout(LINGER_S):
                sink = memoryview(bytearray(1 << 16))
                while await asyncio.get_running_loop().sock_recv_into(conn, sink):
                    pass
        except (OSError, TimeoutError):
            pass
        finally:
            conn.close()

    async def _accept(self, listening: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listening)
            except OSError as exc:  # e.g. out of file descriptors: the lane pauses, gRPC carries on
                logger.warning("bulk lane: accept failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            if len(self._admitting) >= MAX_ADMITTING:
                conn.close()
                continue
            task = asyncio.create_task(self._admit(conn), name="bulk-admit")
            self._admitting.add(task)
            task.add_done_callback(self._admitting.discard)

    async def _admit(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        tune(conn)
        ticket = bytearray(TICKET_BYTES)
        try:
            async with asyncio.timeout(TICKET_TIMEOUT_S):
                await receive_into(conn, memoryview(ticket))
        except (TimeoutError, OSError):
            conn.close()
            return
        future = self._pending.pop(bytes(ticket), None)
        if future is None or future.done():
            conn.close()
            return
        self.connections += 1
        future.set_result(conn)  # before the ACK: the sender's next word (on the call) may come at once
        with contextlib.suppress(OSError):  # a sender gone already: its call sees the lane end
            await asyncio.get_running_loop().sock_sendall(conn, ACK)


def tune(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def offer_metadata(port: int, ticket: bytes) -> tuple[str, str]:
    return METADATA_KEY, f"{port}.{ticket.hex()}"


def parse_offer(metadata: object) -> tuple[int, bytes] | None:
    """(port, ticket) of a bulk offer in a call's initial metadata; None if none or malformed."""
    for key, value in metadata if isinstance(metadata, tuple | list) else ():
        if key != METADATA_KEY or not isinstance(value, str):
            continue
        port_text, _, ticket_hex = value.partition(".")
        if not port_text.isdigit() or not 0 < int(port_text) <= 65535 or len(ticket_hex) != 2 * TICKET_BYTES:
            return None
        try:
            return int(port_text), bytes.fromhex(ticket_hex)
        except ValueError:
            return None
    return None


_unreachable: dict[tuple[str, int], float] = {}


async def dial(
    host: str, port: int, ticket: bytes, timeout_s: float = DIAL_TIMEOUT_S
) -> socket.socket | None:
    """A lane to HOST:PORT that presented `ticket` and was taken (its `ACK` came); None otherwise. A
    lane that cannot be connected to is not tried again for `UNREACHABLE_FOR_S` (a port not forwarded
    through a NAT costs one timeout); one that connects but is not taken is just not used this time."""
    key = (host, port)
    now = time.monotonic()
    if _unreachable.get(key, 0.0) > now:
        return None
    loop = asyncio.get_running_loop()
    sock: socket.socket | None = None
    connected = False
    try:
        async with asyncio.timeout(timeout_s):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, _, _, _, address = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            tune(sock)
            await loop.sock_connect(sock, address)
            connected = True
            await loop.sock_sendall(sock, ticket)
            ack = bytearray(len(ACK))
            await receive_into(sock, memoryview(ack))
            if ack != ACK:
                raise ConnectionError(f"answered {bytes(ack)!r}, not the lane's ACK")
    except (OSError, TimeoutError) as exc:
        if sock is not None:
            sock.close()
        if not connected:
            _remember_unreachable(key, now)
        logger.info("bulk lane to %s:%d not used (%s); its part goes over gRPC", host, port, exc or "timeout")
        return None
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    return sock


def _remember_unreachable(key: tuple[str, int], now: float) -> None:
    if len(_unreachable) >= MAX_REMEMBERED:
        for stale in [k for k, until in _unreachable.items() if until <= now]:
            del _unreachable[stale]
        if len(_unreachable) >= MAX_REMEMBERED:
            _unreachable.clear()
    _unreachable[key] = now + UNREACHABLE_FOR_S


async def receive_into(sock: socket.socket, view: memoryview) -> None:
    """Fills `view` (bytes) from the connection; ConnectionError if it ends first."""
    loop = asyncio.get_running_loop()
    got = 0
    while got < len(view):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise ConnectionError(f"the lane ended after {got} of {len(view)} bytes")
        got += n


async def send(sock: socket.socket, data: bytes | memoryview) -> None:
    """Writes all of `data`; OSError if the connection breaks."""
    await asyncio.get_running_loop().sock_sendall(sock, data)
