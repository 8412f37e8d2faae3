"""The durable spool: append (fsynced), order, acks, restart recovery, torn tails, limits, unwritable dirs."""

from __future__ import annotations

import errno
import json
import logging
import os

import pytest

import services.common.spool as spool_mod
from services.common.spool import Spool, SpoolError, SpoolFull, SpoolUnavailable, decode_line, encode_line


def _put(sp: Spool, i: int, **kw):
    return sp.append("ns.traces", json.dumps({"trace_id": f"t{i}", "n": i}).encode(), key=f"t{i}".encode(),
                     headers={"content-type": "application/json"}, **kw)


def test_append_is_fsynced_and_survives_a_restart_in_order(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(spool_mod.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    sp = Spool(tmp_path, "traces")
    assert sp.open() == []
    recs = [_put(sp, i) for i in range(5)]
    assert [r.seq for r in recs] == [1, 2, 3, 4, 5] and len(synced) == 5  # one fsync per append
    assert sp.depth == 5 and sp.oldest_age_s() >= 0
    sp.close()
    again = Spool(tmp_path, "traces")
    left = again.open()
    assert [(r.seq, r.key, json.loads(r.value)["n"]) for r in left] == [(i + 1, f"t{i}".encode(), i)
                                                                        for i in range(5)]
    assert left[0].topic == "ns.traces" and left[0].headers == {"content-type": "application/json"}
    assert _put(again, 5).seq == 6  # sequence numbers continue after a restart


def test_acked_records_are_gone_after_restart_and_an_empty_spool_is_truncated(tmp_path):
    sp = Spool(tmp_path, "traces")
    sp.open()
    for i in range(4):
        _put(sp, i)
    assert sp.ack([2, 3, 99]) == 2
    assert [r.seq for r in sp.pending()] == [1, 4]
    sp.close()
    sp = Spool(tmp_path, "traces")
    assert [r.seq for r in sp.open()] == [1, 4]
    sp.ack([1, 4])
    assert sp.depth == 0 and sp.path.stat().st_size == 0  # drained: the file is truncated
    sp.close()
    assert Spool(tmp_path, "traces").open() == []


def test_a_torn_last_line_is_skipped_with_a_warning_and_cut_off(tmp_path, caplog):
    sp = Spool(tmp_path, "traces")
    sp.open()
    _put(sp, 0)
    _put(sp, 1)
    sp.close()
    whole = sp.path.read_bytes()
    line = encode_line({"op": "put", "seq": 3, "ts": 1.0, "topic": "t", "key": None, "headers": {},
                        "value": "{}"})
    sp.path.write_bytes(whole + line[: len(line) // 2])  # a crash in the middle of the third write
    caplog.set_level(logging.WARNING, logger="services.common.spool")
    sp = Spool(tmp_path, "traces")
    assert [r.seq for r in sp.open()] == [1, 2]
    assert sp.torn_tail and sp.corrupt == 0 and "torn last line" in caplog.text
    assert sp.path.read_bytes() == whole  # cut back to the last intact line
    assert _put(sp, 2).seq == 3
    sp.close()
    assert [r.seq for r in Spool(tmp_path, "traces").open()] == [1, 2, 3]


def test_a_damaged_line_in_the_middle_is_counted_and_the_rest_kept(tmp_path, caplog):
    sp = Spool(tmp_path, "traces")
    sp.open()
    for i in range(3):
        _put(sp, i)
    sp.close()
    lines = sp.path.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"n": 1', b'"n": 7').replace(b"t1", b"t7")  # the crc no longer matches
    sp.path.write_bytes(b"".join(lines))
    assert decode_line(lines[1]) is None
    sp = Spool(tmp_path, "traces")
    assert [r.seq for r in sp.open()] == [1, 3]
    assert sp.corrupt == 1 and not sp.torn_tail and "damaged line" in caplog.text


def test_full_by_records_or_bytes_is_an_explicit_error(tmp_path):
    sp = Spool(tmp_path / "a", "traces", max_records=2)
    sp.open()
    _put(sp, 0)
    _put(sp, 1)
    with pytest.raises(SpoolFull, match="holds 2 records; the limit is 2"):
        _put(sp, 2)
    sp.ack([1])
    assert _put(sp, 3).seq == 3  # room again once a record is acknowledged
    small = Spool(tmp_path / "b", "traces", max_bytes=4096)
    small.open()
    with pytest.raises(SpoolFull, match="limit of 4096"):
        small.append("t", b'"' + b"x" * 5000 + b'"', key=None)
    assert small.depth == 0 and small.path.stat().st_size == 0


def test_an_unwritable_directory_is_unavailable_not_a_crash(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the spool directory should be")
    sp = Spool(blocker / "spool", "traces")
    with pytest.raises(SpoolUnavailable, match="cannot open spool"):
        sp.open()
    assert not sp.available and "cannot open spool" in sp.error
    with pytest.raises(SpoolUnavailable):
        _put(sp, 0)


def test_a_failed_write_leaves_no_partial_line(tmp_path, monkeypatch):
    sp = Spool(tmp_path, "traces")
    sp.open()
    _put(sp, 0)
    size = sp.path.stat().st_size
    real_write = os.write

    def half_then_enospc(fd, data):
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spool_mod.os, "write", half_then_enospc)
    with pytest.raises(SpoolFull, match="disk full.*No space left"):  # a full disk is spool_full, as a limit is
        _put(sp, 1)
    assert sp.full and sp.available  # remembered (healthz reads it) but the spool stays open
    monkeypatch.setattr(spool_mod.os, "write", real_write)
    assert sp.path.stat().st_size == size and sp.depth == 1
    assert _put(sp, 1).seq == 2 and sp.full is None  # a write that succeeds clears it
    sp.close()
    assert [r.seq for r in Spool(tmp_path, "traces").open()] == [1, 2]


@pytest.mark.parametrize("failure", ["short", "eio"])
def test_a_short_write_is_a_full_disk_and_another_write_error_is_unavailable(tmp_path, monkeypatch, failure):
    sp = Spool(tmp_path, "traces")
    sp.open()
    real_write = os.write

    def failing(fd, data):
        if failure == "short":
            return real_write(fd, data[:3])
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(spool_mod.os, "write", failing)
    with pytest.raises(SpoolError) as info:
        _put(sp, 0)
    assert info.value.kind == ("spool_full" if failure == "short" else "spool_unavailable")
    assert (sp.full is not None) == (failure == "short")
    monkeypatch.setattr(spool_mod.os, "write", real_write)
    assert sp.path.stat().st_size == 0 and sp.depth == 0  # nothing half-written left behind


def test_one_spool_file_one_owner(tmp_path):
    first = Spool(tmp_path, "traces")
    first.open()
    with pytest.raises(SpoolUnavailable, match="in use"):
        Spool(tmp_path, "traces").open()
    first.close()
    Spool(tmp_path, "traces").open()


def test_compaction_keeps_only_pending_records_in_order(tmp_path, monkeypatch):
    monkeypatch.setattr(spool_mod, "_COMPACT_MIN_BYTES", 1000)
    sp = Spool(tmp_path, "traces")
    sp.open()
    for i in range(40):
        _put(sp, i)
    sp.ack(range(1, 36))  # 5 left: the file is rewritten with just them
    assert sp.path.stat().st_size < 1000
    assert [r.seq for r in sp.pending()] == [36, 37, 38, 39, 40]
    assert _put(sp, 40).seq == 41
    with pytest.raises(SpoolUnavailable, match="in use"):  # the rewritten file is still locked
        Spool(tmp_path, "traces").open()
    sp.close()
    assert [r.seq for r in Spool(tmp_path, "traces").open()] == [36, 37, 38, 39, 40, 41]
