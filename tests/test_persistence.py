"""Persistence across daemon restarts: the fd keeper with hundreds of fds, named-fd transfers
in batches, the keeper's death and refill, fd-store names systemd accepts (checked against a
real daemon's FDSTORE=1 messages), an all-or-nothing state file, and unusable state files.

Real processes and sockets throughout; every keeper a test starts is told to exit (or
killed) in a finally block."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import resource
import select
import signal
import socket
import string
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest

from a2ad import fdpass
from a2ad.daemon import fdstore, persist
from a2ad.daemon.hostio import RealHost
from a2ad.daemon.fdstore import KeeperStore, cb_name, fdname_is_valid, normalize_name, parse_name, ws_name
from a2ad.runtime import STATE_FILE, python_command
from helpers import (REPO, DaemonProcess, NotifyListener, fd_count, finish_process, reap_keeper, release_holders,
                     wait_attached, wait_for)

pytestmark = pytest.mark.timeout(120)

SPEC = dict(max_num_tokens=32, top_k=2, num_experts=16, dispatch_bytes_per_token=256, combine_bytes_per_token=256)

HOLDER = r"""
import sys, json, time
from a2ad.client import attach
rt, job, rank, n, spec = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
a = attach(job, rank, n, runtime_dir=rt, timeout=60, **spec)
print("ATTACHED", flush=True)
sys.stdin.read()   # hold the attachment until the test closes stdin (or kills us)
a.close()
"""


# --------------------------------------------------------------------------- helpers
def _need_fds(n: int) -> None:
    """Make room for ``n`` more open fds in this process (soft limit up to the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = fd_count(os.getpid()) + n + 64
    if soft != resource.RLIM_INFINITY and soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"needs {want} open fds, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else hard, hard))


def _memfd(content: bytes) -> int:
    fd = os.memfd_create("a2ad-test", os.MFD_CLOEXEC)
    os.write(fd, content)
    return fd


def _content(fd: int, n: int = 64) -> bytes:
    return os.pread(fd, n, 0)


def _close(fds) -> None:
    for fd in list(fds):
        try:
            os.close(fd)
        except OSError:
            pass


def _start_keeper(path: Path, timeout: float = 20.0) -> subprocess.Popen:
    proc = subprocess.Popen(
        python_command("a2ad.daemon.keeper", "--socket", str(path)),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    r, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if r else b""
    if line.strip() != b"READY":
        proc.kill()
        _, err = proc.communicate(timeout=5)
        raise AssertionError(f"keeper did not start: {line!r} {err.decode(errors='replace')}")
    return proc


def _stop_keeper(runtime_dir: Path, *procs) -> None:
    """Ask the keeper at runtime_dir to exit, then make sure every given process is gone."""
    try:
        reap_keeper(runtime_dir)
    except Exception:
        pass
    for p in procs:
        if p is not None:
            finish_process(p, 5)


def _keeper_call(path: Path, req: dict, fds: list[int] | None = None):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        fdpass.send_frame(s, req, fds, timeout=5)
        return fdpass.recv_frame(s, timeout=5)
    finally:
        s.close()


def _keeper_pid(path: Path) -> int:
    reply, fds = _keeper_call(path, {"op": "ping"})
    _close(fds)
    assert reply["ok"]
    return reply["pid"]


def _store_children(store: KeeperStore) -> list[subprocess.Popen]:
    return list(store._children) + ([store._starting] if store._starting is not None else [])


def _record(name: str, ep: int = 2, alloc: bool = True) -> dict:
    return {
        "name": name, "ep_size": ep, "spec": dict(SPEC, workspace_size_per_rank=4096),
        "size_per_rank": 4096, "row_stride": 4096, "generation": 3, "rearms": 1, "rendezvous_count": 1,
        "needs_rearm": False, "created_wall": time.time(),
        "slots": [
            {"rank": r, "state": 2, "pid": 1000 + r, "uid": 0, "device": "host", "lease": b"\x01" * 16,
             "deaths": 0, "attaches": 1, "alloc": {"size": 4096, "handle_type": "memfd"} if alloc else None}
            for r in range(ep)
        ],
    }


def _holder(rt: Path, job: str, rank: int, n: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(rt), job, str(rank), str(n), json.dumps(SPEC)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(REPO),
    )


# --------------------------------------------------------------------------- (a) keeper, 600 fds
def test_keeper_holds_600_fds_and_returns_them_all(runtime_dir):
    _need_fds(1300)
    path = runtime_dir / "keeper.sock"
    proc = _start_keeper(path)
    mine: dict[str, int] = {}
    got: dict[str, int] = {}
    store = store2 = None
    try:
        store = KeeperStore(runtime_dir)  # finds the keeper we started
        assert _keeper_pid(path) == proc.pid
        # 600 one-rank jobs with awkward names: every fd under its own name, content to tell them apart
        for i in range(600):
            job = f"job:{i}.x-{i % 7}" if i % 2 else f"j{i}"
            name = ws_name(job, 0) if i % 3 else cb_name(job)
            mine[name] = _memfd(f"content {i} {name}".encode())
            store.put(name, mine[name])
        assert store.state == "ok"
        store.close(clean=False)  # a daemon that stops and keeps its jobs
        store = None
        assert proc.poll() is None, "the keeper must outlive the daemon's connection"
        store2 = KeeperStore(runtime_dir)
        got = store2.load()
        assert len(got) == 600
        assert set(got) == set(mine)
        for name, fd in got.items():
            assert fd not in mine.values()
            assert _content(fd) == _content(mine[name]), name
            assert os.get_inheritable(fd) is False
    finally:
        _close(got.values())
        _close(mine.values())
        for s in (store, store2):
            if s is not None:
                s.close(clean=False)
        _stop_keeper(runtime_dir, proc)
    assert proc.returncode == 0
    assert not path.exists()


def test_keeper_get_refuses_unchunked_overflow_and_translates_legacy_names(runtime_dir):
    """An old-style 'get' (one frame) cannot carry 200 fds: the keeper says so instead of
    sending a frame the receiver would truncate. Legacy names come back translated, and the
    keeper holds them under the new names afterwards."""
    _need_fds(500)
    path = runtime_dir / "keeper.sock"
    proc = _start_keeper(path)
    fds = {f"ws:old:job:{i}:0": _memfd(f"legacy {i}".encode()) for i in range(200)}
    fds["cb:old:job:0"] = _memfd(b"legacy cb")
    got: dict[str, int] = {}
    store = None
    try:
        names = list(fds)
        for run in fdpass.batches(names):
            reply, extra = _keeper_call(path, {"op": "put_many", "names": run}, [fds[n] for n in run])
            assert reply == {"ok": True, "count": len(run)} and not extra
        reply, extra = _keeper_call(path, {"op": "get"})
        assert reply["ok"] is False and "chunked" in reply["message"] and not extra
        store = KeeperStore(runtime_dir)
        got = store.load()
        assert set(got) == {ws_name(f"old:job:{i}", 0) for i in range(200)} | {cb_name("old:job:0")}
        assert _content(got[ws_name("old:job:7", 0)]) == b"legacy 7"
        assert _content(got[cb_name("old:job:0")]) == b"legacy cb"
        _close(got.values())
        got = store.load()  # the keeper itself now uses the new names
        assert set(got) == {ws_name(f"old:job:{i}", 0) for i in range(200)} | {cb_name("old:job:0")}
    finally:
        _close(got.values())
        _close(fds.values())
        if store is not None:
            store.close(clean=False)
        _stop_keeper(runtime_dir, proc)


# --------------------------------------------------------------------------- (b) named fd transfers
def test_named_fds_1000_over_a_socketpair():
    _need_fds(2200)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fds = {f"ws.job%3A{i}.{i % 8}": _memfd(f"fd {i}".encode()) for i in range(1000)}
    got: dict[str, int] = {}
    errs: list[BaseException] = []

    def send():
        try:
            fdpass.send_named_fds(a, fds, timeout=30)
        except BaseException as exc:  # reported below
            errs.append(exc)

    t = threading.Thread(target=send)
    try:
        t.start()
        got = fdpass.recv_named_fds(b, timeout=30)
        t.join(30)
        assert not errs
        assert set(got) == set(fds)
        for name, fd in got.items():
            assert _content(fd) == _content(fds[name])
        # nothing: an empty transfer is one frame with total 0
        t = threading.Thread(target=fdpass.send_named_fds, args=(a, {}, 5))
        t.start()
        assert fdpass.recv_named_fds(b, timeout=5) == {}
        t.join(5)
    finally:
        t.join(5)
        _close(got.values())
        _close(fds.values())
        a.close()
        b.close()


SENDER = r"""
import os, socket, sys
from a2ad import fdpass
sock = socket.socket(fileno=int(sys.argv[1]))
n = int(sys.argv[2])
fds = {}
for i in range(n):
    fd = os.memfd_create("child")
    os.write(fd, f"child {i}".encode())
    fds[f"cb.c%3A{i}"] = fd
fdpass.send_named_fds(sock, fds, timeout=30)
reply, _ = fdpass.recv_frame(sock, timeout=30)   # the parent says how it went
print("DONE", reply["count"], flush=True)
"""

RECEIVER = r"""
import os, socket, sys
from a2ad import fdpass
sock = socket.socket(fileno=int(sys.argv[1]))
got = fdpass.recv_named_fds(sock, timeout=30)
bad = [n for n, fd in got.items() if os.pread(fd, 64, 0) != ("parent " + n).encode()]
fdpass.send_frame(sock, {"count": len(got), "bad": bad}, timeout=10)
"""


def test_named_fds_1000_across_real_processes():
    _need_fds(1200)
    got: dict[str, int] = {}
    mine: dict[str, int] = {}
    # child -> parent
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen(
        [sys.executable, "-c", SENDER, str(b.fileno()), "1000"],
        pass_fds=[b.fileno()], stdout=subprocess.PIPE, text=True, cwd=str(REPO),
    )
    b.close()
    try:
        got = fdpass.recv_named_fds(a, timeout=60)
        assert len(got) == 1000
        assert all(_content(fd) == f"child {name[len('cb.c%3A'):]}".encode() for name, fd in got.items())
        fdpass.send_frame(a, {"count": len(got)}, timeout=10)
        out, _ = proc.communicate(timeout=30)
        assert out.strip() == "DONE 1000"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        _close(got.values())
        a.close()
    # parent -> child
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(b.fileno())], pass_fds=[b.fileno()], cwd=str(REPO))
    b.close()
    try:
        mine = {f"ws.p{i}.{i}": None for i in range(1000)}
        mine = {n: _memfd(f"parent {n}".encode()) for n in mine}
        fdpass.send_named_fds(a, mine, timeout=60)
        reply, _ = fdpass.recv_frame(a, timeout=60)
        assert reply == {"count": 1000, "bad": []}
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        _close(mine.values())
        a.close()


def test_named_fds_failures_are_typed_bounded_and_close_everything():
    _need_fds(400)
    base = fd_count(os.getpid())
    # the sender goes away after two batches: FdTransferClosed, and nothing received stays open
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fds = [_memfd(b"x") for _ in range(2 * fdpass.BATCH_FDS)]
    try:
        for i in range(2):
            run = fds[i * fdpass.BATCH_FDS:(i + 1) * fdpass.BATCH_FDS]
            fdpass.send_frame(a, {"names": [f"n{i}.{k}" for k in range(len(run))], "more": True, "total": 500}, run)
        a.close()
        with pytest.raises(fdpass.FdTransferClosed):
            fdpass.recv_named_fds(b, timeout=5)
    finally:
        _close(fds)
        b.close()
    assert fd_count(os.getpid()) == base
    # a sender that stops sending: FdTransferTimeout within the bound
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = _memfd(b"y")
    try:
        fdpass.send_frame(a, {"names": ["one"], "more": True, "total": 2}, [fd])
        t0 = time.monotonic()
        with pytest.raises(fdpass.FdTransferTimeout):
            fdpass.recv_named_fds(b, timeout=0.5)
        assert time.monotonic() - t0 < 3
        assert isinstance(fdpass.FdTransferTimeout("x"), TimeoutError)
    finally:
        os.close(fd)
        a.close()
        b.close()
    assert fd_count(os.getpid()) == base
    # names and fds that do not match, a repeated name, a refusal: FdTransferError
    for frame, nfds in [
        ({"names": ["a", "b"], "more": False, "total": 2}, 1),
        ({"names": ["a", "a"], "more": False, "total": 2}, 2),
        ({"names": ["a"], "more": False, "total": 3}, 1),
        ({"ok": False, "message": "no"}, 0),
        ([1, 2], 0),
    ]:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sent = [_memfd(b"z") for _ in range(nfds)]
        try:
            fdpass.send_frame(a, frame, sent)
            with pytest.raises(fdpass.FdTransferError):
                fdpass.recv_named_fds(b, timeout=5)
        finally:
            _close(sent)
            a.close()
            b.close()
        assert fd_count(os.getpid()) == base, frame
    # a receiver that never reads: the sender gives up within its bound
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    many = {f"n{i}": _memfd(b"w") for i in range(300)}
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        t0 = time.monotonic()
        with pytest.raises((fdpass.FdTransferTimeout, fdpass.FdTransferError)):
            fdpass.send_named_fds(a, {f"{'long-name-' * 40}{i}": fd for i, fd in enumerate(many.values())}, timeout=0.5)
        assert time.monotonic() - t0 < 3
    finally:
        _close(many.values())
        a.close()
        b.close()


# --------------------------------------------------------------------------- (c) keeper death
def _wait_state(store: KeeperStore, all_fds, want: str, timeout: float, seen: list[str]) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        t0 = time.monotonic()
        store.check(all_fds)
        assert time.monotonic() - t0 < 2.0, "check() must not block"
        seen.append(store.state)
        if store.state == want:
            return
        time.sleep(0.05)
    raise AssertionError(f"keeper store never became {want!r} in {timeout} s (states {seen[-5:]}, last error {store.last_error})")


def test_keeper_kill9_is_detected_restarted_and_refilled(runtime_dir, caplog):
    caplog.set_level(logging.INFO, logger="a2ad")
    _need_fds(700)
    fds = {ws_name(f"k:{i}", i % 4): _memfd(f"kept {i}".encode()) for i in range(300)}
    fds[cb_name("k:0")] = _memfd(b"control")
    store = store2 = None
    children: list[subprocess.Popen] = []
    got: dict[str, int] = {}
    try:
        store = KeeperStore(runtime_dir)
        children += _store_children(store)
        for name, fd in fds.items():
            store.put(name, fd)
        store.check(lambda: fds)
        assert store.state == "ok"
        old = _keeper_pid(store.path)
        os.kill(old, signal.SIGKILL)
        seen: list[str] = []
        _wait_state(store, lambda: fds, "degraded", 10, seen)
        assert "fd keeper lost" in caplog.text
        # put/drop on the dead keeper neither raise nor bring it back by themselves
        extra = _memfd(b"late")
        fds[ws_name("late", 0)] = extra
        store.put(ws_name("late", 0), extra)
        store.drop(ws_name("k:1", 1))
        del fds[ws_name("k:1", 1)]
        _wait_state(store, lambda: fds, "ok", 20, seen)
        children += _store_children(store)
        after = seen[seen.index("degraded"):]
        assert set(after[:-1]) == {"degraded"} and after[-1] == "ok", seen  # degraded until refilled
        assert "is back: it holds all 301 fd(s) again" in caplog.text
        assert _keeper_pid(store.path) != old
        store.close(clean=False)
        store = None
        store2 = KeeperStore(runtime_dir)  # what the next daemon sees
        got = store2.load()
        assert set(got) == set(fds)
        for name, fd in got.items():
            assert _content(fd) == _content(fds[name])
    finally:
        _close(got.values())
        for s in (store, store2):
            if s is not None:
                children += _store_children(s)
                s.close(clean=False)
        _close(fds.values())
        _stop_keeper(runtime_dir, *children)


def test_keeper_put_and_drop_on_a_dead_keeper_mark_it_degraded(runtime_dir, caplog):
    store = None
    children = []
    fd = _memfd(b"a")
    try:
        store = KeeperStore(runtime_dir)
        children += _store_children(store)
        pid = _keeper_pid(store.path)
        os.kill(pid, signal.SIGKILL)
        for p in children:
            p.wait(10)
        store.put(ws_name("a", 0), fd)  # must not raise
        store.drop(ws_name("a", 0))
        assert store.state == "degraded"
        assert store.last_error
        _wait_state(store, lambda: {ws_name("a", 0): fd}, "ok", 20, [])
        children += _store_children(store)
    finally:
        if store is not None:
            children += _store_children(store)
            store.close(clean=True)
        os.close(fd)
        _stop_keeper(runtime_dir, *children)


def test_keeper_failed_restart_stays_degraded_with_backoff(runtime_dir, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG, logger="a2ad")
    store = None
    children = []
    fd = _memfd(b"b")
    try:
        store = KeeperStore(runtime_dir)
        children += _store_children(store)
        os.kill(_keeper_pid(store.path), signal.SIGKILL)
        for p in children:
            p.wait(10)
        spawned = []
        real = fdstore.python_command

        def broken(module, *args):
            spawned.append(module)
            return [sys.executable, "-c", "import sys; sys.exit(3)"]

        monkeypatch.setattr(fdstore, "python_command", broken)
        end = time.monotonic() + 10
        while store._next_try == 0.0 or store._starting is not None:  # until the first attempt failed
            store.check(lambda: {"ws.b.0": fd})
            assert time.monotonic() < end, "the broken keeper never failed"
            time.sleep(0.02)
        assert store.state == "degraded" and "exited before it was ready" in store.last_error
        assert caplog.text.count("fd keeper restart failed") == 1
        n = len(spawned)
        store.check(lambda: {"ws.b.0": fd})  # within the backoff: no new attempt
        assert len(spawned) == n and store.state == "degraded"
        monkeypatch.setattr(fdstore, "python_command", real)
        _wait_state(store, lambda: {"ws.b.0": fd}, "ok", 20, [])
        children += _store_children(store)
        assert "is back" in caplog.text
    finally:
        if store is not None:
            children += _store_children(store)
            store.close(clean=True)
        os.close(fd)
        _stop_keeper(runtime_dir, *children)


def test_keeper_reconnect_drops_fds_the_daemon_no_longer_holds(runtime_dir, caplog):
    """A broken connection to a live keeper: reconnect, store everything again, and drop the
    fds that were dropped while the keeper could not be told."""
    caplog.set_level(logging.INFO, logger="a2ad")
    store = None
    children = []
    fds = {ws_name("r", i): _memfd(b"r%d" % i) for i in range(3)}
    got = {}
    try:
        store = KeeperStore(runtime_dir)
        children += _store_children(store)
        for n, fd in fds.items():
            store.put(n, fd)
        pid = _keeper_pid(store.path)
        store.sock.shutdown(socket.SHUT_RDWR)
        store.drop(ws_name("r", 2))  # fails: degraded
        assert store.state == "degraded"
        os.close(fds.pop(ws_name("r", 2)))
        _wait_state(store, lambda: fds, "ok", 10, [])
        assert _keeper_pid(store.path) == pid  # the same keeper
        assert "1 stale fd(s) dropped" in caplog.text
        got = store.load()
        assert set(got) == set(fds)
    finally:
        _close(got.values())
        if store is not None:
            store.close(clean=True)
        _close(fds.values())
        _stop_keeper(runtime_dir, *children)


# --------------------------------------------------------------------------- (d) systemd names
def test_fdname_is_valid_follows_systemd():
    assert fdname_is_valid("a")
    assert fdname_is_valid(" ~!#$%&'()*+,-./;<=>?@[\\]^_`{|}")
    assert fdname_is_valid("x" * 255)
    assert not fdname_is_valid("x" * 256)
    assert not fdname_is_valid("")
    assert not fdname_is_valid("a:b")
    assert not fdname_is_valid("a\nb")
    assert not fdname_is_valid("a\x1fb")
    assert not fdname_is_valid("a\x7fb")
    assert not fdname_is_valid("caf\u00e9")
    assert not fdname_is_valid(None)
    assert not fdname_is_valid(b"abc")


def _job_names() -> list[str]:
    rng = random.Random(1234)
    first = string.ascii_letters + string.digits
    rest = first + "_.:-"
    names = {"a", "0", "ws", "cb", "a.1", "a.1.2", "a:1", "a:1:2", "a-", "a_", "a.", "a:", "stored",
             "a" + ":" * 63, "a" + "." * 63, "Z" * 64, "x:ws:1", "x.ws.1", "a%3A"[:1] + "3A", "a3A", "a:3A"}
    while len(names) < 3000:
        names.add(rng.choice(first) + "".join(rng.choice(rest) for _ in range(rng.randrange(0, 64))))
    return sorted(names)


def test_store_names_are_valid_for_systemd_injective_and_translate_legacy():
    seen: dict[str, tuple] = {}
    for job in _job_names():
        for rank in (0, 1, 7, 63):
            n = ws_name(job, rank)
            assert fdname_is_valid(n), n
            assert n not in seen, (n, seen.get(n), job, rank)
            seen[n] = ("ws", job, rank)
            assert parse_name(n) == ("ws", job, rank)
            assert normalize_name(n) == n
            assert normalize_name(f"ws:{job}:{rank}") == n
        c = cb_name(job)
        assert fdname_is_valid(c), c
        assert c not in seen
        seen[c] = ("cb", job, None)
        assert parse_name(c) == ("cb", job, None)
        assert normalize_name(f"cb:{job}") == c
    assert ws_name("a:b", 3) == "ws.a%3Ab.3" and cb_name("a:b") == "cb.a%3Ab"
    for junk in ("stored", "", "ws.", "ws.a", "ws.a.01", "ws.a.-1", "ws.a%3ab.0", "ws.a%3.0", "cb.", "cb.a%", "ws:", "ws:a", "ws::1", "xx.a.1"):
        assert normalize_name(junk) is None, junk
    with pytest.raises(ValueError):
        ws_name("a", -1)


LISTEN_CHILD = r"""
import json, os, sys, logging
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
names = json.loads(sys.argv[1])
fds = []
for i, n in enumerate(names):
    fd = os.memfd_create("m")
    os.write(fd, ("fd %d" % i).encode())
    fds.append(fd)
# move them to 3, 4, ... as systemd passes them
tmp = [os.dup(fd) for fd in fds]
for fd in fds:
    os.close(fd)
for i, fd in enumerate(tmp):
    os.dup2(fd, 3 + i)
for fd in tmp:
    if fd >= 3 + len(tmp):
        os.close(fd)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS=str(len(names)), LISTEN_FDNAMES=sys.argv[2])
os.environ.pop("NOTIFY_SOCKET", None)
from a2ad.daemon.fdstore import SystemdStore
got = SystemdStore().load()
def is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False
print(json.dumps({"got": {n: os.pread(fd, 16, 0).decode() for n, fd in got.items()},
                  "open": [f for f in range(3, 3 + len(names)) if is_open(f)],
                  "env": [v for v in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES") if v in os.environ]}))
"""


@pytest.mark.parametrize("joined", [True, False])
def test_systemd_store_load_translates_legacy_names(joined):
    names = [ws_name("new:job", 1), "ws:old:job:0", "stored", "cb:old:job", cb_name("new:job")]
    raw = ":".join(names) if joined else ":".join(n.replace(":", "_") if n.startswith(("ws:", "cb:")) else n for n in names)
    out = subprocess.run([sys.executable, "-c", LISTEN_CHILD, json.dumps(names), raw],
                         capture_output=True, text=True, timeout=30, cwd=str(REPO))
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["env"] == []
    if joined:  # legacy names (split at their ':' in LISTEN_FDNAMES) are found and translated
        assert res["got"] == {ws_name("new:job", 1): "fd 0", ws_name("old:job", 0): "fd 1",
                              cb_name("old:job"): "fd 3", cb_name("new:job"): "fd 4"}
        assert res["open"] == [3, 4, 6, 7]  # 'stored' (no usable name) is closed
        assert "without a usable a2ad name" in out.stderr
    else:  # names that are not a2ad's are closed, the others kept
        assert res["got"] == {ws_name("new:job", 1): "fd 0", cb_name("new:job"): "fd 4"}
        assert res["open"] == [3, 7]


@pytest.mark.full
def test_daemon_fdstore_messages_carry_valid_names_and_one_fd_each(runtime_dir, tmp_path, monkeypatch):
    listener = NotifyListener("path", tmp_path)
    monkeypatch.setenv("NOTIFY_SOCKET", listener.env)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    d = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "1", "--fd-store", "systemd")
    holders: list[subprocess.Popen] = []
    job = "sys:job.1-a_b"
    try:
        d.start()
        monkeypatch.delenv("NOTIFY_SOCKET")  # only for the daemon
        holders = [_holder(runtime_dir, job, r, 2) for r in range(2)]
        wait_attached(*holders)
        want = {ws_name(job, 0), ws_name(job, 1), cb_name(job)}

        def stored():
            return [(f, fds) for _, f, fds in listener.snapshot() if f.get("FDSTORE") == "1"]

        wait_for(lambda: {f.get("FDNAME") for f, _ in stored()} >= want, 20, "FDSTORE=1 for every fd of the job")
        msgs = stored()
        assert msgs, "the daemon stored nothing"
        for fields, fds in msgs:
            assert "FDNAME" in fields, fields
            assert fdname_is_valid(fields["FDNAME"]), fields["FDNAME"]
            assert len(fds) == 1, (fields, fds)
        assert listener.truncated == 0
        assert {f["FDNAME"] for f, _ in msgs} == want
        assert d.log().count("is not a name systemd accepts") == 0
    finally:
        release_holders(*holders)
        d.stop()
        listener.close()


# --------------------------------------------------------------------------- (e) state file writes
def _write_good(rt: Path) -> bytes:
    persist.write_state(rt, [_record("good:1")], "host")
    return (rt / STATE_FILE).read_bytes()


def _leftovers(rt: Path) -> list[str]:
    return sorted(p.name for p in rt.iterdir() if p.name != STATE_FILE and p.name.startswith(STATE_FILE))


def test_save_short_write_then_enospc_keeps_the_good_file(runtime_dir, monkeypatch):
    good = _write_good(runtime_dir)
    real_write = os.write
    calls = []

    def half_then_full(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError) as ei:
        persist.write_state(runtime_dir, [_record(f"j{i}", 4) for i in range(20)], "host")
    monkeypatch.setattr(os, "write", real_write)
    assert ei.value.errno == errno.ENOSPC
    assert len(calls) == 2 and calls[1] == calls[0] - calls[0] // 2  # it went on after the short write
    assert (runtime_dir / STATE_FILE).read_bytes() == good
    assert _leftovers(runtime_dir) == []


def test_save_loops_over_short_writes(runtime_dir, monkeypatch):
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:100])))
    records = [_record(f"j{i}", 4) for i in range(20)]
    persist.write_state(runtime_dir, records, "host")
    monkeypatch.setattr(os, "write", real_write)
    state = persist.load(runtime_dir)
    assert [r["name"] for r in state["jobs"]] == [f"j{i}" for i in range(20)]
    assert (runtime_dir / STATE_FILE).stat().st_mode & 0o777 == 0o600
    assert _leftovers(runtime_dir) == []


FSIZE_CHILD = r"""
import errno, json, os, resource, signal, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from test_persistence import _record
from a2ad.daemon import persist
rt = Path(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
real = os.write
log = []
def traced(fd, data):
    try:
        n = real(fd, data)
    except OSError as e:
        log.append(("error", errno.errorcode[e.errno]))
        raise
    log.append(("wrote", n, len(data)))
    return n
os.write = traced
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (6000, hard))
try:
    persist.write_state(rt, [_record("big%d" % i, 8) for i in range(40)], "host")
    print(json.dumps({"raised": None, "log": log}))
except OSError as e:
    print(json.dumps({"raised": errno.errorcode.get(e.errno), "log": log}))
"""


def test_save_real_kernel_short_write_and_efbig(runtime_dir):
    """RLIMIT_FSIZE below the state's size, SIGXFSZ ignored: the kernel writes what fits (a
    real short write), then fails the rest with EFBIG. The good file stays as it was."""
    good = _write_good(runtime_dir)
    assert len(good) < 6000
    out = subprocess.run([sys.executable, "-c", FSIZE_CHILD, str(runtime_dir), str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["raised"] == "EFBIG", res
    first = res["log"][0]
    assert first[0] == "wrote" and first[1] == 6000 and first[1] < first[2], res["log"]  # a short write
    assert res["log"][-1] == ["error", "EFBIG"]
    assert (runtime_dir / STATE_FILE).read_bytes() == good
    assert _leftovers(runtime_dir) == []


def test_state_writer_retries_with_backoff_logs_once_and_recovers(runtime_dir, caplog):
    caplog.set_level(logging.DEBUG, logger="a2ad")
    good = _write_good(runtime_dir)
    blocker = runtime_dir / (STATE_FILE + ".tmp")
    blocker.mkdir()  # a real failure, even for root: the temp file cannot be opened for writing
    w = persist.StateWriter(runtime_dir)
    records = lambda: [_record("j:1"), _record("j:2")]  # noqa: E731
    assert w.flush(records, "host", 0.0) is False and w.failures == 0  # nothing to write
    w.mark_dirty()
    t = 100.0
    assert w.flush(records, "host", t) is False
    assert not w.healthy and w.dirty and w.failures == 1 and "Is a directory" in w.last_error
    assert w.flush(records, "host", t + 0.4) is False and w.failures == 1  # backing off: no attempt
    attempts = [t]
    delays = []
    now = t
    for _ in range(8):
        delay = w._next_attempt - now
        delays.append(round(delay, 3))
        now = w._next_attempt
        assert w.flush(records, "host", now - 0.001) is False
        assert w.flush(records, "host", now) is False
        attempts.append(now)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    assert w.failures == 9
    errors_logged = [r for r in caplog.records if r.levelno == logging.ERROR and "state file" in r.getMessage()]
    assert len(errors_logged) == 1, [r.getMessage() for r in errors_logged]
    assert (runtime_dir / STATE_FILE).read_bytes() == good
    # a forced write ignores the backoff (before an upgrade), still failing here
    assert w.flush(records, "host", now + 0.01, force=True) is False and w.failures == 10
    blocker.rmdir()
    assert w.flush(records, "host", now + 0.02) is False  # still backing off
    assert w.flush(records, "host", now + 20) is True
    assert w.healthy and not w.dirty and w.last_error is None and w.failures == 0
    assert "state file written again after 10 failed attempt(s)" in caplog.text
    assert [r["name"] for r in persist.load(runtime_dir)["jobs"]] == ["j:1", "j:2"]
    # a broken records callback is a failure too, never an exception
    w.mark_dirty()
    assert w.flush(lambda: 1 / 0, "host", now + 40) is False and not w.healthy
    assert w.flush(records, "host", now + 41) is True


# --------------------------------------------------------------------------- (f) unusable state files
BAD_FILES = {
    "jobs-is-5": msgpack.packb({"v": 1, "backend": "host", "jobs": 5}),
    "garbage": b"\xc1\xff\x00garbage\x93",
    "not-a-map": msgpack.packb([1, 2, 3]),
    "truncated": msgpack.packb({"v": 1, "backend": "host", "jobs": [_record("t")]})[:-7],
}


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_load_moves_an_unusable_file_aside(runtime_dir, caplog, kind):
    caplog.set_level(logging.WARNING, logger="a2ad")
    (runtime_dir / STATE_FILE).write_bytes(BAD_FILES[kind])
    assert persist.load(runtime_dir) is None
    assert not (runtime_dir / STATE_FILE).exists()
    aside = [p for p in runtime_dir.iterdir() if p.name.startswith(STATE_FILE + ".bad-")]
    assert len(aside) == 1 and aside[0].read_bytes() == BAD_FILES[kind]
    assert "moved aside" in caplog.text
    assert persist.load(runtime_dir) is None  # and it is gone for good


def test_check_job_record_flags_only_the_bad_record(runtime_dir, caplog):
    caplog.set_level(logging.WARNING, logger="a2ad")
    good = _record("good:job")
    missing = _record("bad:job")
    del missing["slots"][1]["alloc"]
    wrong = _record("wrong")
    wrong["generation"] = "3"
    raw = msgpack.packb({"v": 1, "backend": "host", "jobs": [good, missing, wrong, 7]}, use_bin_type=True)
    (runtime_dir / STATE_FILE).write_bytes(raw)
    state = persist.load(runtime_dir)
    assert state is not None and len(state["jobs"]) == 4
    verdicts = [persist.check_job_record(r) for r in state["jobs"]]
    assert verdicts[0] is None
    assert "slot 1" in verdicts[1] and "alloc" in verdicts[1]
    assert "generation" in verdicts[2]
    assert "not a map" in verdicts[3]
    assert "3 unusable job record(s) of 4" in caplog.text
    assert (runtime_dir / STATE_FILE).read_bytes() == raw  # kept: the good record is still needed
    assert [p.read_bytes() for p in runtime_dir.iterdir() if ".bad-" in p.name] == [raw]
    for bad in ({}, {"name": "x"}, dict(good, ep_size=0), dict(good, ep_size=True), dict(good, slots=good["slots"][:1]),
                dict(good, name="bad name"), dict(good, spec={}),
                dict(good, slots=[dict(good["slots"][0], state=99), good["slots"][1]]),
                dict(good, active_mask="3"), dict(good, active_mask=-1)):
        assert persist.check_job_record(bad) is not None, bad
    # the daemon's own active mask (degrade jobs), or none before the first rendezvous
    assert persist.check_job_record(dict(good, active_mask=0b11)) is None
    assert persist.check_job_record(dict(good, active_mask=None)) is None


@pytest.mark.parametrize("kind", ["jobs-is-5", "garbage", "missing-fields"])
def test_daemon_starts_with_an_unusable_state_file(runtime_dir, kind):
    if kind == "missing-fields":
        rec = _record("broken:job")
        del rec["slots"]
        raw = msgpack.packb({"v": 1, "backend": "host", "jobs": [rec]}, use_bin_type=True)
    else:
        raw = BAD_FILES[kind]
    runtime_dir.chmod(0o700)
    (runtime_dir / STATE_FILE).write_bytes(raw)
    d = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "1", "--fd-store", "keeper")
    try:
        d.start()
        jobs = d.request("jobs")
        assert not jobs.get("jobs"), jobs
        aside = [p for p in runtime_dir.iterdir() if p.name.startswith(STATE_FILE + ".bad-")]
        assert len(aside) == 1 and aside[0].read_bytes() == raw
        log = d.log()
        if kind == "missing-fields":
            assert "unusable job record" in log and "slots" in log
        else:
            assert "moved aside" in log
        # the daemon writes a fresh, good state file
        wait_for(lambda: persist.load(runtime_dir) is not None and persist.load(runtime_dir)["jobs"] == [], 10,
                 "a fresh state file")
    finally:
        d.stop()



LISTEN_WRAPPER = r"""
import fcntl, os, sys
# what systemd does for a restarted service: the stored fds at 3, 4, ... and LISTEN_* naming them
names = sys.argv[1].split(":") if sys.argv[1] else []
src = [int(x) for x in sys.argv[2].split(",")] if sys.argv[2] else []
n = len(src)
copies = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3 + n) for fd in src]   # out of the way first
for i, fd in enumerate(copies):
    os.dup2(fd, 3 + i)   # inheritable
for fd in set(copies + src):
    if fd >= 3 + n:
        os.close(fd)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS=str(n), LISTEN_FDNAMES=":".join(names))
os.execv(sys.argv[3], sys.argv[3:])
"""


def _systemd_store(listener: NotifyListener) -> dict[str, int]:
    """The fd store as systemd keeps it after these messages: name -> fd (the listener's)."""
    store: dict[str, int] = {}
    for _, f, fds in listener.snapshot():
        if f.get("FDSTOREREMOVE") == "1":
            store.pop(f.get("FDNAME"), None)
        elif f.get("FDSTORE") == "1" and fds:
            store[f.get("FDNAME") if fdname_is_valid(f.get("FDNAME", "")) else "stored"] = fds[0]
    return store


def test_systemd_restart_readopts_the_job_from_listen_fds(runtime_dir, tmp_path, monkeypatch):
    """A daemon under systemd stores its fds; the next one is started as systemd would start
    it (LISTEN_FDS/LISTEN_FDNAMES) and re-adopts the job from them and the state file."""
    listener = NotifyListener("path", tmp_path)
    monkeypatch.setenv("NOTIFY_SOCKET", listener.env)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    d1 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30", "--fd-store", "systemd")
    holders: list[subprocess.Popen] = []
    job = "sd:restart.1"
    proc = None
    log_path = tmp_path / "d2.log"
    try:
        d1.start()
        monkeypatch.delenv("NOTIFY_SOCKET")
        holders = [_holder(runtime_dir, job, r, 2) for r in range(2)]
        wait_attached(*holders)
        want = {ws_name(job, 0), ws_name(job, 1), cb_name(job)}
        wait_for(lambda: set(_systemd_store(listener)) >= want, 20, "the job's fds in the store")
        d1.stop()
        store = _systemd_store(listener)
        names, fds = list(store), list(store.values())
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-c", LISTEN_WRAPPER, ":".join(names), ",".join(map(str, fds)),
                 *python_command("a2ad.tools.cli", "serve", "--runtime-dir", str(runtime_dir), "--log-level", "debug",
                                 "--backend", "host", "--grace", "30", "--fd-store", "systemd")],
                pass_fds=fds, stdout=logf, stderr=subprocess.STDOUT, cwd=str(REPO),
                env=dict(os.environ, NOTIFY_SOCKET=listener.env, PYTHONUNBUFFERED="1"),
            )
        from a2ad.connection import DaemonClient, ping
        from a2ad.errors import DaemonUnavailable

        def up():
            assert proc.poll() is None, log_path.read_text(errors="replace")
            try:
                ping(runtime_dir, timeout=0.5)
                return True
            except DaemonUnavailable:
                return False

        wait_for(up, 30, "the restarted daemon")
        with DaemonClient(runtime_dir, timeout=5) as c:
            jobs = [j["name"] for j in c.request("jobs")["jobs"]]
        assert jobs == [job], log_path.read_text(errors="replace")
        assert "without a usable a2ad name" not in log_path.read_text(errors="replace")
    finally:
        release_holders(*holders)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        d1.stop()
        reap_keeper(runtime_dir)
        listener.close()


@pytest.mark.full
def test_daemon_adopts_the_good_record_and_skips_the_bad_one(runtime_dir, tmp_path):
    """A real job kept by the keeper across a kill -9, plus a broken record added to the state
    file: the next daemon adopts the job and names the broken record in its log."""
    d1 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30", "--fd-store", "keeper")
    d2 = None
    holders: list[subprocess.Popen] = []
    job = "good:one"
    try:
        d1.start()
        holders = [_holder(runtime_dir, job, r, 2) for r in range(2)]
        wait_attached(*holders)
        wait_for(lambda: [r["name"] for r in (persist.load(runtime_dir) or {}).get("jobs", [])] == [job], 10,
                 "the job in the state file")
        d1.kill9()
        state = persist.load(runtime_dir)
        broken = _record("broken:two")
        del broken["row_stride"]
        state["jobs"].append(broken)
        (runtime_dir / STATE_FILE).write_bytes(msgpack.packb(state, use_bin_type=True))
        d2 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30", "--fd-store", "keeper")
        d2.log_path = tmp_path / "daemon2.log"  # pytest removes it
        d2.start()
        assert [j["name"] for j in d2.request("jobs")["jobs"]] == [job]
        log = d2.log()
        assert "1 unusable job record(s) of 2" in log and "row_stride is missing" in log
        assert [p for p in runtime_dir.iterdir() if ".bad-" in p.name]
        wait_for(lambda: [r["name"] for r in (persist.load(runtime_dir) or {}).get("jobs", [])] == [job], 10,
                 "a state file without the broken record")
    finally:
        release_holders(*holders)
        if d2 is not None:
            d2.stop()
        d1.stop()
        reap_keeper(runtime_dir)


def test_named_fds_batches_by_bytes_for_long_names():
    """Names near the 1 KiB limit: batches are cut by size, every frame stays within the fd
    socket's frame limit, and a name over the limit is refused before anything is sent."""
    _need_fds(700)
    names = [f"{i:04d}-" + "n" * 1000 for i in range(300)]
    runs = fdpass.batches(names)
    assert sum(len(r) for r in runs) == 300 and all(len(r) <= fdpass.BATCH_FDS for r in runs)
    for run in runs:
        frame = {"ok": True, "names": run, "more": True, "total": 300}
        assert len(msgpack.packb(frame, use_bin_type=True)) <= fdpass.protocol.FD_FRAME_MAX
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fds = {n: _memfd(n[:4].encode()) for n in names}
    got: dict[str, int] = {}
    t = threading.Thread(target=fdpass.send_named_fds, args=(a, fds, 30))
    try:
        t.start()
        got = fdpass.recv_named_fds(b, timeout=30)
        assert set(got) == set(names)
        assert all(_content(fd) == n[:4].encode() for n, fd in got.items())
        with pytest.raises(fdpass.FdTransferError):
            fdpass.send_named_fds(a, {"x" * (fdpass.MAX_NAME_BYTES + 1): fds[names[0]]}, timeout=5)
    finally:
        t.join(30)
        _close(got.values())
        _close(fds.values())
        a.close()
        b.close()


def test_keeper_refill_with_a_failing_fd_list_is_retried(runtime_dir, caplog):
    """The daemon's fd list raising during a refill leaves the store degraded (never raises
    out of check) and a later check finishes the job."""
    caplog.set_level(logging.INFO, logger="a2ad")
    store = None
    children = []
    fd = _memfd(b"c")
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("not now")
        return {"ws.c.0": fd}

    try:
        store = KeeperStore(runtime_dir)
        children += _store_children(store)
        store.sock.shutdown(socket.SHUT_RDWR)  # the keeper lives; our connection broke
        store.check(flaky)
        assert store.state == "degraded" and "not now" in store.last_error
        store._next_try = 0.0  # skip the backoff
        _wait_state(store, flaky, "ok", 10, [])
        got = store.load()
        assert set(got) == {"ws.c.0"} and _content(got["ws.c.0"]) == b"c"
        _close(got.values())
    finally:
        if store is not None:
            store.close(clean=True)
        os.close(fd)
        _stop_keeper(runtime_dir, *children)


# --------------------------------------------------------------------------- versions
@pytest.mark.full
def test_a_version1_state_file_with_an_int_mask_is_adopted(runtime_dir, tmp_path):
    """A state file of version 1 (ep_size <= 64: a degrade job's mask as an int) is read by
    this daemon: the record's mask is the daemon's own, so it wins over the published copy
    (0b01 recorded while the block holds 0b11: the copy is put back), and the next state file
    this daemon writes is version 2 with the mask as bytes."""
    from a2ad import layout as L

    d1 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30", "--fd-store", "keeper")
    d2 = None
    holders: list[subprocess.Popen] = []
    job = "v1:mask"
    spec = dict(SPEC, on_peer_loss="degrade")
    try:
        d1.start()
        holders = [subprocess.Popen([sys.executable, "-c", HOLDER, str(runtime_dir), job, str(r), "2", json.dumps(spec)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(REPO))
                   for r in range(2)]
        wait_attached(*holders)
        wait_for(lambda: [r["name"] for r in (persist.load(runtime_dir) or {}).get("jobs", [])] == [job], 10,
                 "the job in the state file")
        d1.kill9()
        state = persist.load(runtime_dir)
        assert state["v"] == persist.STATE_VERSION == 2
        state["v"] = 1
        state["jobs"][0]["active_mask"] = 0b01  # what a version-1 daemon wrote: an int
        state.pop("seq", None)
        (runtime_dir / STATE_FILE).write_bytes(msgpack.packb(state, use_bin_type=True))
        reserve = runtime_dir / persist.RESERVE_FILE
        if reserve.exists():
            reserve.unlink()  # else its newer copy (version 2) would be taken
        d2 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30", "--fd-store", "keeper")
        d2.log_path = tmp_path / "daemon2.log"  # pytest removes it
        d2.start()
        info = d2.request("job_info", job=job)
        assert L.mask_from_bytes(info["active_mask"]) == 0b01 and info["on_peer_loss"] == "degrade", info
        assert info["mask_restores"] == 1, info  # the published copy (0b11) was put back to the record's value
        wait_for(lambda: (lambda s: s is not None and s["v"] == 2 and s["jobs"][0]["active_mask"] == L.mask_to_bytes(0b01))(
            msgpack.unpackb((runtime_dir / STATE_FILE).read_bytes(), raw=False)), 10, "a version-2 state file")
        assert "moved aside" not in d2.log()
    finally:
        release_holders(*holders)
        if d2 is not None:
            d2.stop()
        d1.stop()
        reap_keeper(runtime_dir)


def _v1_control_block() -> int:
    """A control block as a daemon of layout version 1 left it: 4096 bytes, one mask word."""
    import struct

    from a2ad import layout as L

    fd = os.memfd_create("a2ad-ctl", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    os.pwrite(fd, struct.pack("<IIQIiII", L.CONTROL_MAGIC, 1, 3, 0, -1, 2, 0), 0)
    os.pwrite(fd, struct.pack("<Q", 0b11), 32)
    return fd


def test_a_control_block_of_layout_version_1_is_refused_by_name(runtime_dir):
    """A job kept by the fd store with a control block of the previous layout version (one mask
    word, 4096 bytes) is not adopted by this daemon: the log names the job, the kept block, its
    size and both versions; the daemon serves on, and the job's fds are dropped from the
    store. The same check refuses it in job_from_record directly."""
    from a2ad import errors, layout as L

    fds: list[int] = []
    keeper = None
    d = None
    job = "old:layout"
    try:
        fds = [_v1_control_block(), _memfd(b"row 0"), _memfd(b"row 1")]
        for f in fds[1:]:
            os.ftruncate(f, 4096)
        # job_from_record (with the daemon's host) refuses it before mapping anything
        with pytest.raises(errors.BackendError) as exc:
            persist.job_from_record(_record(job), {cb_name(job): fds[0], ws_name(job, 0): fds[1], ws_name(job, 1): fds[2]},
                                    None, None, set(), RealHost.adopt_control_block)
        msg = str(exc.value)
        assert cb_name(job) in msg and "4096 bytes" in msg and "layout version 1" in msg
        assert f"reads version {L.CONTROL_VERSION} only" in msg
        # a restarted daemon finds it in the keeper, with a version-1 state file
        runtime_dir.chmod(0o700)
        keeper = _start_keeper(runtime_dir / "keeper.sock")
        for name, f in ((cb_name(job), fds[0]), (ws_name(job, 0), fds[1]), (ws_name(job, 1), fds[2])):
            reply, _ = _keeper_call(runtime_dir / "keeper.sock", {"op": "put", "name": name}, [f])
            assert reply["ok"], reply
        rec = _record(job)
        rec["slots"] = [dict(s, pid=None, lease=None) for s in rec["slots"]]
        (runtime_dir / STATE_FILE).write_bytes(msgpack.packb({"v": 1, "backend": "host", "jobs": [rec]}, use_bin_type=True))
        d = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30", "--fd-store", "keeper").start()
        assert d.request("jobs")["jobs"] == []
        log = d.log()
        assert f"could not re-adopt job {job}: its control block (kept as {cb_name(job)}, 4096 bytes) has layout " \
               f"version 1; this daemon reads version {L.CONTROL_VERSION} only" in log, log[-3000:]
        wait_for(lambda: _keeper_call(runtime_dir / "keeper.sock", {"op": "ping"})[0]["count"] == 0, 10,
                 "the old job's fds dropped from the keeper")
        assert d.stop() == 0
    finally:
        _close(fds)
        if d is not None:
            d.stop()
        _stop_keeper(runtime_dir, keeper)


def test_a_frame_with_257_fds_arrives_with_continuation_frames():
    """The fd socket's answer for an ep_size 256 job carries 257 fds: more than one frame may
    (fdpass.MAX_FDS), so the first frame carries 128 and announces nfds, continuation frames
    the rest, in order. Up to 128 fds it is one plain frame (what a receiver of one frame
    reads); a continuation that does not match is a ProtocolError that closes what came."""
    from a2ad import errors

    _need_fds(800)
    mine = [_memfd(f"fd {i}".encode()) for i in range(257)]
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    got: list[int] = []
    try:
        before = fd_count(os.getpid())
        t = threading.Thread(target=fdpass.send_frame_fds, args=(a, {"ok": True, "nfds": 257}, mine, 10.0))
        t.start()
        obj, got = fdpass.recv_frame_fds(b, timeout=10.0)
        t.join(10)
        assert obj == {"ok": True, "nfds": 257} and len(got) == 257
        assert [_content(f) for f in got] == [f"fd {i}".encode() for i in range(257)]
        _close(got)
        got = []
        # 128 fds: one frame, as a plain recv_frame reads it
        fdpass.send_frame_fds(a, {"ok": True, "nfds": 128}, mine[:128], 10.0)
        obj, got = fdpass.recv_frame(b, timeout=10.0)
        assert obj["nfds"] == 128 and len(got) == 128
        _close(got)
        got = []
        # a continuation frame that carries fewer fds than it says
        fdpass.send_frame(a, {"ok": True, "nfds": 130}, mine[:128], timeout=5)
        fdpass.send_frame(a, {"v": 1, "more_fds": 2}, mine[128:129], timeout=5)
        with pytest.raises(errors.ProtocolError, match="continuation"):
            fdpass.recv_frame_fds(b, timeout=5.0)
        assert fd_count(os.getpid()) == before, "the fds of the broken transfer must be closed"
        with pytest.raises(ValueError, match="nfds"):
            fdpass.send_frame_fds(a, {"ok": True}, mine[:3])
    finally:
        _close(got)
        _close(mine)
        a.close()
        b.close()
