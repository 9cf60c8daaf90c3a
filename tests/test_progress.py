"""A rank waiting in the rendezvous logs which ranks are missing; fd passing over real
socketpairs (fds arrive, truncation and a peer closing mid-frame fail cleanly)."""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from a2ad import errors, fdpass, protocol
from helpers import wait_for

SPEC = dict(max_num_tokens=32, top_k=2, num_experts=16, dispatch_bytes_per_token=256, combine_bytes_per_token=256)

WAITER = r"""
import json, logging, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
from a2ad.client import attach
rt, job, rank, n, spec = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
print("JOINING", flush=True)
with attach(job, rank, n, runtime_dir=rt, timeout=60, **spec) as a:
    print("ATTACHED", a.ep_rank, flush=True)
"""


def _waiter(daemon, job, rank, n, env_extra):
    env = dict(os.environ, **env_extra)
    return subprocess.Popen(
        [sys.executable, "-c", WAITER, str(daemon.runtime_dir), job, str(rank), str(n), json.dumps(SPEC)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


def _rank_state(daemon, job, rank):
    try:
        return daemon.request("job_info", job=job)["ranks"][rank]["state"]
    except errors.NoSuchJob:
        return None


def _finish(p, timeout=90):
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    return p.returncode, out, err


def test_waiting_rank_logs_missing_ranks(daemon):
    job = "prog"
    r0 = _waiter(daemon, job, 0, 2, {"A2AD_PROGRESS": "info", "A2AD_PROGRESS_EVERY": "1"})
    r1 = None
    try:
        wait_for(lambda: _rank_state(daemon, job, 0) == "joining", 60, "rank 0 waiting in the rendezvous")
        time.sleep(3.0)
        r1 = _waiter(daemon, job, 1, 2, {"A2AD_PROGRESS": "off"})
        rc0, out0, err0 = _finish(r0)
        rc1, out1, err1 = _finish(r1)
    finally:
        for p in (r0, r1):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()
    assert rc0 == 0 and "ATTACHED 0" in out0, err0
    assert rc1 == 0 and "ATTACHED 1" in out1, err1
    lines = [ln for ln in err0.splitlines() if ln.startswith("INFO a2ad.client") and "waiting" in ln]
    assert any("rank(s) [1]" in ln for ln in lines), err0
    assert "progress query failed" not in err0, err0
    # rank 1 had progress off: it logged nothing of the kind
    assert "a2ad.client" not in err1, err1


def test_progress_is_off_and_quiet_when_disabled(daemon, monkeypatch):
    # default level debug, logger not enabled for it: the wait is the plain one, and a timeout
    # still comes on time
    from a2ad.client import attach

    monkeypatch.setenv("A2AD_PROGRESS_EVERY", "0.2")
    t0 = time.monotonic()
    with pytest.raises(errors.RendezvousTimeout) as ei:
        attach("alone", 1, 2, runtime_dir=daemon.runtime_dir, timeout=1.5, **SPEC)
    assert time.monotonic() - t0 < 1.5 + 3.0
    assert ei.value.missing_ranks == [0]


def test_progress_failure_never_raises_nor_extends_the_wait(daemon, monkeypatch, caplog):
    # the progress query asks about a job it may not see (no such job): logged at debug,
    # and the rendezvous still times out when it should
    att_mod = importlib.import_module("a2ad.client.attach")

    monkeypatch.setenv("A2AD_PROGRESS", "info")
    monkeypatch.setenv("A2AD_PROGRESS_EVERY", "0.3")
    real_init = att_mod._Progress.__init__

    def wrong_job(self, runtime_dir, job, *a):
        real_init(self, runtime_dir, "no-such-job", *a)

    monkeypatch.setattr(att_mod._Progress, "__init__", wrong_job)
    caplog.set_level("DEBUG", logger="a2ad.client")
    t0 = time.monotonic()
    with pytest.raises(errors.RendezvousTimeout):
        att_mod.attach("lonely2", 0, 2, runtime_dir=daemon.runtime_dir, timeout=2.0, **SPEC)
    assert time.monotonic() - t0 < 2.0 + 3.0
    assert any("progress query failed" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------- fdpass
def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    os.write(fd, data)
    return fd


def test_fds_pass_over_a_socketpair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    mine = [_memfd(f"fd{i}".encode()) for i in range(5)]
    try:
        fdpass.send_frame(a, {"hello": "x" * 100}, mine, timeout=5)
        obj, got = fdpass.recv_frame(b, timeout=5)
        try:
            assert obj == {"hello": "x" * 100} and len(got) == 5
            for i, fd in enumerate(got):
                assert os.pread(fd, 16, 0) == f"fd{i}".encode()
                assert not os.get_inheritable(fd)  # close-on-exec, as before
        finally:
            fdpass.close_all(got)
        # a frame without fds
        fdpass.send_frame(a, [1, 2, 3])
        assert fdpass.recv_frame(b, timeout=5) == ([1, 2, 3], [])
        # named fds across several batches
        named = {f"n{i}": mine[i % 5] for i in range(fdpass.BATCH_FDS + 3)}
        t = threading.Thread(target=fdpass.send_named_fds, args=(a, named, 10))
        t.start()
        got_named = fdpass.recv_named_fds(b, timeout=10)
        t.join()
        try:
            assert sorted(got_named) == sorted(named)
            assert os.pread(got_named["n7"], 16, 0) == b"fd2"
        finally:
            fdpass.close_all(got_named.values())
    finally:
        fdpass.close_all(mine)
        a.close()
        b.close()


def test_truncated_fds_raise_and_leak_nothing():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    mine = [_memfd(b"x") for _ in range(fdpass.MAX_FDS + 5)]
    try:
        before = _fd_count()
        fdpass.send_frame(a, {"n": len(mine)}, mine, timeout=5)
        with pytest.raises(errors.ProtocolError, match="truncated"):
            fdpass.recv_frame(b, timeout=5)
        assert _fd_count() == before
        # through the named-fd layer: FdTransferError, nothing kept either
        fdpass.send_frame(a, {"names": [f"k{i}" for i in range(len(mine))], "more": False, "total": len(mine)}, mine)
        with pytest.raises(fdpass.FdTransferError):
            fdpass.recv_named_fds(b, timeout=5)
        assert _fd_count() == before
    finally:
        fdpass.close_all(mine)
        a.close()
        b.close()


def test_peer_closing_mid_frame_raises_closed_and_leaks_nothing():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    mine = [_memfd(b"x") for _ in range(3)]
    try:
        before = _fd_count()
        data = protocol.frame_fd_message({"names": ["a", "b", "c"], "more": False, "total": 3})
        # the header and part of the body, with the fds; then the sender goes away
        socket.send_fds(a, [data[: len(data) - 4]], mine)
        a.close()
        with pytest.raises(fdpass.FdTransferClosed):
            fdpass.recv_named_fds(b, timeout=5)
        assert _fd_count() == before - 1  # only the sender's end is gone
    finally:
        fdpass.close_all(mine)
        b.close()


def test_recv_frame_timeout_closes_what_arrived():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    mine = [_memfd(b"x") for _ in range(2)]
    try:
        before = _fd_count()
        data = protocol.frame_fd_message({"x": 1})
        socket.send_fds(a, [data[:5]], mine)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            fdpass.recv_frame(b, timeout=0.5)
        assert time.monotonic() - t0 < 3
        assert _fd_count() == before
    finally:
        fdpass.close_all(mine)
        a.close()
        b.close()
