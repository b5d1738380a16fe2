"""gRPC snapshot client: lists, fetches and verifies a peer's snapshots and reads its live status (the
`swarmnode fetch` / `swarmnode status` commands are built on it in `cli/commands.py`).

The client streams a snapshot into a temporary file next to its destination while hashing it, resumes
a broken stream from the bytes it has, and keeps the file only when its sha256 equals the snapshot id
the peer announced. It hashes and writes on a worker thread per chunk: on the loop it would be a little
faster, but a slow disk would stall the loop, which the event loop must never allow (docs/benchmarks.md
"Component measurements" has the figures).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import tenacity

from swarmnode.net.rpc import (
    ChannelCache,
    NodeStatus,
    PeerUnavailable,
    SnapshotMeta,
    SnapshotUnavailable,
    meta_from_pb,
    peer_channel,
    status_from_pb,
)
from swarmnode.proto.v1 import snapshot_pb2 as pb
from swarmnode.proto.v1 import snapshot_pb2_grpc as pb_grpc
from swarmnode.util.labels import FetchFailure
from swarmnode.util.validate import is_sha256_hex

logger = logging.getLogger(__name__)

_REFUSED_CODES = {
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNIMPLEMENTED,
}


@dataclass(frozen=True)
class FetchResult:
    """A verified snapshot now stored at the fetch's destination."""

    snapshot_id: str
    size_bytes: int
    seconds: float
    resumes: int
    """Times the transfer was resumed after a broken or short stream."""
    metadata: SnapshotMeta


def _reason_for(exc: grpc.aio.AioRpcError) -> FetchFailure:
    code = exc.code()
    if code in _REFUSED_CODES:
        return FetchFailure.REFUSED
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return FetchFailure.TIMEOUT
    return FetchFailure.UNREACHABLE if code == grpc.StatusCode.UNAVAILABLE else FetchFailure.TRUNCATED


def _check_sha256(value: str | None, what: str) -> None:
    if value is not None and not is_sha256_hex(value):
        raise ValueError(f"{what} must be a sha256 hex digest (64 lowercase hex digits), got {value!r}")


async def list_snapshots(
    address: str, timeout_s: float = 5.0, channels: ChannelCache | None = None
) -> list[SnapshotMeta]:
    """The snapshots a peer serves, newest first (over a cached channel if `channels`). Raises
    SnapshotUnavailable."""
    async with peer_channel(address, channels) as channel:
        try:
            reply = await pb_grpc.SnapshotServiceStub(channel).ListSnapshots(
                pb.ListSnapshotsRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise SnapshotUnavailable(_reason_for(exc), f"{address}: {exc.details()}") from None
    return [meta_from_pb(m) for m in reply.snapshots]


async def get_status(
    address: str, timeout_s: float = 5.0, channels: ChannelCache | None = None
) -> NodeStatus:
    """A peer's live status (over a cached channel if `channels`). Raises PeerUnavailable."""
    async with peer_channel(address, channels) as channel:
        try:
            stub = pb_grpc.SnapshotServiceStub(channel)
            reply = await stub.GetStatus(pb.GetStatusRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise PeerUnavailable(_reason_for(exc), f"{address}: {exc.details()}") from None
    return status_from_pb(reply)


class _PartFile:
    """A temporary file beside the destination, hashed as it is written; `commit` renames it onto the
    destination only if its sha256 matches, `discard` removes it. Disk work runs on worker threads
    (a slow disk never stalls the event loop); the lock keeps `discard` from closing the file under
    a write that a cancelled caller left running."""

    def __init__(self, out_path: Path, fd: int, temp_path: Path) -> None:
        self._out_path, self._temp_path = out_path, temp_path
        self._file = os.fdopen(fd, "wb", buffering=0)
        self._hash = hashlib.sha256()
        self._lock = threading.Lock()
        self.size = 0

    @classmethod
    def create(cls, out_path: Path) -> _PartFile:
        fd, name = tempfile.mkstemp(dir=out_path.parent, prefix=f".{out_path.name}.", suffix=".part")
        return cls(out_path, fd, Path(name))

    async def write(self, data: bytes) -> None:
        self.size += len(data)
        await asyncio.to_thread(self._append, data)

    def _append(self, data: bytes) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(data)
                self._hash.update(data)

    async def commit(self, snapshot_id: str) -> None:
        """Keeps the bytes (fsynced) at the destination if they hash to `snapshot_id`, else raises."""
        _check_digest(self._hash, snapshot_id)
        await asyncio.to_thread(self._sync_and_rename)

    def _sync_and_rename(self) -> None:
        with self._lock:
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._temp_path, self._out_path)

    def discard(self) -> None:
        with self._lock:
            self._file.close()
            self._temp_path.unlink(missing_ok=True)


class _HashOnly:
    """The sink of a download that goes only to `on_data` (a recovery decodes it as it arrives):
    nothing on disk, the bytes hashed and counted all the same."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self.size = 0

    async def write(self, data: bytes) -> None:
        self.size += len(data)
        await asyncio.to_thread(self._hash.update, data)

    async def commit(self, snapshot_id: str) -> None:
        _check_digest(self._hash, snapshot_id)

    def discard(self) -> None:
        pass


def _check_digest(hashed: Any, snapshot_id: str) -> None:
    digest = hashed.hexdigest()
    if digest != snapshot_id:
        raise SnapshotUnavailable(
            FetchFailure.HASH_MISMATCH, f"received bytes hash to {digest}, not {snapshot_id}"
        )


class _Broken(Exception):
    """The stream broke or ended early; the transfer may resume from the bytes it has."""

    def __init__(self, reason: FetchFailure, detail: str) -> None:
        super().__init__(detail)
        self.reason: FetchFailure = reason


MIN_TRANSFER_S = 60.0
MIN_RATE_BYTES_S = 256 << 10
"""A whole transfer may take a minute plus this rate over its size cap, no longer."""


@dataclass
class _Download:
    """One snapshot transfer from one peer, across resumed streams."""

    address: str
    channel: grpc.aio.Channel
    part: _PartFile | _HashOnly
    wanted_id: str | None
    expected_sha256: str | None
    max_bytes: int | None
    chunk_timeout_s: float
    on_bytes: Callable[[int], None] | None
    on_data: Callable[[bytes], Awaitable[None]] | None = None
    meta: SnapshotMeta | None = None
    started: float = field(default_factory=time.monotonic)

    async def run(self, max_resumes: int) -> tuple[SnapshotMeta, int]:
        """Streams until the announced size is in the part file, resuming a broken stream from the
        bytes it has (backing off) up to `max_resumes` times; returns (metadata, resumes)."""
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(self._resumable),
            wait=tenacity.wait_exponential(multiplier=0.1, max=1.0),
            stop=tenacity.stop_after_attempt(max_resumes + 1),
            before_sleep=self._log_resume,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    await self._stream_once()
        except _Broken as exc:
            raise SnapshotUnavailable(exc.reason, f"{self.address}: {exc}") from None
        assert self.meta is not None
        return self.meta, retrying.statistics["attempt_number"] - 1

    def _resumable(self, exc: BaseException) -> bool:
        """A broken stream resumes, unless the peer was never reached at all."""
        return isinstance(exc, _Broken) and not (exc.reason == FetchFailure.UNREACHABLE and self.meta is None)

    def _log_resume(self, state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        logger.info(
            "snapshot stream from %s broke at byte %d (%s); resuming", self.address, self.part.size, exc
        )

    async def _stream_once(self) -> None:
        request = pb.FetchSnapshotRequest(snapshot_id=self._request_id(), offset=self.part.size)
        call = pb_grpc.SnapshotServiceStub(self.channel).FetchSnapshot(request)
        try:
            first = await self._next(call)
            if first is None or not first.HasField("meta"):
                raise _Broken(FetchFailure.TRUNCATED, "stream ended before its metadata")
            self._accept_meta(meta_from_pb(first.meta))
            while (msg := await self._next(call)) is not None:
                await self._accept_chunk(msg)
        finally:
            call.cancel()
        assert self.meta is not None
        if self.part.size < self.meta.size_bytes:
            raise _Broken(
                FetchFailure.TRUNCATED, f"stream ended at byte {self.part.size} of {self.meta.size_bytes}"
            )

    def _request_id(self) -> str:
        if self.meta is not None:  # a resume asks for exactly what the first stream announced
            return self.meta.snapshot_id
        return self.wanted_id or self.expected_sha256 or "latest"

    async def _next(self, call: Any) -> pb.FetchSnapshotChunk | None:
        """The stream's next message (None at its end), within the per-chunk deadline."""
        try:
            async with asyncio.timeout(self.chunk_timeout_s):
                msg = await call.read()
        except TimeoutError:
            raise SnapshotUnavailable(self._silence_reason(), self._silence_detail()) from None
        except grpc.aio.AioRpcError as exc:
            reason = _reason_for(exc)
            # A resume may find the server still holding the broken stream's slot (--max-serving-per-peer):
            # that refusal is worth the backoff and another try, like the break itself.
            busy = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and self.part.size > 0
            if reason in (FetchFailure.REFUSED, FetchFailure.TIMEOUT) and not busy:
                raise SnapshotUnavailable(reason, f"{self.address}: {exc.details()}") from None
            raise _Broken(reason, f"{exc.code().name}: {exc.details()}") from None
        return None if msg is grpc.aio.EOF else msg

    def _silence_reason(self) -> FetchFailure:
        """A peer we never got a gRPC connection to is unreachable; one that went quiet timed out."""
        connected = self.channel.get_state() == grpc.ChannelConnectivity.READY
        return FetchFailure.UNREACHABLE if self.meta is None and not connected else FetchFailure.TIMEOUT

    def _silence_detail(self) -> str:
        return f"{self.address}: no message for {self.chunk_timeout_s:g} s at byte {self.part.size}"

    def _accept_meta(self, meta: SnapshotMeta) -> None:
        """Checks a stream's metadata against the request, the limits and earlier streams."""
        if self.meta is not None and meta != self.meta:
            raise SnapshotUnavailable(
                FetchFailure.REFUSED, f"{self.address} changed the snapshot's metadata on resume"
            )
        for expected in (self.expected_sha256, self.wanted_id):
            if expected is not None and meta.snapshot_id != expected:
                raise SnapshotUnavailable(
                    FetchFailure.HASH_MISMATCH,
                    f"{self.address} offered snapshot {meta.snapshot_id}, not {expected}",
                )
        if self.max_bytes is not None and meta.size_bytes > self.max_bytes:
            raise SnapshotUnavailable(
                FetchFailure.TOO_LARGE,
                f"snapshot {meta.snapshot_id[:12]} has {meta.size_bytes} bytes, over {self.max_bytes}",
            )
        self.meta = meta

    async def _accept_chunk(self, msg: pb.FetchSnapshotChunk) -> None:
        assert self.meta is not None
        if msg.offset != self.part.size:
            raise _Broken(FetchFailure.TRUNCATED, f"chunk at offset {msg.offset}, expected {self.part.size}")
        data = msg.data
        if not data:  # a peer dribbling empty messages would never end the transfer
            raise _Broken(FetchFailure.TRUNCATED, f"an empty chunk at byte {self.part.size}")
        if time.monotonic() - self.started > MIN_TRANSFER_S + self.meta.size_bytes / MIN_RATE_BYTES_S:
            raise SnapshotUnavailable(
                FetchFailure.TIMEOUT, f"{self.address}: the transfer ran below the minimum rate"
            )
        if self.part.size + len(data) > self.meta.size_bytes:
            raise SnapshotUnavailable(
                FetchFailure.TOO_LARGE, f"{self.address} sent more than the announced size"
            )
        await self.part.write(data)
        if self.on_bytes is not None:
            self.on_bytes(len(data))
        if self.on_data is not None:  # the file's bytes in order, once each (resumes continue them)
            await self.on_data(data)


async def fetch_snapshot(
    address: str,
    out_path: Path | None,
    *,
    snapshot_id: str | None = None,
    expected_sha256: str | None = None,
    max_bytes: int | None = None,
    chunk_timeout_s: float = 10.0,
    max_resumes: int = 3,
    on_bytes: Callable[[int], None] | None = None,
    on_data: Callable[[bytes], Awaitable[None]] | None = None,
    channels: ChannelCache | None = None,
) -> FetchResult:
    """Fetches a snapshot (by id; None: the peer's newest, or `expected_sha256` if given) from the
    peer at HOST:PORT into `out_path`, atomically and only once its sha256 equals the announced id
    (and `expected_sha256`); `out_path` None: the bytes go only to `on_data`, still hashed and
    checked. Resumes a broken stream up to `max_resumes` times; a message that takes
    over `chunk_timeout_s` ends the fetch. Uses a cached channel if `channels`. Raises
    SnapshotUnavailable (no file left behind) or ValueError for a malformed address or id."""
    _check_sha256(snapshot_id, "snapshot id")
    _check_sha256(expected_sha256, "expected sha256")
    started = time.monotonic()
    async with peer_channel(address, channels) as channel:
        part = _PartFile.create(out_path) if out_path is not None else _HashOnly()
        try:
            download = _Download(
                address=address,
                channel=channel,
                part=part,
                wanted_id=snapshot_id,
                expected_sha256=expected_sha256,
                max_bytes=max_bytes,
                chunk_timeout_s=chunk_timeout_s,
                on_bytes=on_bytes,
                on_data=on_data,
            )
            meta, resumes = await download.run(max_resumes)
            await part.commit(meta.snapshot_id)
        except BaseException:
            part.discard()
            raise
    seconds = time.monotonic() - started
    logger.info(
        "fetched snapshot %s (%d bytes) from %s in %.2f s",
        meta.snapshot_id[:12],
        meta.size_bytes,
        address,
        seconds,
    )
    return FetchResult(meta.snapshot_id, meta.size_bytes, seconds, resumes, meta)
