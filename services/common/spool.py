"""A local durable spool (outbox) for records Kafka did not acknowledge in time.

One append-only file, ``<dir>/<name>.spool``, one JSON object per line:

- ``{"op": "put", "seq": 7, "ts": 1712.5, "topic": "traces", "key": "<trace id>", "headers": {...},
  "value": "<the record's JSON text>", "crc": "1a2b3c4d"}``: a record to publish; written and fsynced
  before :meth:`Spool.append` returns;
- ``{"op": "ack", "seqs": [7, 8], "crc": "..."}``: those records reached Kafka (flushed, not fsynced: a
  lost ack only means one more, idempotent, re-publish after a crash, never a loss).

``crc`` is the CRC-32 of the line's other fields as canonical JSON (sorted keys, no spaces), so a line
torn by a crash mid-write (or any other damage) is detected: a bad *last* line is logged, skipped and cut
off before the next append; a bad line in the middle is logged and counted in :attr:`Spool.corrupt`.

The file is compacted once nothing is pending (truncated to zero) or when acknowledged records make up
most of it (the pending records rewritten to a temporary file, fsynced, renamed over it, directory
fsynced). An ``flock`` on the file keeps a second process (or a second spool in this one) from sharing it.

Limits are explicit errors, never a silent drop: :class:`SpoolFull` past ``max_records`` pending records
or ``max_bytes`` of them *or when the disk is full* (``ENOSPC``/``EDQUOT``, or a short write; remembered in
:attr:`Spool.full` until a write succeeds or the file is truncated), :class:`SpoolUnavailable` when the
directory cannot be created, the file cannot be opened or locked, or a write or fsync fails otherwise. The class is synchronous and thread-safe (one lock); the
asyncio caller runs :meth:`append` in a worker thread.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.errors import FanrouteError

log = logging.getLogger(__name__)
SUFFIX = ".spool"
_COMPACT_MIN_BYTES = 1 << 20  # below this a file with acknowledged records is left alone
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}


class SpoolError(FanrouteError):
    """The spool cannot take a record; ``kind`` names the error mode (``spool_full``, ``spool_unavailable``)."""

    kind = "spool_error"


class SpoolFull(SpoolError):
    kind = "spool_full"


class SpoolUnavailable(SpoolError):
    kind = "spool_unavailable"


@dataclass(frozen=True)
class SpoolRecord:
    """One record waiting for Kafka: the wire topic, key, headers and value exactly as they are published."""

    seq: int
    ts: float
    topic: str
    key: bytes | None
    value: bytes
    headers: dict[str, str] = field(default_factory=dict)


def _crc(fields: dict[str, Any]) -> str:
    return f"{zlib.crc32(_canonical(fields)) & 0xFFFFFFFF:08x}"


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def encode_line(fields: dict[str, Any]) -> bytes:
    """``fields`` plus their ``crc`` as one JSON line."""
    return _canonical({**fields, "crc": _crc(fields)}) + b"\n"


def decode_line(line: bytes) -> dict[str, Any] | None:
    """The fields of a whole, intact line (its crc checks), else None."""
    if not line.endswith(b"\n"):
        return None
    try:
        fields = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(fields, dict) or not isinstance(fields.get("crc"), str):
        return None
    crc = fields.pop("crc")
    return fields if crc == _crc(fields) else None


def _put_fields(rec: SpoolRecord) -> dict[str, Any]:
    return {"op": "put", "seq": rec.seq, "ts": rec.ts, "topic": rec.topic,
            "key": None if rec.key is None else base64.b64encode(rec.key).decode(),
            "headers": rec.headers, "value": rec.value.decode("utf-8")}


def _record_of(fields: dict[str, Any]) -> SpoolRecord:
    key = fields["key"]
    return SpoolRecord(seq=int(fields["seq"]), ts=float(fields["ts"]), topic=str(fields["topic"]),
                       key=None if key is None else base64.b64decode(key),
                       value=str(fields["value"]).encode("utf-8"), headers=dict(fields.get("headers") or {}))


class Spool:
    """Durable FIFO of :class:`SpoolRecord` in one file; see the module docstring."""

    def __init__(self, directory: Path | str, name: str = "outbox", *, max_bytes: int = 256 << 20,
                 max_records: int = 100_000, fsync: bool = True) -> None:
        self.directory = Path(directory).expanduser()
        self.path = self.directory / f"{name}{SUFFIX}"
        self.max_bytes, self.max_records, self.fsync = max_bytes, max_records, fsync
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pending: dict[int, tuple[SpoolRecord, int]] = {}  # seq -> (record, its line's bytes), in order
        self._pending_bytes = 0
        self._size = 0  # bytes of intact lines in the file (the append offset)
        self._next_seq = 1
        self.corrupt = 0  # damaged lines skipped in the middle of the file (since open)
        self.torn_tail = False  # the last line was cut off by a crash (seen at open)
        self.error: str | None = None  # why the spool is unavailable, while it is
        self.full: str | None = None  # why the disk refused the last write, until one succeeds again

    # ------------------------------------------------------------------ open / close
    def open(self) -> list[SpoolRecord]:
        """Create the directory, lock and read the file; return the pending records, oldest first.

        Raises :class:`SpoolUnavailable` (and remembers why in :attr:`error`) when it cannot.
        """
        with self._lock:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as exc:
                self.error = f"cannot open spool {self.path}: {exc.strerror or exc}"
                raise SpoolUnavailable(self.error) from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                self.error = f"spool {self.path} is in use by another process or gateway"
                raise SpoolUnavailable(self.error) from exc
            self._fd = fd
            try:
                self._recover()
            except OSError as exc:
                self._close_fd()
                self.error = f"cannot read spool {self.path}: {exc.strerror or exc}"
                raise SpoolUnavailable(self.error) from exc
            self.error = None
            return [rec for rec, _ in self._pending.values()]

    def close(self) -> None:
        with self._lock:
            self._close_fd()

    def _close_fd(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)  # releases the flock
            finally:
                self._fd = None

    def _recover(self) -> None:
        assert self._fd is not None
        with os.fdopen(os.dup(self._fd), "rb") as f:
            data = f.read()
        offset, good_end, acked, lines = 0, 0, set(), data.split(b"\n")
        self._pending.clear()
        self._pending_bytes, self.corrupt, self.torn_tail = 0, 0, False
        max_seq = 0
        for i, raw in enumerate(lines):
            if i == len(lines) - 1 and raw == b"":
                break  # the file ends with a newline
            line = raw + b"\n" if i < len(lines) - 1 else raw  # the last piece has no newline: torn
            fields = decode_line(line)
            offset += len(line)
            if fields is None:
                if i >= len(lines) - 2 and (i == len(lines) - 1 or lines[-1] == b""):
                    self.torn_tail = True
                    log.warning("spool %s: torn last line (%d bytes at offset %d) skipped; a crash cut it "
                                "off before it was acknowledged to anyone", self.path, len(line), good_end)
                else:
                    self.corrupt += 1
                    log.error("spool %s: damaged line at offset %d (%d bytes) skipped", self.path,
                              offset - len(line), len(line))
                    good_end = offset
                continue
            good_end = offset
            if fields.get("op") == "put":
                try:
                    rec = _record_of(fields)
                except (KeyError, TypeError, ValueError):
                    self.corrupt += 1
                    log.error("spool %s: malformed put record skipped: %s", self.path, str(fields)[:200])
                    continue
                self._pending[rec.seq] = (rec, len(line))
                self._pending_bytes += len(line)
                max_seq = max(max_seq, rec.seq)
            elif fields.get("op") == "ack":
                acked.update(int(s) for s in fields.get("seqs") or ())
        for seq in acked:
            entry = self._pending.pop(seq, None)
            if entry is not None:
                self._pending_bytes -= entry[1]
        self._pending = dict(sorted(self._pending.items()))
        self._next_seq = max_seq + 1
        self._size = good_end
        if good_end < len(data):
            os.ftruncate(self._fd, good_end)  # cut the torn tail: the next line starts on a clean line
            self._sync()
        if not self._pending and self._size:
            self._truncate_locked()

    # ------------------------------------------------------------------ writing
    def append(self, topic: str, value: bytes, *, key: bytes | None, headers: dict[str, str] | None = None,
               ts: float | None = None) -> SpoolRecord:
        """Write one record durably (fsynced) and return it with its sequence number."""
        with self._lock:
            if self._fd is None:
                raise SpoolUnavailable(self.error or f"spool {self.path} is not open")
            rec = SpoolRecord(seq=self._next_seq, ts=time.time() if ts is None else ts, topic=topic, key=key,
                              value=value, headers=dict(headers or {}))
            line = encode_line(_put_fields(rec))
            if len(self._pending) >= self.max_records:
                raise SpoolFull(f"spool {self.path} holds {len(self._pending)} records; the limit is "
                                f"{self.max_records} (FANROUTE_SPOOL_MAX_RECORDS)")
            if self._pending_bytes + len(line) > self.max_bytes:
                raise SpoolFull(f"spool {self.path} holds {self._pending_bytes} bytes; a {len(line)}-byte record "
                                f"would pass the limit of {self.max_bytes} (FANROUTE_SPOOL_MAX_BYTES)")
            self._write_locked(line)
            self._next_seq += 1
            self._pending[rec.seq] = (rec, len(line))
            self._pending_bytes += len(line)
            return rec

    def ack(self, seqs: Iterable[int]) -> int:
        """Mark records as on Kafka; returns how many were pending. Compacts when worthwhile."""
        with self._lock:
            done = [s for s in dict.fromkeys(seqs) if s in self._pending]
            if not done:
                return 0
            for s in done:
                self._pending_bytes -= self._pending.pop(s)[1]
            if self._fd is None:
                return len(done)
            try:
                if not self._pending:
                    self._truncate_locked()
                else:
                    self._write_locked(encode_line({"op": "ack", "seqs": sorted(done)}), sync=False)
                    if self._size > _COMPACT_MIN_BYTES and self._size > 2 * self._pending_bytes:
                        self._compact_locked()
            except SpoolError as exc:  # an ack not written is a re-publish after a restart, not a loss
                log.warning("spool %s: ack not recorded (%s); those records may be re-published once "
                            "after a restart", self.path, exc)
            return len(done)

    def _write_locked(self, line: bytes, *, sync: bool = True) -> None:
        assert self._fd is not None
        try:
            os.lseek(self._fd, self._size, os.SEEK_SET)
            written = os.write(self._fd, line)
            if written != len(line):  # a regular file only writes short when the disk has no more room
                raise OSError(errno.ENOSPC, f"short write ({written} of {len(line)} bytes)")
            if sync:
                self._sync()
        except OSError as exc:
            try:  # leave no partial line behind for the next append to follow
                os.ftruncate(self._fd, self._size)
            except OSError:
                pass
            reason = f"cannot write spool {self.path}: {exc.strerror or exc}"
            if exc.errno in _NO_SPACE:
                self.full = f"disk full: {reason}"
                raise SpoolFull(self.full) from exc
            raise SpoolUnavailable(reason) from exc
        self._size += len(line)
        self.full = None

    def _sync(self) -> None:
        if self.fsync:
            assert self._fd is not None
            os.fsync(self._fd)

    def _truncate_locked(self) -> None:
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, 0)
            self._sync()
        except OSError as exc:
            raise SpoolUnavailable(f"cannot truncate spool {self.path}: {exc.strerror or exc}") from exc
        self._size = 0
        self.full = None  # its room is free again

    def _compact_locked(self) -> None:
        """Rewrite only the pending records: temp file, fsync, rename over, fsync the directory."""
        assert self._fd is not None
        tmp = self.path.with_name(self.path.name + ".compact")
        body = b"".join(encode_line(_put_fields(rec)) for rec, _ in self._pending.values())
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, body)
                if self.fsync:
                    os.fsync(fd)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise
            os.replace(tmp, self.path)
            if self.fsync:
                dfd = os.open(self.directory, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise SpoolUnavailable(f"cannot compact spool {self.path}: {exc.strerror or exc}") from exc
        os.close(self._fd)
        self._fd = fd
        self._size = len(body)
        log.info("spool %s compacted to %d pending records (%d bytes)", self.path, len(self._pending), len(body))

    # ------------------------------------------------------------------ reading
    def pending(self) -> list[SpoolRecord]:
        """Records not yet acknowledged, oldest first."""
        with self._lock:
            return [rec for rec, _ in self._pending.values()]

    def is_pending(self, seq: int) -> bool:
        with self._lock:
            return seq in self._pending

    @property
    def depth(self) -> int:
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    @property
    def available(self) -> bool:
        return self._fd is not None

    def oldest_age_s(self, now: float | None = None) -> float:
        """Seconds since the oldest pending record was spooled (0 when empty)."""
        with self._lock:
            first = next(iter(self._pending.values()), None)
        if first is None:
            return 0.0
        return max(0.0, (time.time() if now is None else now) - first[0].ts)


__all__ = ["Spool", "SpoolError", "SpoolFull", "SpoolRecord", "SpoolUnavailable", "decode_line", "encode_line"]
