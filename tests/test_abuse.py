"""Abuse: nothing a client does can stop the daemon.

Real daemon processes, real sockets, the host backend, no torch. Every test ends by checking
that the daemon is still running and still serves: ``status`` answers and a normal one-rank
join plus redeem on fd.sock hands over the job's fds (:func:`_assert_serves`).

Each measured figure is printed on one line starting with ``figure:`` (run ``pytest -s``).
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import zmq

from a2ad import errors, fdpass, protocol, runtime
from a2ad.connection import DaemonClient
from helpers import REPO, DaemonProcess, end_daemon, reap_keeper, rss_kib, settled_fd_count, wait_for

SPEC = dict(max_num_tokens=16, top_k=2, num_experts=8, dispatch_bytes_per_token=64, combine_bytes_per_token=64)


# --------------------------------------------------------------------------- helpers
def figure(text: str) -> None:
    print(f"\nfigure: {text}", flush=True)


def _alive(d) -> None:
    assert d.proc.poll() is None, f"the daemon exited with {d.proc.returncode}; its log ends:\n{d.log_tail(60)}"


def _connect_fd_sock(rt, timeout: float = 5.0) -> socket.socket:
    """A connection to fd.sock. A full listen backlog (EAGAIN on AF_UNIX, where a connect with
    a timeout is non-blocking) is retried until ``timeout``: the daemon accepts in batches."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(timeout)
    end = time.monotonic() + timeout
    try:
        while True:
            try:
                s.connect(str(Path(rt) / runtime.FD_SOCK))
                return s
            except BlockingIOError:
                if time.monotonic() >= end:
                    raise TimeoutError(f"fd.sock backlog stayed full for {timeout} s") from None
                time.sleep(0.001)
    except BaseException:
        s.close()
        raise


def _redeem(rt, ticket: bytes, timeout: float = 10.0):
    """Present ``ticket`` on fd.sock; returns (socket, answer, fds). The caller closes both."""
    s = _connect_fd_sock(rt, timeout)
    try:
        try:
            fdpass.send_frame(s, {"v": protocol.PROTOCOL_VERSION, "ticket": ticket})
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused at accept: the daemon answered and closed before reading; read the answer
        answer, fds = fdpass.recv_frame(s, timeout=timeout)
    except BaseException:
        s.close()
        raise
    return s, answer, fds


def _join1(c: DaemonClient, name: str, timeout: float = 10.0) -> dict:
    return c.request("join", job=name, ep_rank=0, ep_size=1, spec=dict(SPEC), pid=os.getpid(), device="host",
                     timeout=timeout)


def _probe_attach(rt, timeout: float = 10.0) -> dict:
    """A normal one-rank attach: join, redeem (fds come), see it attached, leave, destroy.
    Returns the redeem's answer. Raises the typed error of a refusal."""
    name = f"probe-{uuid.uuid4().hex[:12]}"
    with DaemonClient(rt, timeout=timeout) as c:
        rep = _join1(c, name, timeout)
        try:
            s, answer, fds = _redeem(rt, rep["ticket"], timeout)
            try:
                if not answer["ok"]:
                    raise errors.from_reply(answer["code"], answer["message"], {})
                assert len(fds) == answer["nfds"] == len(rep["handles"]) == 2, (answer, fds)
                for fd in fds:
                    assert os.fstat(fd).st_size > 0
                info = c.request("job_info", job=name)
                assert info["ranks"][0]["state"] == "attached", info
                c.request("leave", job=name, ep_rank=0, lease=rep["lease"])
            finally:
                s.close()
                fdpass.close_all(fds)
        finally:
            with contextlib.suppress(errors.NoSuchJob):
                c.request("destroy", job=name)
    return answer


def _assert_serves(d) -> None:
    """The daemon is alive, answers status, and a normal one-rank attach/redeem works."""
    _alive(d)
    st = d.request("status")
    assert st["pid"] == d.pid
    _probe_attach(d.runtime_dir)
    _alive(d)


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _wait_idle(pid: int, timeout: float = 30.0, quiet: float = 0.5) -> None:
    """Until ``pid`` used no CPU for ``quiet`` seconds (it worked through its backlog)."""
    end = time.monotonic() + timeout
    last, since = _cpu_ticks(pid), time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.05)
        now = _cpu_ticks(pid)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
    raise AssertionError(f"pid {pid} did not go idle within {timeout} s")


def _fd_table(pid: int) -> dict[int, str]:
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            out[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
    return out


def _assert_fds_back(pid: int, table0: dict[int, str], what: str) -> int:
    """The daemon's open fds are back to the baseline ``table0`` (taken with :func:`_fd_table`
    once the count settled); else fail naming what is still open. Returns the count."""
    n = settled_fd_count(pid)
    if n > len(table0):
        table = _fd_table(pid)
        extra = Counter(re.sub(r"\[\d+\]|:\d+$", "", v) for k, v in table.items() if table0.get(k) != v)
        raise AssertionError(f"{what}: daemon fds {len(table0)} -> {n}; open beyond the baseline: {dict(extra)}")
    return n


def _baseline(pid: int) -> tuple[int, dict[int, str]]:
    n = settled_fd_count(pid)
    return n, _fd_table(pid)


def _mib(kib: int) -> str:
    return f"{kib / 1024:.1f} MiB"


@contextlib.contextmanager
def _own_nofile(needed: int):
    """Raise this test process's soft open-file limit to its hard limit (restored after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"needs {needed} open files; the hard limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


_LIMITED = (
    "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({n}, {n})); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


@contextlib.contextmanager
def _limited_daemon(*args: str, nofile: int = 1024):
    """A host daemon whose open-file limit (soft and hard) is ``nofile``, on a fresh runtime
    folder of its own; stopped (and its keeper reaped, its folder removed) on every way out."""
    rt = Path(tempfile.mkdtemp(prefix="a2ad-lim-"))
    serve = runtime.python_command("a2ad.tools.cli", "serve", "--runtime-dir", str(rt), "--log-level", "debug",
                                   "--backend", "host", *args)
    d = DaemonProcess(rt, argv=[sys.executable, "-c", _LIMITED.format(n=nofile), *serve])
    try:
        d.start()
        limits = Path(f"/proc/{d.pid}/limits").read_text()
        line = next(ln for ln in limits.splitlines() if ln.startswith("Max open files"))
        assert line.split()[3:5] == [str(nofile), str(nofile)], line
        yield d
    finally:
        try:
            end_daemon(d, rt, timeout=10)
        finally:
            shutil.rmtree(rt, ignore_errors=True)


# ------------------------------------------------------------ 1. abandoned redeems
@pytest.mark.slow
@pytest.mark.full
def test_thousand_abandoned_redeems(daemon_factory):
    """1,000 one-rank jobs whose client presents its ticket on fd.sock and goes away before
    the answer: a third close at once, a third with SO_LINGER 0, a third once the answer
    (with its fds) is in their receive queue, unread (the daemon's side sees a reset). Every
    rank ends dead, never stuck joining or attached; fds come back; RSS stays bounded."""
    d = daemon_factory("--grace", "0.5")
    for _ in range(5):  # warm-up: first allocations and imports settle the footprint
        _probe_attach(d.runtime_dir)
    (fds0, tab0), rss0 = _baseline(d.pid), rss_kib(d.pid)
    c0 = d.request("status")["counters"]
    n = 1000
    answered_unread = 0
    t0 = time.monotonic()
    with DaemonClient(d.runtime_dir, timeout=10) as c:
        for i in range(n):
            rep = _join1(c, f"abandon-{i}")
            s = _connect_fd_sock(d.runtime_dir)
            try:
                if i % 3 == 1:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                fdpass.send_frame(s, {"v": 1, "ticket": rep["ticket"]})
                if i % 3 == 2:
                    readable, _, _ = select.select([s], [], [], 5.0)
                    answered_unread += bool(readable)
            finally:
                s.close()
    elapsed = time.monotonic() - t0
    _alive(d)

    def dead_count():
        return d.request("status")["counters"]["deaths"] - c0["deaths"]

    deaths = wait_for(lambda: (k := dead_count()) >= n and k, 20, f"{n} abandoned ranks marked dead")
    assert deaths == n
    st = d.request("status")
    stuck = [(j["name"], r["state"]) for j in st["jobs"] if j["name"].startswith("abandon-")
             for r in j["ranks"] if r["state"] in ("joining", "attached")]
    assert not stuck, f"ranks left joining/attached: {stuck[:10]}"
    wait_for(lambda: not [j for j in d.request("jobs")["jobs"] if j["name"].startswith("abandon-")], 20,
             "every abandoned job freed after its grace")
    fds1, rss1 = settled_fd_count(d.pid), rss_kib(d.pid)
    attaches = st["counters"]["attaches"] - c0["attaches"]
    figure(f"abandoned redeems: {n} in {elapsed:.1f} s ({answered_unread} answered but unread, "
           f"{attaches} delivered then dropped, {n - attaches} never delivered); all {deaths} ranks dead")
    figure(f"abandoned redeems: daemon fds {fds0} -> {fds1}; RSS {_mib(rss0)} -> {_mib(rss1)} "
           f"(growth {_mib(rss1 - rss0)})")
    _assert_fds_back(d.pid, tab0, "after every abandoned job was freed")
    assert rss1 - rss0 < 20 * 1024, f"daemon RSS grew by {_mib(rss1 - rss0)}"
    _assert_serves(d)


# --------------------------------------------------------- 2. the race without malice
def test_redeem_given_up_while_the_daemon_is_stopped(daemon):
    """A client whose redeem times out (the daemon is SIGSTOPped) gives up and closes; when
    the daemon continues it reads the ticket, cannot deliver, marks the rank dead and serves."""
    rt = daemon.runtime_dir
    with DaemonClient(rt, timeout=10) as c:
        rep = _join1(c, "stopped")
        deaths0 = c.request("status")["counters"]["deaths"]
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            s = _connect_fd_sock(rt)  # the listen backlog takes it while the daemon is stopped
            try:
                fdpass.send_frame(s, {"v": 1, "ticket": rep["ticket"]})
                with pytest.raises(TimeoutError):
                    fdpass.recv_frame(s, timeout=1.0)
            finally:
                s.close()
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        wait_for(lambda: c.request("status")["counters"]["deaths"] == deaths0 + 1, 10, "the rank marked dead")
        jobs = {j["name"]: j for j in c.request("jobs")["jobs"]}
        if "stopped" in jobs:  # else its grace is over already
            assert jobs["stopped"]["ranks"][0]["state"] == "dead", jobs["stopped"]
    _assert_serves(daemon)


def test_abandoned_renew_keeps_the_rank_attached(daemon):
    """A renew ticket presented on fd.sock by a client that closes before the answer: the
    daemon is SIGSTOPped around the send and close, so it reads the ticket only after the
    close (10 times, half with SO_LINGER 0). The renew is lost, the rank stays attached on
    its standing lease, and a proper renew still works afterwards.

    The same without the stop races the answer: when the answer was already sent when the
    client closed, that connection had become the rank's lease and its close is the rank's
    death -- the lease rule, not an abandoned renew. How often each happens is printed."""
    rt = daemon.runtime_dir
    with DaemonClient(rt, timeout=10) as c:
        rep = _join1(c, "renewer")
        lease_sock, answer, fds = _redeem(rt, rep["ticket"])
        try:
            assert answer["ok"]
            deaths0 = c.request("status")["counters"]["deaths"]

            def renew(job="renewer", lease=rep["lease"]):
                return c.request("renew", job=job, ep_rank=0, lease=lease, pid=os.getpid())["ticket"]

            for i in range(10):
                ticket = renew()
                os.kill(daemon.pid, signal.SIGSTOP)
                try:
                    s = _connect_fd_sock(rt)
                    if i % 2:
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    fdpass.send_frame(s, {"v": 1, "ticket": ticket})
                    s.close()
                finally:
                    os.kill(daemon.pid, signal.SIGCONT)
                # the daemon read the ticket (it is used up) and kept the rank
                wait_for(lambda: c.request("status")["connections"]["fd"] == 1, 5, "the renew connection gone")
                info = c.request("job_info", job="renewer")
                assert info["ranks"][0]["state"] == "attached", (i, info)
            _alive(daemon)
            assert c.request("status")["counters"]["deaths"] == deaths0
            # the lease still stands: a proper renew works, and the rank leaves cleanly
            s2, a2, f2 = _redeem(rt, renew())
            assert a2["ok"] and f2 == [], a2
            c.request("leave", job="renewer", ep_rank=0, lease=rep["lease"])
            s2.close()
        finally:
            lease_sock.close()
            fdpass.close_all(fds)
        info = c.request("job_info", job="renewer")
        assert info["ranks"][0]["state"] == "left", info
        c.request("destroy", job="renewer")

        # the race without the stop, one fresh job per try
        outcomes: dict[str, int] = {}
        for i in range(20):
            name = f"renew-race-{i}"
            r = _join1(c, name)
            ls, a, f = _redeem(rt, r["ticket"])
            try:
                assert a["ok"]
                s = _connect_fd_sock(rt)
                fdpass.send_frame(s, {"v": 1, "ticket": renew(name, r["lease"])})
                s.close()
                # either the daemon had not answered (the renew connection is dropped, the old
                # lease stands: one connection) or it had (the renew connection replaced the old
                # lease, which the daemon closed, and its close is the rank's death: none)
                wait_for(lambda: c.request("status")["connections"]["fd"] <= 1, 5, "the renew connection gone")
                time.sleep(0.05)
                state = c.request("job_info", job=name)["ranks"][0]["state"]
                outcomes[state] = outcomes.get(state, 0) + 1
            finally:
                ls.close()
                fdpass.close_all(f)
            c.request("destroy", job=name)
        figure(f"abandoned renew: 10 of 10 closed before the daemon read the ticket stayed attached; racing the "
               f"answer, 20 tries ended {outcomes}")
        assert set(outcomes) <= {"attached", "dead"}, outcomes
    _assert_serves(daemon)


@pytest.mark.slow
@pytest.mark.full
def test_renew_loop_cannot_take_the_daemon_to_its_fd_limit():
    """One client with the default caps, against a daemon with a 1,024 open-file limit: it
    renews its rank's lease over and over, redeeming each ticket and keeping each connection.
    A renew makes the new connection the rank's lease; the connections it replaced must not
    pile up in the daemon (no per-uid cap covers lease connections). Then a new ctl client
    connects: the daemon must not exit, and serves again once the client lets go."""
    n = 1100
    with _own_nofile(n + 512), _limited_daemon("--grace", "1") as d:
        rt = d.runtime_dir
        fds0, tab0 = _baseline(d.pid)
        keep: list[socket.socket] = []
        stopped = None
        try:
            with DaemonClient(rt, timeout=10) as c:
                r = _join1(c, "renew-loop")
                ls, a, f = _redeem(rt, r["ticket"])
                keep.append(ls)
                fdpass.close_all(f)
                assert a["ok"]
                for i in range(n):
                    try:
                        t = c.request("renew", job="renew-loop", ep_rank=0, lease=r["lease"], pid=os.getpid())["ticket"]
                        s, a2, _ = _redeem(rt, t, timeout=3)
                    except (OSError, errors.A2ADError) as exc:
                        stopped = f"renew {i} failed: {type(exc).__name__}: {exc}"
                        break
                    keep.append(s)
                    if not a2["ok"]:
                        stopped = f"renew {i} refused: {a2['code']}: {a2['message']}"
                        break
                fds_now = settled_fd_count(d.pid)
                outcome = "answered"
                try:  # while this client keeps its own ctl connection
                    with DaemonClient(rt, timeout=3) as late:
                        late.request("hello")
                except errors.A2ADError as exc:
                    outcome = f"{type(exc).__name__}"
                time.sleep(0.5)
            figure(f"renew loop, NOFILE 1024: {len(keep) - 1} renewed lease connections held by one client "
                   f"({stopped or 'no refusal'}); daemon fds {fds0} -> {fds_now}; then a new ctl client: {outcome}; "
                   f"daemon {'alive' if d.proc.poll() is None else f'exited with {d.proc.returncode}'}")
            _alive(d)
            assert fds_now - fds0 < 100, f"{len(keep) - 1} replaced lease connections are still open in the daemon"
        finally:
            for s in keep:
                s.close()
        # the rank is dead now (its lease closed without a leave): the job goes after its 1 s grace
        wait_for(lambda: not d.request("jobs")["jobs"], 15, "the job freed after its grace period")
        _assert_fds_back(d.pid, tab0, "after the client closed its connections")
        _assert_serves(d)


# ------------------------------------------------------ 3. silent fd.sock connections
def _open_silent(rt, n: int) -> list[socket.socket]:
    socks = []
    try:
        for _ in range(n):
            socks.append(_connect_fd_sock(rt))
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def _refusals(socks: list[socket.socket], timeout: float = 5.0) -> tuple[int, dict]:
    """How many of ``socks`` the daemon answered (and closed) by now, by code; the rest are
    still held. Every answer must be one clean error frame."""
    codes: dict[str, int] = {}
    answered = 0
    for s in socks:
        s.setblocking(False)  # a socket with a timeout would wait that long for the peek
        try:
            peek = s.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            continue
        except OSError as exc:
            codes[type(exc).__name__] = codes.get(type(exc).__name__, 0) + 1
            answered += 1
            continue
        answered += 1
        if not peek:
            codes["eof"] = codes.get("eof", 0) + 1
            continue
        ans, fds = fdpass.recv_frame(s, timeout=timeout)
        assert fds == [] and isinstance(ans, dict) and ans["ok"] is False, ans
        codes[ans["code"]] = codes.get(ans["code"], 0) + 1
    return answered, codes


@pytest.mark.slow
@pytest.mark.full
def test_two_thousand_silent_fd_connections(daemon_factory):
    """2,000 connections to fd.sock that never send a ticket. With the default per-uid
    handshake cap (320) the daemon holds 320 and refuses the rest with a clean limit_exceeded
    frame -- and, while those 320 are held, the same uid's own redeem is refused the same way
    (the cap has no admin exemption). With the cap raised it holds all 2,000 and a normal
    attach works meanwhile. Closing them brings the daemon's fds back."""
    n = 2000
    with _own_nofile(n + 512):
        # -- the default cap
        d = daemon_factory("--grace", "1")
        _probe_attach(d.runtime_dir)
        (fds0, tab0), rss0 = _baseline(d.pid), rss_kib(d.pid)
        socks = _open_silent(d.runtime_dir, n)
        try:
            time.sleep(0.3)
            _alive(d)
            fds_held = settled_fd_count(d.pid)
            refused, codes = _refusals(socks)
            held = d.request("status")["connections"]["fd"]
            try:
                _probe_attach(d.runtime_dir)
                during = "attach worked"
            except errors.LimitExceeded as exc:
                during = f"attach refused with a clean limit_exceeded frame: {exc}"
            figure(f"silent fd.sock, default handshake cap: {n} connections -> {held} held, {refused} refused {codes}; "
                   f"while held: {during}")
            assert refused == codes.get("limit_exceeded", 0) == n - held, codes
            figure(f"silent fd.sock, default cap: daemon fds {fds0} before, {fds_held} while held")
        finally:
            for s in socks:
                s.close()
        fds1 = settled_fd_count(d.pid)
        figure(f"silent fd.sock, default cap: daemon fds after closing {fds1} (baseline {fds0})")
        _assert_fds_back(d.pid, tab0, "after they closed")
        _assert_serves(d)
        d.stop()

        # -- the cap raised past n: every connection is held
        d = daemon_factory("--grace", "1", "--max-fd-handshakes-per-uid", str(2 * n))
        _probe_attach(d.runtime_dir)
        (fds0, tab0), rss0 = _baseline(d.pid), rss_kib(d.pid)
        t0 = time.monotonic()
        socks = _open_silent(d.runtime_dir, n)
        try:
            wait_for(lambda: d.request("status")["connections"]["fd"] >= n, 10, f"{n} fd.sock connections held")
            fds_held, rss_held = settled_fd_count(d.pid), rss_kib(d.pid)
            refused, codes = _refusals(socks)
            assert refused == 0, codes
            t1 = time.monotonic()
            _probe_attach(d.runtime_dir)  # served while all are held
            attach_ms = (time.monotonic() - t1) * 1e3
            assert time.monotonic() - t0 < 9, "the checks must run before the 10 s handshake timeout"
        finally:
            for s in socks:
                s.close()
        fds1, rss1 = settled_fd_count(d.pid), rss_kib(d.pid)
        figure(f"silent fd.sock, cap raised: {n} held; attach while held {attach_ms:.1f} ms; "
               f"daemon fds {fds0} -> {fds_held} (held) -> {fds1}; RSS {_mib(rss0)} -> {_mib(rss_held)} -> {_mib(rss1)}")
        assert fds_held >= fds0 + n
        _assert_fds_back(d.pid, tab0, "after they closed")
        _assert_serves(d)


@pytest.mark.slow
@pytest.mark.full
def test_silent_fd_connections_past_a_1024_file_limit():
    """A daemon with a 1,024 open-file limit (handshake cap raised, so the fds run out first)
    gets 1,074 silent fd.sock connections: it sheds what it cannot hold instead of exiting,
    a client that was connected before keeps being served, and once they close the daemon
    serves new clients again."""
    n = 1074
    with _own_nofile(n + 512), _limited_daemon("--grace", "1", "--max-fd-handshakes-per-uid", "4096") as d:
        _probe_attach(d.runtime_dir)
        fds0, tab0 = _baseline(d.pid)
        with DaemonClient(d.runtime_dir, timeout=10) as early:
            early.request("hello")  # its ctl connection exists before the flood
            socks = []
            try:
                for _ in range(n):
                    try:
                        socks.append(_connect_fd_sock(d.runtime_dir, timeout=5.0))
                    except OSError:
                        break  # a full backlog: the daemon stopped accepting for a moment
                time.sleep(0.5)
                _alive(d)
                fds_held = settled_fd_count(d.pid)
                answered, codes = _refusals(socks)
                t1 = time.monotonic()
                st = early.request("status")
                status_ms = (time.monotonic() - t1) * 1e3
                figure(f"silent fd.sock, NOFILE 1024: {len(socks)} of {n} connected, {st['connections']['fd']} held, "
                       f"{answered} shed or refused {codes}; daemon fds {fds0} -> {fds_held}; "
                       f"status for an earlier client {status_ms:.1f} ms")
                assert len(socks) == n
                assert answered > 0, "the daemon must have shed connections it had no fds for"
                assert "near the open-file limit" in d.log(), d.log_tail(30)
            finally:
                for s in socks:
                    s.close()
            _alive(d)
            assert early.request("hello")["pid"] == d.pid
        fds1 = settled_fd_count(d.pid)
        figure(f"silent fd.sock, NOFILE 1024: daemon fds after closing {fds1} (baseline {fds0})")
        _assert_fds_back(d.pid, tab0, "after they closed")
        _assert_serves(d)


@pytest.mark.slow
@pytest.mark.full
def test_new_ctl_client_while_fd_sock_holds_every_fd():
    """Silent fd.sock connections take a 1,024-fd daemon as far as it lets them (handshake cap
    raised): it sheds them before its last fds, which stay for what it needs to go on
    serving. Then one ordinary client connects to ctl.sock and is answered; once the
    connections close the daemon serves as before."""
    n = 1074
    with _own_nofile(n + 512), _limited_daemon("--grace", "1", "--max-fd-handshakes-per-uid", "4096") as d:
        _probe_attach(d.runtime_dir)
        fds0, tab0 = _baseline(d.pid)
        socks = _open_silent(d.runtime_dir, n)
        try:
            wait_for(lambda: d.request("status")["connections"]["fd_shed"] > 0, 10, "fd.sock shedding connections")
            held = settled_fd_count(d.pid)
            outcome = "answered"
            try:
                with DaemonClient(d.runtime_dir, timeout=3) as late:
                    late.request("hello")
            except errors.A2ADError as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            time.sleep(0.5)
            figure(f"new ctl client while fd.sock holds all it lets it (NOFILE 1024, daemon fds {held}): {outcome}; "
                   f"daemon {'alive' if d.proc.poll() is None else f'exited with {d.proc.returncode}'}")
            _alive(d)
            assert outcome == "answered"
        finally:
            for s in socks:
                s.close()
        _assert_fds_back(d.pid, tab0, "after they closed")
        _assert_serves(d)


# --------------------------------------------------------------- 4. idle ZeroMQ peers
def _idle_dealers(rt, n: int) -> tuple[zmq.Context, list]:
    """``n`` DEALER sockets connected to ctl.sock (kept referenced: a socket that is garbage
    collected is closed). ``ctx.destroy(0)`` closes them all."""
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, n + 64)  # the default is 1023 sockets per context
    socks = []
    try:
        for _ in range(n):
            s = ctx.socket(zmq.DEALER)
            socks.append(s)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(runtime.ctl_endpoint(Path(rt)))
    except BaseException:
        ctx.destroy(0)
        raise
    return ctx, socks


@pytest.mark.slow
@pytest.mark.full
def test_two_thousand_idle_ctl_peers(daemon):
    """2,000 DEALER sockets connected to ctl.sock that never send. The per-uid ctl-connection
    cap (320 by default, --max-ctl-connections-per-uid) does not apply here: root and the
    daemon's own uid are admins, never capped, and these tests run as the daemon's uid. So the
    daemon holds all 2,000; it keeps serving, and its fds come back when they leave. (The
    same flood against a daemon with a 1,024 open-file limit is the next test.)"""
    n = 2000
    with _own_nofile(2 * n + 512):
        _probe_attach(daemon.runtime_dir)
        (fds0, tab0), rss0 = _baseline(daemon.pid), rss_kib(daemon.pid)
        ctx, peers = _idle_dealers(daemon.runtime_dir, n)
        try:
            wait_for(lambda: daemon.request("status")["connections"]["ctl"] >= n, 30, f"{n} ctl connections accepted")
            fds_held, rss_held = settled_fd_count(daemon.pid, timeout=10), rss_kib(daemon.pid)
            t1 = time.monotonic()
            _assert_serves(daemon)
            serve_ms = (time.monotonic() - t1) * 1e3
        finally:
            ctx.destroy(0)
        wait_for(lambda: daemon.request("status")["connections"]["ctl"] <= 2, 20, "ctl connections closed")
        fds1, rss1 = settled_fd_count(daemon.pid, timeout=10), rss_kib(daemon.pid)
        figure(f"idle ctl peers: {n} held; status + attach while held {serve_ms:.1f} ms; daemon fds {fds0} -> "
               f"{fds_held} (held) -> {fds1}; RSS {_mib(rss0)} -> {_mib(rss_held)} -> {_mib(rss1)} "
               f"({(rss_held - rss0) / n:.1f} KiB per idle peer, libzmq's buffers)")
        assert fds_held >= fds0 + n
        _assert_fds_back(daemon.pid, tab0, "after they closed")
        assert rss_held - rss0 < 128 * 1024, f"{n} idle peers cost {_mib(rss_held - rss0)}"
        _assert_serves(daemon)


@pytest.mark.slow
@pytest.mark.full
def test_idle_ctl_peers_past_a_1024_file_limit():
    """2,000 idle ctl.sock peers against a daemon with a 1,024 open-file limit: libzmq runs
    out of fds accepting them; the daemon must not exit, and serves again once they leave."""
    n = 2000
    with _own_nofile(2 * n + 512), _limited_daemon("--grace", "1") as d:
        _probe_attach(d.runtime_dir)
        fds0, tab0 = _baseline(d.pid)
        ctx, peers = _idle_dealers(d.runtime_dir, n)
        try:
            time.sleep(2.0)
            _alive(d)
            fds_held = settled_fd_count(d.pid, timeout=10)
            _alive(d)
        finally:
            ctx.destroy(0)
        time.sleep(0.5)
        _alive(d)
        wait_for(lambda: d.request("status")["connections"]["ctl"] <= 2, 30, "ctl connections closed")
        fds1 = settled_fd_count(d.pid, timeout=10)
        figure(f"idle ctl peers, NOFILE 1024: {n} peers; daemon fds {fds0} -> {fds_held} (flooded) -> {fds1}; "
               f"daemon alive")
        _assert_fds_back(d.pid, tab0, "after they closed")
        _assert_serves(d)


# ---------------------------------------------------------------------- 5. held joins
def _dealer(ctx: zmq.Context, rt) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(runtime.ctl_endpoint(Path(rt)))
    return s


def _send_join(sock, rid: int, job: str, rank: int, size: int, timeout: float = 60.0) -> None:
    sock.send(protocol.encode_request("join", rid, job=job, ep_rank=rank, ep_size=size, spec=dict(SPEC),
                                      pid=os.getpid(), device="host", timeout=timeout))


def _recv(sock, timeout: float = 10.0) -> protocol.Reply:
    assert sock.poll(int(timeout * 1000)), f"no reply within {timeout} s"
    return protocol.decode_reply(sock.recv())


def _held_names(d, prefix: str) -> list[str]:
    return [j["name"] for j in d.request("jobs")["jobs"]
            if j["name"].startswith(prefix) and any(r["state"] == "joining" for r in j["ranks"])]


@pytest.mark.slow
@pytest.mark.full
def test_250_held_joins_from_one_client(daemon):
    """One client holds 250 joins at once (rank 0 of 250 two-rank jobs): the daemon serves
    everyone meanwhile; destroying the jobs ends every held join with job_destroyed."""
    n = 250
    ctx = zmq.Context()
    try:
        s = _dealer(ctx, daemon.runtime_dir)
        (fds0, tab0), rss0 = _baseline(daemon.pid), rss_kib(daemon.pid)
        t0 = time.monotonic()
        for i in range(n):
            _send_join(s, i + 1, f"held-{i}", 0, 2)
        wait_for(lambda: len(_held_names(daemon, "held-")) == n, 30, f"{n} joins held")
        elapsed = time.monotonic() - t0
        assert not s.poll(0), "a held join was answered early"
        fds_held, rss_held = settled_fd_count(daemon.pid), rss_kib(daemon.pid)
        t1 = time.monotonic()
        _assert_serves(daemon)
        serve_ms = (time.monotonic() - t1) * 1e3
        for i in range(n):
            daemon.request("destroy", job=f"held-{i}")
        codes: dict[str, int] = {}
        for _ in range(n):
            r = _recv(s)
            codes[r.code] = codes.get(r.code, 0) + 1
        assert codes == {"job_destroyed": n}, codes
        fds1 = settled_fd_count(daemon.pid)
        figure(f"held joins: {n} held from one client in {elapsed:.2f} s; status + attach meanwhile {serve_ms:.1f} ms; "
               f"daemon fds {fds0} -> {fds_held} -> {fds1}; RSS {_mib(rss0)} -> {_mib(rss_held)}")
        _assert_fds_back(daemon.pid, tab0, "after they closed")
    finally:
        ctx.destroy(0)
    _assert_serves(daemon)


def test_held_join_cap_refuses_the_eleventh(daemon_factory):
    """With --max-held-joins-per-uid 10, the 11th held join is refused with limit_exceeded
    naming the limit, while other requests are served."""
    d = daemon_factory("--grace", "1", "--max-held-joins-per-uid", "10")
    ctx = zmq.Context()
    try:
        s = _dealer(ctx, d.runtime_dir)
        for i in range(10):
            _send_join(s, i + 1, f"cap-{i}", 0, 2)
        wait_for(lambda: len(_held_names(d, "cap-")) == 10, 10, "10 joins held")
        assert not s.poll(0)
        _send_join(s, 11, "cap-10", 0, 2)
        r = _recv(s)
        assert r.id == 11 and not r.ok and r.code == "limit_exceeded", r
        assert "limit 10" in r.message and r.payload.get("limit") == 10, r
        figure(f"held join cap: the 11th held join -> {r.code}: {r.message}")
        # other requests are served meanwhile
        assert d.request("hello")["pid"] == d.pid
        st = d.request("status")
        assert st["limits"]["held_joins_per_uid"] == 10 and "cap-10" not in [j["name"] for j in st["jobs"]]
        assert d.request("job_info", job="cap-0")["ranks"][0]["state"] == "joining"
        for i in range(10):
            d.request("destroy", job=f"cap-{i}")
        codes = [_recv(s).code for _ in range(10)]
        assert codes == ["job_destroyed"] * 10, codes
    finally:
        ctx.destroy(0)
    _assert_serves(d)


def test_held_join_cap_lets_a_join_complete_a_rendezvous(daemon_factory):
    """At the held-join cap, a join that completes a rendezvous is never held -- it releases
    held joins -- so it must not be refused: a uid with many multi-rank jobs starting at once
    would otherwise see every job's last rank refused and every rendezvous time out."""
    d = daemon_factory("--grace", "1", "--max-held-joins-per-uid", "10")
    ctx = zmq.Context()
    try:
        s = _dealer(ctx, d.runtime_dir)
        for i in range(10):
            _send_join(s, i + 1, f"full-{i}", 0, 2)
        wait_for(lambda: len(_held_names(d, "full-")) == 10, 10, "10 joins held")
        s2 = _dealer(ctx, d.runtime_dir)
        _send_join(s2, 100, "full-0", 1, 2)  # completes job full-0's rendezvous
        r = _recv(s2)
        try:
            assert r.ok, f"the join that completes a rendezvous was refused: {r.code}: {r.message}"
            assert _recv(s).ok  # and rank 0 is released with it
        finally:
            for i in range(10):
                d.request("destroy", job=f"full-{i}")
    finally:
        ctx.destroy(0)
    _assert_serves(d)


# ------------------------------------------------------- 6. peers that never read
@pytest.mark.slow
@pytest.mark.full
def test_peer_that_never_reads_its_replies(daemon):
    """One DEALER sends 5,000 status requests (each reply ~10 KiB: 20 jobs are listed) and
    reads none; the daemon's per-peer reply queue is capped, so its RSS stays bounded, and
    other clients are served meanwhile."""
    n = 5000
    ctx = zmq.Context()
    try:
        holder = _dealer(ctx, daemon.runtime_dir)
        for i in range(20):  # give status replies some bulk
            _send_join(holder, i + 1, f"bulk-{i}", 0, 2, timeout=120)
        wait_for(lambda: len(_held_names(daemon, "bulk-")) == 20, 20, "20 bulk jobs")
        with DaemonClient(daemon.runtime_dir, timeout=10) as c:
            reply_size = len(protocol.pack(c.request("status")))
        _assert_serves(daemon)
        _wait_idle(daemon.pid)
        rss0, cpu0 = rss_kib(daemon.pid), _cpu_ticks(daemon.pid)
        flood = ctx.socket(zmq.DEALER)
        flood.setsockopt(zmq.LINGER, 0)
        flood.setsockopt(zmq.RCVHWM, 1)
        flood.setsockopt(zmq.RCVBUF, 4096)
        flood.connect(runtime.ctl_endpoint(daemon.runtime_dir))
        worst_ms = 0.0
        t0 = time.monotonic()
        deadline = t0 + 60
        with DaemonClient(daemon.runtime_dir, timeout=10) as other:
            i = 0
            while i < n:
                try:
                    flood.send(protocol.encode_request("status", i + 1), zmq.NOBLOCK)
                except zmq.Again:
                    assert time.monotonic() < deadline, f"only {i} of {n} requests could be sent in 60 s"
                    time.sleep(0.001)
                    continue
                i += 1
                if i % 250 == 0:
                    t1 = time.monotonic()
                    assert other.request("hello")["pid"] == daemon.pid
                    worst_ms = max(worst_ms, (time.monotonic() - t1) * 1e3)
            sent_s = time.monotonic() - t0
            _wait_idle(daemon.pid)
            rss1, cpu_s = rss_kib(daemon.pid), (_cpu_ticks(daemon.pid) - cpu0) / os.sysconf("SC_CLK_TCK")
            _alive(daemon)
            t1 = time.monotonic()
            assert other.request("hello")["pid"] == daemon.pid
            worst_ms = max(worst_ms, (time.monotonic() - t1) * 1e3)
        _assert_serves(daemon)
        delivered = 0
        while flood.poll(200):
            flood.recv()
            delivered += 1
        figure(f"non-reading peer: {n} status requests ({reply_size} B replies) sent in {sent_s:.1f} s (daemon CPU {cpu_s:.1f} s); "
               f"daemon RSS {_mib(rss0)} -> {_mib(rss1)} (growth {_mib(rss1 - rss0)}); other client's worst hello "
               f"{worst_ms:.1f} ms; {delivered} replies were still deliverable afterwards")
        assert rss1 - rss0 < 30 * 1024, f"daemon RSS grew by {_mib(rss1 - rss0)}"
        for i in range(20):
            daemon.request("destroy", job=f"bulk-{i}")
    finally:
        ctx.destroy(0)
    _assert_serves(daemon)


# -------------------------------------------------------- 7. 200 eight-rank jobs
@pytest.mark.slow
@pytest.mark.full
def test_status_of_200_eight_rank_jobs(daemon):
    """200 jobs of 8 ranks (1,600 joins, every rank joined by this process): `a2ad-ctl status`
    and `jobs` work; the status reply's size and time are printed."""
    jobs, size = 200, 8
    ctx = zmq.Context()
    try:
        s = _dealer(ctx, daemon.runtime_dir)
        t0 = time.monotonic()
        rid = 0
        for j in range(jobs):
            for r in range(size):
                rid += 1
                _send_join(s, rid, f"wide-{j}", r, size)
            for _ in range(size):
                rep = _recv(s)
                assert rep.ok, f"job wide-{j}: {rep.code}: {rep.message}"
        join_s = time.monotonic() - t0
        # the raw status reply
        t1 = time.monotonic()
        s.send(protocol.encode_request("status", 10**6))
        assert s.poll(30000)
        raw = s.recv()
        status_ms = (time.monotonic() - t1) * 1e3
        st = protocol.decode_reply(raw).raise_for_error()
        assert len([j for j in st["jobs"] if j["name"].startswith("wide-")]) == jobs
        times = {}
        for cmd in ("status", "jobs"):
            t2 = time.monotonic()
            p = subprocess.run([sys.executable, "-m", "a2ad.tools.ctl", "--runtime-dir", str(daemon.runtime_dir), cmd],
                               capture_output=True, text=True, timeout=60, cwd=str(REPO))
            times[cmd] = time.monotonic() - t2
            assert p.returncode == 0, f"a2ad-ctl {cmd} exited {p.returncode}: {p.stderr[-2000:]}"
            assert "wide-199" in p.stdout or cmd == "status"
        figure(f"status of {jobs} x {size}-rank jobs: {jobs * size} joins in {join_s:.1f} s; status reply {len(raw)} bytes "
               f"in {status_ms:.1f} ms; a2ad-ctl status {times['status']:.2f} s, a2ad-ctl jobs {times['jobs']:.2f} s wall")
        for j in range(jobs):
            daemon.request("destroy", job=f"wide-{j}")
    finally:
        ctx.destroy(0)
    _assert_serves(daemon)


# --------------------------------------------------- 8. 500 attached jobs and kill -9
HOLDER = r"""
import os, resource, socket, sys
from a2ad import fdpass
from a2ad.connection import DaemonClient
rt, n = sys.argv[1], int(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
spec = {"max_num_tokens": 16, "top_k": 2, "num_experts": 8, "dispatch_bytes_per_token": 64, "combine_bytes_per_token": 64}
c = DaemonClient(rt, timeout=30)
held = []
for i in range(n):
    r = c.request("join", job=f"kept-{i}", ep_rank=0, ep_size=1, spec=spec, pid=os.getpid(), device="host", timeout=10.0)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(os.path.join(rt, "fd.sock"))
    fdpass.send_frame(s, {"v": 1, "ticket": r["ticket"]})
    answer, fds = fdpass.recv_frame(s, timeout=10)
    assert answer["ok"] and len(fds) == 2, answer
    held.append((s, fds))
print("ATTACHED", flush=True)
sys.stdin.readline()
"""


@pytest.mark.slow
@pytest.mark.full
def test_kill9_with_500_attached_jobs_readopts_them_all(daemon_factory, runtime_dir):
    """A helper holds 500 attached one-rank jobs (lease sockets and fds open). kill -9 the
    daemon; the fd keeper keeps the fds; a new daemon on the same folder re-adopts all 500
    (their pidfds stand as leases). The time from its start to all 500 listed attached is
    printed."""
    n = 500
    d = daemon_factory("--grace", "1")
    helper = subprocess.Popen([sys.executable, "-c", HOLDER, str(runtime_dir), str(n)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=str(REPO))
    d2 = None
    try:
        t0 = time.monotonic()
        ready, _, _ = select.select([helper.stdout], [], [], 120)
        assert ready, "the helper did not attach its jobs within 120 s"
        assert helper.stdout.readline().strip() == "ATTACHED", f"helper exited with {helper.poll()}"
        attach_s = time.monotonic() - t0

        def attached(dd):
            js = [j for j in dd.request("jobs")["jobs"] if j["name"].startswith("kept-")]
            return sum(j["ranks_attached"] for j in js)

        assert attached(d) == n
        wait_for(lambda: d.request("status")["state_file"] == "ok", 5, "state file written")
        time.sleep(0.2)  # the loop writes the state file on the turn after each change
        d.kill9()
        t1 = time.monotonic()
        d2 = daemon_factory("--grace", "1")
        t_hello = time.monotonic() - t1
        wait_for(lambda: attached(d2) == n, 30, f"all {n} jobs attached again")
        t_all = time.monotonic() - t1
        jobs = [j for j in d2.request("jobs")["jobs"] if j["name"].startswith("kept-")]
        assert len(jobs) == n and all(j["ranks"][0]["pid"] == helper.pid for j in jobs)
        figure(f"kill -9 with {n} attached jobs: attached in {attach_s:.1f} s; new daemon answered hello "
               f"{t_hello:.2f} s after the restart began, all {n} attached again after {t_all:.2f} s")
        _assert_serves(d2)
        # the helper goes: its pidfds end every rank; the jobs are freed after their grace
        helper.stdin.close()
        helper.wait(30)
        wait_for(lambda: not [j for j in d2.request("jobs")["jobs"] if j["name"].startswith("kept-")], 30,
                 "every job freed once the helper exited")
        _assert_serves(d2)
    finally:
        if helper.poll() is None:
            helper.kill()
            helper.wait(10)
        helper.stdout.close()
        if helper.stdin and not helper.stdin.closed:
            with contextlib.suppress(OSError):
                helper.stdin.close()
        if d2 is not None:
            d2.stop()
        reap_keeper(runtime_dir)
