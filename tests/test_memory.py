"""Shared memory the daemon hands out: sealed memfds, cheap zeroing, limits derived from the
machine, and a real daemon that survives clients resizing what they received."""

from __future__ import annotations

import errno
import mmap
import os
import socket
import subprocess
import sys
import time

import pytest
import zmq

from a2ad import errors, fdpass, layout as L, protocol
from a2ad.daemon import memfd
from a2ad.daemon.backends.base import default_limits
from a2ad.daemon.backends.host import HostBackend
from helpers import REPO

SPEC = dict(max_num_tokens=32, top_k=2, num_experts=16, dispatch_bytes_per_token=256, combine_bytes_per_token=256)


def _shmem_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem line in /proc/meminfo")


# ------------------------------------------------------------ (a) sealing across processes
RESIZER = r"""
import errno, mmap, os, socket, sys
sys.path.insert(0, sys.argv[2])
from a2ad import fdpass
s = socket.socket(fileno=int(sys.argv[1]))
msg, fds = fdpass.recv_frame(s, timeout=20)
fd, size = fds[0], msg["size"]
out = {}
for what, target in (("shrink", 0), ("shrink_half", size // 2), ("grow", size * 2)):
    try:
        os.ftruncate(fd, target)
        out[what] = "allowed"
    except OSError as exc:
        out[what] = errno.errorcode[exc.errno]
with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
    mm[0:5] = b"hello"
    mm[size - 5:size] = b"world"
out["size_after"] = os.fstat(fd).st_size
fdpass.send_frame(s, out)
"""


def test_sealed_memfd_cannot_be_resized_by_a_receiver_who_can_still_write():
    size = 1 << 20
    fd = memfd.sealed_memfd("a2ad-test", size)
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        p = subprocess.Popen([sys.executable, "-c", RESIZER, str(child.fileno()), str(REPO)],
                             pass_fds=[child.fileno()], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        child.close()
        fdpass.send_frame(parent, {"size": size}, [fd])
        try:
            out, fds = fdpass.recv_frame(parent, timeout=30)
        finally:
            p.wait(30)
            log = p.stdout.read()
            p.stdout.close()
        assert p.returncode == 0, log
        assert fds == []
        assert out == {"shrink": "EPERM", "shrink_half": "EPERM", "grow": "EPERM", "size_after": size}, out
        # the receiver's writes through its shared mapping are the creator's memory
        assert os.pread(fd, 5, 0) == b"hello" and os.pread(fd, 5, size - 5) == b"world"
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
            assert mm[0:5] == b"hello" and mm[size - 5:] == b"world"
        assert os.fstat(fd).st_size == size
        # no seal can be added on top (F_SEAL_SEAL): nobody can freeze the daemon's writes
        with pytest.raises(PermissionError):
            import fcntl

            fcntl.fcntl(fd, memfd.F_ADD_SEALS, memfd.F_SEAL_WRITE)
        assert memfd.seals(fd) == memfd.F_SEAL_SHRINK | memfd.F_SEAL_GROW | memfd.F_SEAL_SEAL
    finally:
        parent.close()
        os.close(fd)


def test_ensure_sealed_on_fds_of_an_older_daemon():
    # an unsealed but sealable memfd (what an older daemon could have made): sealed now
    fd = os.memfd_create("old", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 8192)
    assert memfd.ensure_sealed(fd, 8192)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 4096)
    assert memfd.ensure_sealed(fd, 8192) and not memfd.ensure_sealed(fd, 8193)
    os.close(fd)
    # a plain memfd cannot be sealed: usable, reported unsafe
    fd = os.memfd_create("plain", os.MFD_CLOEXEC)
    os.ftruncate(fd, 8192)
    assert not memfd.ensure_sealed(fd, 8192)
    assert memfd.adopt_memfd(fd, 8192) is False
    os.ftruncate(fd, 4096)  # a client shrank it before this daemon came up
    with pytest.raises(errors.BackendError, match="4096 bytes, expected 8192"):
        memfd.adopt_memfd(fd, 8192, "workspace")
    os.close(fd)
    # host backend: a shrunk row is refused, a sealable one is sealed on adoption
    b = HostBackend()
    fd = os.memfd_create("row", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    with pytest.raises(errors.BackendError, match="expected 8192"):
        b.adopt(fd, 8192, "host", "memfd")
    os.close(fd)
    fd = os.memfd_create("row", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 8192)
    alloc = b.adopt(fd, 8192, "host", "memfd")
    assert memfd.seals(fd) & (memfd.F_SEAL_SHRINK | memfd.F_SEAL_GROW) == memfd.F_SEAL_SHRINK | memfd.F_SEAL_GROW
    b.release(alloc)


# ------------------------------------------------------------ (b) a real daemon vs a resizing client
def _join(sock, rid, job, rank, ep_size, spec, timeout=30.0):
    sock.send(protocol.encode_request("join", rid, job=job, ep_rank=rank, ep_size=ep_size, spec=spec,
                                      pid=os.getpid(), device="host", timeout=timeout))
    assert sock.poll(int((timeout + 10) * 1000)), "no join reply"
    return protocol.decode_reply(sock.recv())


def _redeem(runtime_dir, ticket):
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(str(runtime_dir / "fd.sock"))
    fdpass.send_frame(c, {"v": 1, "ticket": ticket})
    ans, fds = fdpass.recv_frame(c, timeout=10)
    assert ans["ok"], ans
    return c, fds


def _try_resize(fd):
    """ftruncate shrink and grow; the errno names (or 'allowed')."""
    size = os.fstat(fd).st_size
    out = []
    for target in (0, size // 2, size + (1 << 20)):
        try:
            os.ftruncate(fd, target)
            out.append("allowed")
        except OSError as exc:
            out.append(errno.errorcode[exc.errno])
    return out


def test_daemon_survives_a_client_that_truncates_every_fd_it_received(daemon):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"ipc://{daemon.runtime_dir}/ctl.sock")
    conns = []
    try:
        rep = _join(s, 1, "trunc", 0, 1, dict(SPEC))
        assert rep.ok, rep
        handles = rep.payload["handles"]
        c, fds = _redeem(daemon.runtime_dir, rep.payload["ticket"])
        conns.append(c)
        assert [h["kind"] for h in handles] == ["workspace", "control"] and len(fds) == 2
        ws_fd, cb_fd = fds
        ws_result = _try_resize(ws_fd)
        cb_result = _try_resize(cb_fd)
        assert ws_result == ["EPERM"] * 3, f"workspace memfd resizable: {ws_result}"
        # Needs the control block to be made with memfd.sealed_memfd (RealHost.new_control_block, a2ad/daemon/hostio.py).
        assert cb_result == ["EPERM"] * 3, f"control-block memfd resizable: {cb_result}"
        assert os.fstat(ws_fd).st_size == handles[0]["size"]
        assert os.fstat(cb_fd).st_size == L.CONTROL_BLOCK_SIZE

        # make the daemon touch both: the abort word (control block), a re-arm (row + control block)
        assert daemon.request("abort", job="trunc")["aborted"] == "trunc"
        s.send(protocol.encode_request("recover", 2, job="trunc", ep_rank=0, lease=rep.payload["lease"], timeout=20.0))
        assert s.poll(30000), "no recover reply"
        rec = protocol.decode_reply(s.recv())
        assert rec.ok, rec
        assert rec.payload["generation"] >= 1
        # the re-arm wrote the flag through the fd, and the daemon is still here
        assert int.from_bytes(os.pread(ws_fd, 4, L.aux_layout(1, SPEC["max_num_tokens"]).flag_val), "little") == L.INITIAL_ROUND
        assert daemon.proc.poll() is None
        daemon.request("destroy", job="trunc")
        for fd in fds:
            os.close(fd)
        # a new job, then status: the daemon still serves
        rep2 = _join(s, 3, "after", 0, 1, dict(SPEC))
        assert rep2.ok, rep2
        c2, fds2 = _redeem(daemon.runtime_dir, rep2.payload["ticket"])
        conns.append(c2)
        for fd in fds2:
            os.close(fd)
        assert daemon.request("job_info", job="after")["ranks_attached"] == 1
        daemon.request("status")
        assert daemon.proc.poll() is None, daemon.log()[-4000:]
        assert daemon.request("hello")["pid"] == daemon.pid
    finally:
        for c in conns:
            c.close()
        s.close()
    assert "SIGBUS" not in daemon.log()


# ------------------------------------------------------------ (c) big joins commit nothing
def test_eight_big_joins_are_fast_and_commit_almost_nothing(daemon):
    n, size = 8, 512 << 20
    spec = dict(max_num_tokens=1 << 20, top_k=2, num_experts=8, workspace_size_per_rank=size)
    aux = L.aux_layout(n, spec["max_num_tokens"]).aux_bytes
    ctx = zmq.Context.instance()
    socks = []
    for _ in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{daemon.runtime_dir}/ctl.sock")
        socks.append(s)
    try:
        daemon.request("status")  # the daemon is up and idle
        shmem0 = _shmem_bytes()
        t0 = time.monotonic()
        for r, s in enumerate(socks):
            s.send(protocol.encode_request("join", 1, job="big", ep_rank=r, ep_size=n, spec=spec,
                                           pid=os.getpid(), device="host", timeout=60.0))
        reps = []
        for s in socks:
            assert s.poll(90000), "no join reply"
            reps.append(protocol.decode_reply(s.recv()))
        elapsed = time.monotonic() - t0
        shmem1 = _shmem_bytes()
        assert all(r.ok for r in reps), [r for r in reps if not r.ok]
        info = daemon.request("job_info", job="big")
        delta = shmem1 - shmem0
        print(f"\n8 joins x {size >> 20} MiB rows (aux region {aux / 2**20:.1f} MiB per row, "
              f"job {info['bytes'] / 2**30:.2f} GiB): {elapsed:.3f} s; Shmem {shmem0 >> 10} -> {shmem1 >> 10} KiB "
              f"(delta {delta / 2**20:+.2f} MiB)")
        assert elapsed < 5.0
        assert delta < info["bytes"] // 64, f"Shmem grew by {delta} bytes for a job of {info['bytes']}"
        daemon.request("destroy", job="big")
    finally:
        for s in socks:
            s.close()


# ------------------------------------------------------------ (d) zero_range
@pytest.mark.parametrize("punch", [True, False], ids=["punch", "fallback"])
def test_zero_range_zeroes_the_range_and_nothing_else(monkeypatch, punch):
    size = 3 * memfd.ZERO_CHUNK + 12345
    fd = memfd.sealed_memfd("dirty", size)
    try:
        pattern = bytes(range(1, 256)) * (size // 255 + 1)
        os.pwrite(fd, pattern[:size], 0)
        if not punch:
            def unsupported(*a):
                raise OSError(errno.EOPNOTSUPP, "no holes here")

            monkeypatch.setattr(memfd, "punch_hole", unsupported)
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
            lo, hi = 4096 + 17, 2 * memfd.ZERO_CHUNK + 999  # unaligned both ends, several chunks
            assert mm[lo:hi].count(0) == 0
            memfd.zero_range(fd, lo, hi - lo)
            # seen through an existing mapping and through the fd
            assert mm[lo:hi].count(0) == hi - lo
            assert os.pread(fd, hi - lo, lo).count(0) == hi - lo
            assert mm[:lo] == pattern[:lo] and mm[hi:] == pattern[hi:size]
            memfd.zero_range(fd, 0, 0)  # empty: nothing happens
            memfd.zero_range(fd, size - 10, 100)  # past the end: clipped, size unchanged
            assert os.fstat(fd).st_size == size and mm[size - 10:].count(0) == 10
            assert mm[hi:size - 10] == pattern[hi:size - 10]
        with pytest.raises(ValueError):
            memfd.zero_range(fd, -1, 10)
    finally:
        os.close(fd)


def test_host_initialize_fresh_and_rearm():
    b = HostBackend()
    aux = L.aux_layout(8, 4096)
    alloc = b.allocate(aux.aux_bytes + (1 << 20), "host")
    try:
        assert memfd.seals(alloc.fd) == memfd.SEALS
        b.initialize(alloc, aux.aux_bytes, aux.flag_val, L.INITIAL_ROUND, fresh=True)
        with mmap.mmap(alloc.fd, alloc.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            assert int.from_bytes(mm[aux.flag_val:aux.flag_val + 4], "little") == L.INITIAL_ROUND
            assert mm[:aux.aux_bytes].count(0) == aux.aux_bytes - 1
            mm[:alloc.size] = b"\xff" * alloc.size  # a used row
            b.initialize(alloc, aux.aux_bytes, aux.flag_val, 7)  # re-arm
            assert int.from_bytes(mm[aux.flag_val:aux.flag_val + 4], "little") == 7
            assert mm[:aux.aux_bytes].count(0) == aux.aux_bytes - 1
            assert mm[aux.aux_bytes:].count(0xFF) == alloc.size - aux.aux_bytes  # payload untouched
    finally:
        b.release(alloc)


# ------------------------------------------------------------ (e) limits from the machine
def test_memory_capacity_and_default_limits():
    b = HostBackend()
    cap = b.memory_capacity()
    assert cap == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") > 0
    job, total = default_limits(b)
    print(f"\nhost capacity {cap / 2**30:.2f} GiB: default limits {job / 2**30:.2f} GiB per job, {total / 2**30:.2f} GiB total")
    assert 0 < job <= total <= cap
    assert total <= cap // 2 and total > cap // 2 - (1 << 20)

    from a2ad.daemon.backends import cuda_available

    if cuda_available():
        from a2ad.daemon.backends.cuda import CudaBackend

        cb = CudaBackend()
        ccap = cb.memory_capacity()
        cjob, ctotal = default_limits(cb)
        print(f"cuda capacity {ccap / 2**30:.2f} GiB: default limits {cjob / 2**30:.2f} / {ctotal / 2**30:.2f} GiB")
        assert 0 < cjob <= ctotal <= ccap


def test_default_limits_fall_back_when_capacity_is_unknown():
    class Blind(HostBackend):
        def memory_capacity(self):
            raise OSError("no idea")

    assert default_limits(Blind()) == (1 << 40, 1 << 42)
