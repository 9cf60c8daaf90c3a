"""The fd budget and the runtime folder's trust, against floods and planted files.

Real daemon processes on the host backend, loopback only, every loop bounded. Each figure
is printed on a line starting with ``figure:`` (run ``pytest -s``).

- a flood of idle TCP connections to the domain port (which the daemon leaves to its gate
  process) never reaches the daemon's fd table: the daemon stays alive, answers pings
  meanwhile, and its fds are back to the baseline afterwards (a lowered open-file limit,
  and the 25,000 connections of the default 20,000 one);
- ten uids, each at its ``ctl.sock`` cap, at the same time: the total is bounded too;
- an open-file limit too low to serve refuses the start and names the limit needed;
- a runtime folder others may write to is refused; a planted ``a2ad.lock`` symlink is not
  followed; a ``keeper.sock`` planted by another uid gets no fd;
- an upgrade while the daemon holds more than 1024 fds (600 attached jobs).
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from a2ad import runtime
from a2ad.connection import DaemonClient
from helpers import REPO, DaemonProcess, end_daemon, fd_count, reap_keeper, settled_fd_count, wait_for
from test_domain import write_domain
from test_abuse import _alive, _assert_serves
from test_hardening import Holder, _stop_pid_daemon


def figure(text: str) -> None:
    print(f"\nfigure: {text}", flush=True)


_LIMITED = (
    "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({n}, {n})); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def _serve_argv(rt: Path, *args: str, nofile: int | None = None) -> list[str]:
    serve = runtime.python_command("a2ad.tools.cli", "serve", "--runtime-dir", str(rt), "--log-level", "debug",
                                   "--backend", "host", *args)
    return serve if nofile is None else [sys.executable, "-c", _LIMITED.format(n=nofile), *serve]


@contextlib.contextmanager
def _daemon(rt: Path, *args: str, nofile: int | None = None, env: dict | None = None):
    d = DaemonProcess(rt, argv=_serve_argv(rt, *args, nofile=nofile), env=env)
    try:
        d.start(timeout=30)
        yield d
    finally:
        end_daemon(d, rt)


@contextlib.contextmanager
def _own_nofile(needed: int):
    """This test process's open-file limit raised to ``needed`` (root may raise the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want_hard = hard if hard == resource.RLIM_INFINITY or hard >= needed else needed
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed) if want_hard == resource.RLIM_INFINITY
                                                    else min(max(soft, needed), want_hard), want_hard))
    except (ValueError, OSError) as exc:
        pytest.skip(f"needs {needed} open files here; cannot raise the limit ({exc})")
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _ping_ms(rt: Path) -> float:
    t = time.monotonic()
    with DaemonClient(rt, timeout=10) as c:
        c.request("hello")
    return (time.monotonic() - t) * 1e3


def _ms(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.1f} ms, max {max(xs):.1f} ms over {len(xs)}"


def _max_fds(pid: int, seconds: float) -> int:
    """The most fds ``pid`` held over ``seconds`` (sampled)."""
    end, peak = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        peak = max(peak, fd_count(pid))
        time.sleep(0.01)
    return peak


def _fds_back(pid: int, base: int, what: str) -> int:
    """Wait (bounded) until ``pid`` holds no more fds than ``base``; returns the count."""
    wait_for(lambda: settled_fd_count(pid, timeout=10) <= base, 30, f"daemon fds back to {base} {what}")
    return settled_fd_count(pid, timeout=10)


# ----------------------------------------------------------------- the domain port
FLOODER = r"""
import errno, os, resource, socket, sys, time
port, first, n, seconds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
socks, end = [], time.monotonic() + seconds
for i in range(first, first + n):
    if time.monotonic() >= end:
        break
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
    s.bind((f"127.0.0.{2 + i % 8}", 0))  # several source addresses: the ephemeral ports last
    err = s.connect_ex(("127.0.0.1", port))
    if err not in (0, errno.EINPROGRESS, errno.EAGAIN):
        print(f"ERROR connect {i}: {os.strerror(err)}", flush=True)
        break
    socks.append(s)
print(f"OPEN {len(socks)}", flush=True)
sys.stdin.readline()
"""
#: idle connections per flooding process (each stays well under a 20,000 open-file limit)
PER_FLOODER = 12500


class _Flood:
    """``n`` idle TCP connections to 127.0.0.1:``port`` (non-blocking connects that never send),
    from as many processes as their open-file limits need; :meth:`close` ends them all."""

    def __init__(self, port: int, n: int, seconds: float):
        from test_hardening import _readline

        self.procs: list[subprocess.Popen] = []
        self.opened = 0
        try:
            for first in range(0, n, PER_FLOODER):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-c", FLOODER, str(port), str(first), str(min(PER_FLOODER, n - first)), str(seconds)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            for p in self.procs:
                line = _readline(p, seconds + 30).strip()
                assert line.startswith("OPEN "), line
                self.opened += int(line.split()[1])
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(OSError):
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
            if p.stdout is not None and not p.stdout.closed:
                p.stdout.close()
        self.procs = []


def _domain_flood(tmp_path: Path, n: int, nofile: int | None, label: str) -> None:
    from helpers import free_port

    ports = {"a": free_port(), "b": free_port()}
    cfg = write_domain(tmp_path / "dom", ports)
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {**os.environ, "A2AD_SHM_DIR": str(shm)}
    ra, rb = tmp_path / "rt-a", tmp_path / "rt-b"
    with _daemon(ra, "--domain", str(cfg), "--node", "a", nofile=nofile, env=env) as a, \
            _daemon(rb, "--domain", str(cfg), "--node", "b", env=env):
        def up():
            st = a.request("domain")
            return {x["name"]: x["state"] for x in st["nodes"]}["b"] == "up"

        wait_for(up, 30, "node b up for node a")
        _assert_serves(a)
        base = settled_fd_count(a.pid, timeout=10)
        gate_pid = a.request("domain")["gate"]["pid"]
        pings = [_ping_ms(ra)]
        t0 = time.monotonic()
        flood = _Flood(ports["a"], n, seconds=120)
        opened = time.monotonic() - t0
        try:
            for _ in range(10):
                pings.append(_ping_ms(ra))
                _alive(a)
                time.sleep(0.1)
            held = settled_fd_count(a.pid, timeout=10)
            gate = a.request("domain")["gate"]
            _assert_serves(a)
        finally:
            flood.close()
        assert flood.opened == n, f"opened {flood.opened} of {n} connections in time"
        _alive(a)
        assert held <= base + 8, f"the flood reached the daemon's fd table: {base} -> {held}"
        after = _fds_back(a.pid, base, "after the flood")
        wait_for(up, 30, "node b up for node a after the flood")
        st = a.request("domain")["gate"]
        limit = a.request("status")["limits"]["open_files"]
        figure(f"domain port flood ({label}, daemon open-file limit {limit}): {n} idle TCP connections opened in "
               f"{opened:.1f} s; daemon alive, fds {base} -> {held} (flooded) -> {after}; gate pid {gate_pid} "
               f"(now {st['pid']}, {st['restarts']} restarts) shed {gate['shed_connections']} and held "
               f"{gate['connections']} at the end; ping during the flood {_ms(pings)}; node b up again")
        _assert_serves(a)


def test_domain_port_flood_under_a_lowered_limit(tmp_path):
    """5,000 idle connections to the domain port of a daemon whose open-file limit is 2,048:
    before the gate, libzmq would have taken the daemon's last fds and aborted it."""
    _domain_flood(tmp_path, 5000, nofile=2048, label="lowered limit")


@pytest.mark.slow
@pytest.mark.full
def test_domain_port_flood_of_25000(tmp_path):
    """25,000 idle connections to the domain port, above the daemon's own limit."""
    _domain_flood(tmp_path, 25000, nofile=None, label="25,000")


# ------------------------------------------------------------------- many uids
USER_PREFIX = "a2adnet"
GROUP = "a2adnetg"


@pytest.fixture(scope="module")
def ten_uids():
    """Ten system users in one group, created for the test and removed after it (root only)."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("creating test users needs root and useradd")
    made: list[str] = []
    made_group = False
    try:
        try:
            grp.getgrnam(GROUP)
        except KeyError:
            subprocess.run(["groupadd", "-r", GROUP], check=True, capture_output=True)
            made_group = True
        for i in range(10):
            name = f"{USER_PREFIX}{i}"
            try:
                pwd.getpwnam(name)
            except KeyError:
                subprocess.run(["useradd", "-r", "-M", "-N", "-g", GROUP, "-s", "/usr/sbin/nologin", name], check=True,
                               capture_output=True)
                made.append(name)
        yield [(pwd.getpwnam(f"{USER_PREFIX}{i}").pw_uid, grp.getgrnam(GROUP).gr_gid) for i in range(10)]
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True)
        if made_group:
            subprocess.run(["groupdel", GROUP], capture_output=True)


class AsUid:
    """A forked child running ``fn(report)`` as ``uid``/``gid`` (no other groups): ``report(text)``
    sends one line to the parent; the child ends when the parent calls :meth:`close` (or
    dies). The interpreter under test may live where other users cannot run it, hence a fork
    rather than a new process."""

    #: the parent's ends of every child's pipes
    _parent_ends: set[int] = set()

    def __init__(self, uid: int, gid: int, fn):
        up_r, up_w = os.pipe()
        down_r, down_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 0
            try:
                os.close(up_r)
                os.close(down_w)
                for fd in AsUid._parent_ends:  # other children's pipes: their EOF must not wait for us
                    with contextlib.suppress(OSError):
                        os.close(fd)
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                fn(lambda text: os.write(up_w, (text + "\n").encode()))
                os.read(down_r, 1)  # until the parent closes its end
            except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit
                with contextlib.suppress(OSError):
                    os.write(up_w, f"ERROR {type(exc).__name__}: {exc}\n".encode())
                code = 1
            finally:
                os._exit(code)
        os.close(up_w)
        os.close(down_r)
        self.pid, self._up, self._down = pid, up_r, down_w
        AsUid._parent_ends |= {up_r, down_w}
        self._buf = b""

    def line(self, timeout: float) -> str:
        import selectors

        end = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self._up, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = end - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise AssertionError(f"child {self.pid} said nothing within {timeout} s")
                chunk = os.read(self._up, 4096)
                if not chunk:
                    raise AssertionError(f"child {self.pid} exited without a word")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def close(self, timeout: float = 20.0) -> int | None:
        if self._up is None:
            return None  # closed already
        AsUid._parent_ends -= {self._up, self._down}
        if self._down is not None:
            os.close(self._down)
            self._down = None
        end = time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() >= end:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                status = -1
                break
            time.sleep(0.02)
        if self._up is not None:
            os.close(self._up)
            self._up = None
        return status


def _ctl_peers(endpoint: str, n: int):
    def run(report):
        import zmq

        ctx = zmq.Context()
        ctx.set(zmq.MAX_SOCKETS, n + 64)
        socks = []
        for _ in range(n):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            socks.append(s)
        run.keep = (ctx, socks)  # held until the child exits
        report("CONNECTED")
    return run


def _public_tmp() -> Path:
    """A folder other users may enter (not write): the runtime folders of these tests sit in it."""
    top = Path(tempfile.mkdtemp(prefix="a2ad-uids-"))
    top.chmod(0o755)
    return top


def _uid_flood(ten_uids, per_uid: int, cap: int, nofile: int | None, label: str) -> None:
    top = _public_tmp()
    rt = top / "rt"
    peers: list[AsUid] = []
    try:
        with _daemon(rt, "--group", GROUP, "--max-ctl-connections-per-uid", str(cap), nofile=nofile) as d:
            _assert_serves(d)
            base = settled_fd_count(d.pid, timeout=10)
            st0 = d.request("status")
            pings = [_ping_ms(rt)]
            t0 = time.monotonic()
            for uid, gid in ten_uids:
                peers.append(AsUid(uid, gid, _ctl_peers(runtime.ctl_endpoint(rt), per_uid)))
            for p in peers:
                assert p.line(60) == "CONNECTED"
            opened = time.monotonic() - t0
            for _ in range(10):
                pings.append(_ping_ms(rt))
                _alive(d)
                time.sleep(0.2)
            st = d.request("status")
            held = _max_fds(d.pid, 2.0)  # shed connections reconnect: the count churns, so its peak
            _assert_serves(d)
            for p in peers:
                p.close()
            _alive(d)
            wait_for(lambda: d.request("status")["connections"]["ctl"] <= 2, 30, "ctl connections closed")
            after = _fds_back(d.pid, base, "after the uids left")
            lim = st["limits"]
            conns = st["connections"]
            figure(f"ctl flood ({label}): 10 uids x {per_uid} connections (per-uid cap {cap}, total cap "
                   f"{lim['ctl_connections_total']}, open-file limit {lim['open_files']}) in {opened:.1f} s; "
                   f"daemon alive, ctl connections held {conns['ctl']}, pauses {conns['ctl_pauses'] - st0['connections']['ctl_pauses']}; "
                   f"fds {base} -> {held} (flooded) -> {after}; ping during the flood {_ms(pings)}")
            assert conns["ctl"] <= min(10 * cap, lim["ctl_connections_total"]) + 2, conns
            assert held < lim["open_files"] - lim["ctl_pause_margin"], (held, lim)
            _assert_serves(d)
    finally:
        for p in peers:
            p.close()
        reap_keeper(rt)
        shutil.rmtree(top, ignore_errors=True)


def test_ten_uids_each_at_its_ctl_cap(ten_uids):
    """Ten uids each open their per-uid cap (256, the default) and 16 more: the cap refuses the
    extra ones, the daemon serves throughout and its fds come back."""
    _uid_flood(ten_uids, per_uid=256 + 16, cap=256, nofile=None, label="default limit")


def test_ten_uids_under_their_caps_cannot_exhaust_a_low_limit(ten_uids):
    """Ten uids, each under its cap of 100, against a daemon with a 1,024 open-file limit:
    together they would need more fds than it has; the total cap sheds them and libzmq never
    reaches the limit (it used to abort the daemon)."""
    _uid_flood(ten_uids, per_uid=100, cap=100, nofile=1024, label="1,024 limit")


# ------------------------------------------------------------- the low limit
def test_a_limit_too_low_to_serve_refuses_the_start(tmp_path):
    """With an open-file limit of 512 the daemon refuses to start, naming the limit it needs
    (it used to log "serving" and never answer)."""
    rt = tmp_path / "rt"
    p = subprocess.run(_serve_argv(rt, nofile=512), capture_output=True, text=True, timeout=60, cwd=str(REPO))
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "serving" not in out, out
    line = next(ln for ln in out.splitlines() if "cannot start" in ln)
    assert "open-file limit is 512, too low to serve" in line and "needs at least 1024" in line, line
    assert not (rt / runtime.CTL_SOCK).exists() and not (rt / runtime.LOCK_FILE).exists()
    figure(f"low-limit refusal: {line.split(' ERROR ', 1)[-1]}")


def test_reserves_scale_with_the_limit(tmp_path):
    got = {}
    for n in (1024, 4096):
        rt = tmp_path / f"rt{n}"
        with _daemon(rt, nofile=n) as d:
            got[n] = d.request("status")["limits"]
            _assert_serves(d)
    assert got[1024]["fd_reserve"] == 384 and got[1024]["ctl_pause_margin"] == 256
    assert got[4096]["fd_reserve"] == 1536 and got[4096]["ctl_pause_margin"] == 1024
    figure(f"fd reserves: limit 1024 -> {got[1024]}; limit 4096 -> {got[4096]}")


# ------------------------------------------------------------ the runtime folder
def test_an_other_writable_runtime_folder_is_refused(tmp_path):
    """A runtime folder others could write to, holding a file: refused at start, the file
    untouched (nothing in it is used). The same folder empty (a fresh volume) is closed to
    0700 and served."""
    rt = tmp_path / "rt"
    rt.mkdir()
    rt.chmod(0o777)
    (rt / "stray-file").write_text("x")
    p = subprocess.run(_serve_argv(rt), capture_output=True, text=True, timeout=60, cwd=str(REPO))
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "its mode was 0777, which let other users write to it, and it holds stray-file" in out, out
    assert sorted(os.listdir(rt)) == ["stray-file"], "the daemon used the folder"
    figure("other-writable runtime folder: " + next(ln for ln in out.splitlines() if "cannot start" in ln).split(" ERROR ", 1)[-1])
    (rt / "stray-file").unlink()
    rt.chmod(0o777)
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(_serve_argv(rt), stdout=f, stderr=subprocess.STDOUT, cwd=str(REPO))
    try:
        wait_for(lambda: (rt / runtime.FD_SOCK).exists() or proc.poll() is not None, 30, "the daemon serving")
        assert proc.poll() is None, log.read_text()
        assert oct(rt.stat().st_mode & 0o777) == "0o700"
        assert _ping_ms(rt) > 0
    finally:
        proc.terminate()
        proc.wait(15)
        reap_keeper(rt)


def test_a_planted_lock_symlink_is_not_followed(tmp_path):
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (rt / runtime.LOCK_FILE).symlink_to(victim)
    p = subprocess.run(_serve_argv(rt), capture_output=True, text=True, timeout=60, cwd=str(REPO))
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "a2ad.lock is a symlink" in out, out
    assert victim.read_text() == "precious\n"
    # a state file planted as a symlink is not read through (moved aside), its target untouched
    (rt / runtime.LOCK_FILE).unlink()
    (rt / runtime.STATE_FILE).symlink_to(victim)
    with _daemon(rt) as d:
        _assert_serves(d)
    assert victim.read_text() == "precious\n"
    assert not (rt / runtime.STATE_FILE).is_symlink()


def _fake_keeper(path: str):
    """Listen on ``path``; report every connection as ``CONN n bytes fds`` (what it was handed)."""
    def run(report):
        ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ls.bind(path)
        ls.listen(16)
        report("LISTENING")
        ls.settimeout(60)
        got_fds = got_bytes = conns = 0
        while True:
            try:
                c, _ = ls.accept()
            except OSError:
                return
            conns += 1
            c.settimeout(2)
            try:
                while True:
                    data, anc, _, _ = c.recvmsg(65536, socket.CMSG_SPACE(253 * 4))
                    for level, kind, raw in anc:
                        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                            got_fds += len(raw) // 4
                    got_bytes += len(data)
                    if not data:
                        break
            except OSError:
                pass
            c.close()
            report(f"CONN {conns} {got_bytes} {got_fds}")
    return run


def test_a_keeper_socket_planted_by_another_uid_gets_no_fd(tmp_path, ten_uids):
    """Another uid listens on keeper.sock (planted while the folder was open to all, which
    was then closed): the daemon checks SO_PEERCRED, hands that listener nothing, starts a
    keeper of its own, and a job's fds survive a kill -9 in the real keeper."""
    from test_abuse import _join1, _redeem

    top = _public_tmp()
    rt = top / "rt"
    rt.mkdir()
    rt.chmod(0o777)
    uid, gid = ten_uids[0]
    fake = AsUid(uid, gid, _fake_keeper(str(rt / "keeper.sock")))
    held = []
    try:
        assert fake.line(30) == "LISTENING"
        rt.chmod(0o700)  # the admin closed the folder; the planted listener still runs
        d = DaemonProcess(rt, argv=_serve_argv(rt, "--fd-store", "keeper"))
        d.start(timeout=30)
        try:
            log = d.log()
            assert f"runs as uid {uid}, not this daemon's uid" in log, log[-3000:]
            with DaemonClient(rt, timeout=10) as c:
                rep = _join1(c, "kept")
                s, answer, fds = _redeem(rt, rep["ticket"])
                held.append((s, fds))
                assert answer["ok"], answer
            assert d.request("status")["fd_store_state"] == "ok"
        finally:
            d.kill9()  # the keeper (ours) holds the job's fds for the next daemon
        with _daemon(rt, "--fd-store", "keeper") as d2:
            wait_for(lambda: [j for j in d2.request("jobs")["jobs"] if j["name"] == "kept"], 20, "job kept re-adopted")
            d2.request("destroy", job="kept")
        conns = [fake.line(10).split()]
        with contextlib.suppress(AssertionError):
            while True:
                conns.append(fake.line(0.5).split())
        assert conns and all(c[0] == "CONN" for c in conns), conns
        fd_counts = [int(c[3]) for c in conns]
        byte_counts = [int(c[2]) for c in conns]
        assert sum(fd_counts) == 0 and sum(byte_counts) == 0, conns
        figure(f"planted keeper.sock (uid {uid}): {len(fd_counts)} connection(s) from the daemon, "
               f"{sum(byte_counts)} bytes and {sum(fd_counts)} fds handed over; the job survived kill -9 in our keeper")
    finally:
        for s, fds in held:
            s.close()
            for fd in fds:
                os.close(fd)
        fake.close(timeout=1)
        reap_keeper(rt)
        shutil.rmtree(top, ignore_errors=True)


# ------------------------------------------------------------------- upgrade
@pytest.mark.slow
@pytest.mark.full
def test_upgrade_with_600_attached_jobs_past_1024_fds(runtime_dir):
    """600 attached one-rank jobs: the daemon holds more than 1024 fds, where select() used
    to fail ("filedescriptor out of range"); `a2ad-ctl upgrade` hands every job over."""
    n = 600
    with _own_nofile(8192):
        d1 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "60").start()
        holder = None
        try:
            t0 = time.monotonic()
            holder = Holder(runtime_dir, "up", n, timeout=300)
            attach_s = time.monotonic() - t0
            fds = settled_fd_count(d1.pid, timeout=20)
            assert fds > 1024, fds
            t1 = time.monotonic()
            out = subprocess.run([sys.executable, "-m", "a2ad.tools.ctl", "--runtime-dir", str(runtime_dir), "--json",
                                  "upgrade"], capture_output=True, text=True, timeout=300, cwd=str(REPO))
            took = time.monotonic() - t1
            assert out.returncode == 0, out.stdout + out.stderr + d1.log_tail(40)
            reply = json.loads(out.stdout)
            d1.proc.wait(30)
            with DaemonClient(runtime_dir, timeout=30) as c:
                hello = c.request("hello")
                jobs = c.request("jobs")["jobs"]
                new_fds = settled_fd_count(hello["pid"], timeout=20)
            assert hello["pid"] == reply["new_pid"] != d1.pid
            assert len(jobs) == n and all(j["ranks_attached"] == 1 for j in jobs)
            assert json.loads(holder.ask("abort?")) == [0] * n
            figure(f"upgrade with {n} attached jobs: attached in {attach_s:.1f} s; old daemon held {fds} fds; "
                   f"a2ad-ctl upgrade {took:.2f} s; the successor holds all {n} ({new_fds} fds)")
        finally:
            if holder is not None:
                holder.close()
            _stop_pid_daemon(runtime_dir)
            d1.stop()
            reap_keeper(runtime_dir)


def test_no_select_in_the_daemon_and_upgrade_path():
    """select() fails on fd numbers above 1024: none of these modules may call it."""
    import ast

    paths = ["a2ad/daemon/server.py", "a2ad/daemon/fdstore.py", "a2ad/daemon/upgrade.py", "a2ad/daemon/gate.py",
             "a2ad/daemon/domain.py", "a2ad/daemon/fdsock.py", "a2ad/tools/ctl.py", "a2ad/fdpass.py",
             "a2ad/connection.py"]
    found = []
    for rel in paths:
        tree = ast.parse((REPO / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "select" and isinstance(node.value, ast.Name) \
                    and node.value.id == "select":
                found.append(f"{rel}:{node.lineno}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if "select" in names:
                    found.append(f"{rel}:{node.lineno} (import select)")
    assert not found, found
