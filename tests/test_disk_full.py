"""The state file on a full disk: a real, small tmpfs as the runtime folder (root only),
filled to the last byte. Jobs created while the state file cannot be written are kept in
its reserve (written in place, no new blocks), so a kill -9 then loses none; when even the
reserve has no room, a new job is refused with the reason. Real daemon, keeper and client
processes."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from a2ad.daemon import persist
from a2ad.runtime import STATE_FILE
from helpers import REPO, DaemonProcess, finish_process, reap_keeper, wait_for

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def small_fs():
    """A fresh 2 MiB tmpfs (short path: AF_UNIX socket paths are limited)."""
    if os.getuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    d = Path(tempfile.mkdtemp(prefix="a2ad-f-"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        d.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)
        try:
            d.rmdir()
        except OSError:
            pass


def _fill(folder: Path) -> Path:
    """Fill the filesystem of ``folder`` to the last byte; returns the filler file."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        block = b"\xff" * 4096
        while True:
            try:
                f.write(block)
                f.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
        for size in (1024, 256, 64, 16, 1):
            while True:
                try:
                    f.write(b"\xff" * size)
                    f.flush()
                except OSError:
                    break
    # the write really fails now
    with pytest.raises(OSError) as ei:
        with open(folder / "probe", "wb", buffering=0) as f:
            f.write(b"x" * 8192)
            f.flush()
            os.fsync(f.fileno())
    assert ei.value.errno == errno.ENOSPC
    try:
        os.unlink(folder / "probe")
    except FileNotFoundError:
        pass
    return filler


#: Attaches one-rank jobs on request ("attach NAME" on stdin -> "OK NAME" or "ERR code msg")
#: and holds them all until stdin closes.
MULTI = r"""
import sys
from a2ad import errors
from a2ad.client import attach
rt = sys.argv[1]
held = []
for line in sys.stdin:
    cmd, _, name = line.strip().partition(" ")
    if cmd != "attach":
        break
    try:
        held.append(attach(name, 0, 1, runtime_dir=rt, timeout=30, max_num_tokens=16, top_k=2, num_experts=8,
                           workspace_size_per_rank=1 << 16))
        print("OK", name, flush=True)
    except errors.A2ADError as exc:
        print("ERR", exc.code, exc.message, flush=True)
for a in held:
    a.close()
"""


def _ask(p: subprocess.Popen, name: str) -> str:
    p.stdin.write(f"attach {name}\n")
    p.stdin.flush()
    line = p.stdout.readline()
    assert line, f"the holder ended (exit {p.poll()})"
    return line.strip()


@pytest.mark.full
def test_kill9_on_a_full_disk_readopts_every_attached_job(small_fs):
    rt = small_fs
    args = ("--backend", "host", "--grace", "60", "--fd-store", "keeper")
    d = DaemonProcess(rt, *args)
    d.log_path = Path(tempfile.gettempdir()) / f"{rt.name}-d1.log"
    d2 = None
    holder = None
    before, after = 11, 22
    try:
        d.start()
        holder = subprocess.Popen([sys.executable, "-c", MULTI, str(rt)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=str(REPO))
        names = [f"full:{i:02d}" for i in range(before + after)]
        for n in names[:before]:
            assert _ask(holder, n) == f"OK {n}"
        wait_for(lambda: len((persist.load(rt) or {}).get("jobs", [])) == before, 20, "the first jobs on disk")
        assert (rt / persist.RESERVE_FILE).stat().st_size >= 2 * persist.MIN_RESERVE_COPY
        filler = _fill(rt)
        for n in names[before:]:
            assert _ask(holder, n) == f"OK {n}"
        st = d.request("status")
        assert st["state_file"].startswith("failing:") and "kept in the reserve" in st["state_file"], st["state_file"]
        on_disk = len(persist._load_file(rt)["jobs"])
        assert on_disk == before  # the state file itself is stale: the disk is full
        d.kill9()
        d2 = DaemonProcess(rt, *args)
        d2.log_path = Path(tempfile.gettempdir()) / f"{rt.name}-d2.log"
        d2.start()
        jobs = {j["name"]: j for j in d2.request("jobs")["jobs"]}
        adopted = sorted(n for n in names if n in jobs and jobs[n]["ranks_attached"] == 1)
        print(f"figure: kill -9 with a full disk: {len(adopted)} of {len(names)} attached jobs re-adopted "
              f"({before} created before the disk filled, {after} after; the state file itself held {on_disk})")
        assert adopted == names, sorted(set(names) - set(adopted))
        assert "is newer than state.msgpack" in d2.log()
        # room again: the state file catches up
        os.unlink(filler)
        wait_for(lambda: len(persist._load_file(rt)["jobs"]) == len(names), 30, "the state file written again")
        assert d2.request("status")["state_file"] == "ok"
    finally:
        if holder is not None:
            try:
                holder.stdin.close()
            except OSError:
                pass
            finish_process(holder, 20)
        if d2 is not None:
            d2.stop()
        d.stop()
        reap_keeper(rt)
        for p in (d.log_path, getattr(d2, "log_path", None)):
            if p is not None and Path(p).exists():
                Path(p).unlink()


def _rec(i: int) -> dict:
    return {"name": f"j{i}", "ep_size": 1, "spec": {"max_num_tokens": 8}, "size_per_rank": 4096, "row_stride": 4096,
            "generation": 0, "slots": [{"rank": 0, "state": 2, "pid": 1, "uid": 0, "device": "host",
                                        "lease": b"\x01" * 16, "deaths": 0, "attaches": 1,
                                        "alloc": {"size": 4096, "handle_type": "memfd"}}], "pad": "x" * 200}


def test_a_full_disk_with_no_room_in_the_reserve_refuses_new_jobs(small_fs):
    """The writer on its own: changes go into the reserve while the file fails; once the state
    outgrows the reserve's copies (and the disk is full, so it cannot grow), refusal() says
    why, and load() still returns the last copy that fitted."""
    rt = small_fs
    w = persist.StateWriter(rt, reserve=True)
    recs = [_rec(i) for i in range(2)]
    w.mark_dirty()
    assert w.flush(lambda: recs, "host", 0.0) is True and w.refusal(2000) is None
    copy = w.reserve.copy
    _fill(rt)
    recs = [_rec(i) for i in range(40)]
    w.mark_dirty()
    assert w.flush(lambda: recs, "host", 1.0) is False
    assert w.in_reserve and not w.healthy and w.refusal(2000) is None
    got = persist.load(rt)
    assert [r["name"] for r in got["jobs"]] == [f"j{i}" for i in range(40)]
    # grow the state past one copy of the reserve: the disk cannot give more
    n = 40
    while len(persist.encode_state([_rec(i) for i in range(n)], "host", 1)) + 64 < copy:
        n += 200
    big = [_rec(i) for i in range(n)]
    w.mark_dirty()
    w.flush(lambda: big, "host", 100.0, force=True)
    why = w.refusal(2000)
    assert why is not None and "cannot be written" in why and "reserve" in why, why
    print(f"figure: refusal with the reserve full: {why}")
    assert len(persist.load(rt)["jobs"]) == 40  # the last copy that fitted


def test_a_torn_reserve_copy_falls_back_to_the_other(tmp_path):
    """The reserve's two copies alternate; a copy whose write did not finish (its CRC does
    not match) is passed over for the other, and a newer state file wins over both."""
    res = persist.Reserve(tmp_path)
    assert res.ensure(1000)
    one = persist.encode_state([_rec(1)], "host", 1)
    two = persist.encode_state([_rec(1), _rec(2)], "host", 2)
    res.write(one, 1)
    res.write(two, 2)
    assert persist.load(tmp_path)["seq"] == 2
    with open(res.path, "r+b") as f:  # tear copy 2 (the second slot): one byte of its data
        f.seek(res.copy + 64)
        b = f.read(1)
        f.seek(res.copy + 64)
        f.write(bytes([b[0] ^ 0xFF]))
    got = persist.load(tmp_path)
    assert got["seq"] == 1 and [r["name"] for r in got["jobs"]] == ["j1"]
    assert persist.Reserve(tmp_path)._next == 1  # a restarted writer overwrites the torn (older) copy first
    persist.write_state(tmp_path, [_rec(7)], "host", seq=5)
    assert [r["name"] for r in persist.load(tmp_path)["jobs"]] == ["j7"]
