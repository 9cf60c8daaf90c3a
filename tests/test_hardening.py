"""The daemon as a shared node service: users own their jobs, restarts and upgrades keep jobs,
a failed upgrade leaves the old daemon in charge, a dead fd keeper is replaced, and bad input
gets a clear refusal. Real daemons, real client processes (which import no torch), real sockets."""

from __future__ import annotations

import grp
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from a2ad import errors, fdpass, protocol
from a2ad.connection import DaemonClient
from helpers import REPO, DaemonProcess, reap_keeper, wait_for

SPEC = dict(max_num_tokens=32, top_k=2, num_experts=16, dispatch_bytes_per_token=256, combine_bytes_per_token=256)

#: Attaches N one-rank jobs (PREFIX0 ... PREFIX{N-1}) through the raw protocol, holds every fd
#: and lease socket, then obeys commands on stdin: "abort?" prints each job's abort word,
#: "leave" leaves every job; EOF exits.
HOLDER = r"""
import json, os, resource, socket, sys
from a2ad import fdpass
from a2ad.connection import DaemonClient
from a2ad.control import ControlBlock
rt, prefix, n, spec = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
c = DaemonClient(rt, timeout=30)
held = []
for i in range(n):
    r = c.request("join", job=f"{prefix}{i}", ep_rank=0, ep_size=1, spec=spec, pid=os.getpid(), device="host", timeout=10.0)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(c.fd_path))
    fdpass.send_frame(s, {"v": 1, "ticket": r["ticket"]})
    answer, fds = fdpass.recv_frame(s, timeout=10)
    assert answer["ok"], answer
    held.append((s, fds, r["lease"], ControlBlock.map_fd(fds[-1])))
print("ATTACHED", flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "abort?":
        print(json.dumps([cb.abort_word for _, _, _, cb in held]), flush=True)
    elif cmd == "leave":
        for i, (s, fds, lease, cb) in enumerate(held):
            c.request("leave", job=f"{prefix}{i}", ep_rank=0, lease=lease)
        print("LEFT", flush=True)
"""


class Holder:
    def __init__(self, runtime_dir, prefix: str, n: int, timeout: float = 120.0):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(runtime_dir), prefix, str(n), json.dumps(SPEC)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(REPO),
        )
        line = _readline(self.proc, timeout)
        assert line.strip() == "ATTACHED", line

    def ask(self, cmd: str, timeout: float = 30.0) -> str:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return _readline(self.proc, timeout).strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None and not f.closed:
                f.close()


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout):
            raise AssertionError(f"pid {proc.pid} printed nothing in {timeout} s")
    finally:
        sel.close()
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"pid {proc.pid} exited with {proc.wait(5)} before answering")
    return line


def _read_with_timeout(f, timeout: float) -> str:
    import select

    if not select.select([f], [], [], timeout)[0]:
        raise AssertionError(f"no answer in {timeout} s")
    return f.readline()


def _jobs(d: DaemonProcess) -> dict:
    return {j["name"]: j for j in d.request("jobs")["jobs"]}


def _attached(d: DaemonProcess, name: str) -> bool:
    j = _jobs(d).get(name)
    return j is not None and j["ranks_attached"] == j["ep_size"]


# ------------------------------------------------------------------ ownership
OTHER_UID = 12345


def _nogroup() -> str | None:
    try:
        return grp.getgrgid(65534).gr_name
    except KeyError:
        return None


def _as_other_user(runtime_dir: Path, results_w: int, go_r: int) -> None:
    """Runs in a forked child that became uid OTHER_UID (gid 65534): every module it needs is
    already imported (the interpreter's own files may be unreadable to that uid)."""
    c = DaemonClient(runtime_dir, timeout=10)
    out = {}

    def attempt(key, rtype, **fields):
        try:
            out[key] = ["ok", c.request(rtype, **fields)]
        except errors.A2ADError as exc:
            out[key] = [exc.code, exc.message]

    attempt("join_root_job", "join", job="rootjob", ep_rank=1, ep_size=2, spec=SPEC, pid=os.getpid(), device="host",
            timeout=2.0)
    for rtype in ("job_info", "destroy", "abort"):
        attempt(rtype + "_root_job", rtype, job="rootjob")
    attempt("status", "status")
    attempt("jobs", "jobs")
    attempt("drain", "drain", enable=True)
    attempt("upgrade", "upgrade")
    attempt("shutdown", "shutdown")
    # its own job: created, seen, destroyed by itself
    r = c.request("join", job="userjob", ep_rank=0, ep_size=1, spec=SPEC, pid=os.getpid(), device="host", timeout=5.0)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(c.fd_path))
    fdpass.send_frame(s, {"v": 1, "ticket": r["ticket"]})
    answer, fds = fdpass.recv_frame(s, timeout=10)
    out["own_attach"] = bool(answer["ok"]) and len(fds) == 2
    attempt("own_job_info", "job_info", job="userjob")
    os.write(results_w, json.dumps(out).encode() + b"\n")
    os.read(go_r, 1)
    attempt("own_destroy", "destroy", job="userjob")
    os.write(results_w, json.dumps({"own_destroy": out["own_destroy"]}).encode() + b"\n")


def _fork_as_other_user(runtime_dir: Path) -> tuple[int, object, int]:
    results_r, results_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(results_r)
            os.close(go_w)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(OTHER_UID)
            _as_other_user(runtime_dir, results_w, go_r)
            code = 0
        except BaseException as exc:
            os.write(results_w, json.dumps({"child_error": repr(exc)}).encode() + b"\n")
        finally:
            os._exit(code)
    os.close(results_w)
    os.close(go_r)
    return pid, os.fdopen(results_r), go_w


def test_allow_uid_without_group_is_refused_with_the_reason(runtime_dir):
    out = subprocess.run(
        [sys.executable, "-m", "a2ad.tools.cli", "serve", "--runtime-dir", str(runtime_dir), "--backend", "host",
         "--fd-store", "none", "--allow-uid", "4321"],
        capture_output=True, text=True, timeout=60, cwd=str(REPO),
    )
    assert out.returncode == 1
    assert "--allow-uid needs --group" in out.stderr and "4321" in out.stderr
    assert not (runtime_dir / "ctl.sock").exists() and not (runtime_dir / "a2ad.lock").exists()


# ------------------------------------------------------------ stop and restart
def test_sigterm_keeps_attached_jobs_for_the_next_daemon_and_shutdown_free_jobs_frees(runtime_dir):
    d1 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "60").start()
    holder = Holder(runtime_dir, "keep", 3)
    try:
        idle = Holder(runtime_dir, "idle", 1)
        idle.ask("leave")
        idle.close()
        wait_for(lambda: _jobs(d1)["idle0"]["state"] == "grace", 10, "idle0 in its grace period")
        d1.proc.send_signal(signal.SIGTERM)  # what systemctl stop/restart does (DaemonProcess.stop also reaps the keeper)
        assert d1.proc.wait(15) == 0
        log1 = d1.log()
        assert "kept for the next daemon" in log1 and "job idle0 freed (daemon shutdown; no rank attached)" in log1
        assert (runtime_dir / "state.msgpack").exists() and (runtime_dir / "keeper.sock").exists()
        assert json.loads(holder.ask("abort?")) == [0, 0, 0]  # nothing was destroyed under the ranks

        d2 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "60").start()
        jobs = _jobs(d2)
        assert sorted(jobs) == ["keep0", "keep1", "keep2"]
        assert all(j["ranks_attached"] == 1 for j in jobs.values())
        # an explicit request frees every job and leaves nothing behind
        reply = d2.request("shutdown", free_jobs=True)
        assert reply["free_jobs"] is True
        d2.proc.wait(15)
        assert d2.proc.returncode == 0
        assert json.loads(holder.ask("abort?")) == [3, 3, 3]  # ABORT_DESTROYED in every control block
        wait_for(lambda: not (runtime_dir / "keeper.sock").exists(), 10, "the keeper gone")
        assert sorted(os.listdir(runtime_dir)) == []
        d2.stop()
    finally:
        holder.close()
        reap_keeper(runtime_dir)


def test_killed_keeper_is_restarted_and_refilled(runtime_dir):
    d1 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "60").start()
    holder = Holder(runtime_dir, "kj", 5)
    try:
        keeper = _keeper_pid(runtime_dir)
        os.kill(keeper, signal.SIGKILL)
        wait_for(lambda: _keeper_pid(runtime_dir) not in (None, keeper), 15, "a new keeper")
        wait_for(lambda: d1.request("status")["fd_store_state"] == "ok", 15, "the fd store healthy again")
        assert "keeper" in d1.log().lower() and d1.request("status")["fd_store"] == "keeper"
        # the refilled keeper is what a restart relies on: kill -9 the daemon and re-adopt
        d1.kill9()
        d2 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "60").start()
        try:
            jobs = _jobs(d2)
            assert sorted(jobs) == [f"kj{i}" for i in range(5)]
            assert all(j["ranks_attached"] == 1 for j in jobs.values())
        finally:
            d2.stop()
    finally:
        holder.close()
        d1.stop()
        reap_keeper(runtime_dir)


def _keeper_pid(runtime_dir: Path) -> int | None:
    needle = str(runtime_dir / "keeper.sock").encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if b"a2ad.daemon.keeper" in cmd and needle in cmd and stat.rsplit(")", 1)[1].split()[0] != "Z":
            return int(entry)
    return None


# ------------------------------------------------------------------ upgrades
@pytest.mark.full
def test_upgrade_hands_over_130_attached_jobs(runtime_dir):
    d1 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "60").start()
    holder = Holder(runtime_dir, "up", 130)
    try:
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "a2ad.tools.ctl", "--runtime-dir", str(runtime_dir), "--json", "upgrade"],
                             capture_output=True, text=True, timeout=120, cwd=str(REPO))
        took = time.monotonic() - t0
        assert out.returncode == 0, out.stdout + out.stderr
        reply = json.loads(out.stdout)
        d1.proc.wait(15)  # the old daemon let go
        with DaemonClient(runtime_dir, timeout=10) as c:
            hello = c.request("hello")
            jobs = c.request("jobs")["jobs"]
        assert hello["pid"] == reply["new_pid"] != d1.pid
        assert len(jobs) == 130 and all(j["ranks_attached"] == 1 for j in jobs)
        print(f"\nfigure: upgrade with 130 attached one-rank jobs: {took:.2f} s, all 130 kept")
        assert json.loads(holder.ask("abort?")) == [0] * 130
    finally:
        holder.close()
        _stop_pid_daemon(runtime_dir)
        d1.stop()
        reap_keeper(runtime_dir)


def test_a_failed_upgrade_leaves_the_old_daemon_in_charge(runtime_dir, tmp_path):
    """The installed package is broken after the old daemon started (a bad upgrade): the
    successor cannot start, and the old daemon keeps serving every job."""
    pkg = tmp_path / "pkg"
    shutil.copytree(REPO / "a2ad", pkg / "a2ad", ignore=shutil.ignore_patterns("__pycache__"))
    log_path = tmp_path / "daemon.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(pkg)!r}); from a2ad.tools.cli import main; "
             "sys.exit(main())", "serve", "--runtime-dir", str(runtime_dir), "--backend", "host", "--grace", "60"],
            stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp_path),
        )
    holder = None
    try:
        wait_for(lambda: _answers(runtime_dir), 30, "the daemon answering")
        holder = Holder(runtime_dir, "stay", 2)
        (pkg / "a2ad" / "tools" / "cli.py").write_text("raise ImportError('a broken installation')\n")
        with DaemonClient(runtime_dir, timeout=90) as c:
            with pytest.raises(errors.BackendError, match="stays in charge"):
                c.request("upgrade")
            hello = c.request("hello")
            jobs = {j["name"]: j for j in c.request("jobs")["jobs"]}
        assert hello["pid"] == proc.pid and proc.poll() is None
        assert sorted(jobs) == ["stay0", "stay1"] and all(j["ranks_attached"] == 1 for j in jobs.values())
        assert json.loads(holder.ask("abort?")) == [0, 0]
        assert "upgrade failed" in log_path.read_text()
    finally:
        if holder is not None:
            holder.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        reap_keeper(runtime_dir)


def _answers(runtime_dir) -> bool:
    try:
        with DaemonClient(runtime_dir, timeout=0.5) as c:
            c.request("hello")
        return True
    except errors.A2ADError:
        return False


def _stop_pid_daemon(runtime_dir) -> None:
    """Stop whichever daemon now serves ``runtime_dir`` (an upgrade successor we did not start)."""
    try:
        with DaemonClient(runtime_dir, timeout=2) as c:
            pid = c.request("hello")["pid"]
    except errors.A2ADError:
        return
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3],
             15, f"daemon {pid} gone")


# ------------------------------------------------------------ clear refusals
def test_a_spec_mismatch_reaches_the_ranks_already_waiting(daemon):
    waiting = DaemonClient(daemon.runtime_dir, timeout=10)
    sock = waiting._socket()
    sock.send(protocol.encode_request("join", 1, job="mm", ep_rank=0, ep_size=3, spec=SPEC, pid=os.getpid(),
                                      device="host", timeout=60.0))
    wait_for(lambda: "mm" in _jobs(daemon), 10, "job mm created")
    other = dict(SPEC, top_k=4)
    t0 = time.monotonic()
    with DaemonClient(daemon.runtime_dir, timeout=10) as c:
        with pytest.raises(errors.SpecMismatch, match="top_k"):
            c.request("join", job="mm", ep_rank=1, ep_size=3, spec=other, pid=os.getpid(), device="host", timeout=60.0)
    assert sock.poll(5000), "the waiting rank heard nothing"
    reply = protocol.decode_reply(sock.recv())
    took = time.monotonic() - t0
    assert reply.code == "spec_mismatch" and reply.payload["field"] == "top_k" and took < 5.0
    waiting.close()


def test_a_join_whose_sender_is_gone_leaves_no_job_behind(daemon):
    """The joining process exits before the daemon reads its join: its connection is up (a
    hello went through), the daemon is stopped, the join is written, the sender exits, and
    only then does the daemon run again."""
    code = ("import os, sys, zmq; from a2ad import protocol; s = zmq.Context().socket(zmq.DEALER); "
            "s.setsockopt(zmq.LINGER, 5000); s.connect(sys.argv[1]); "
            "s.send(protocol.encode_request('hello', 1)); assert s.poll(10000); s.recv(); print('READY', flush=True); "
            "sys.stdin.readline(); "
            "s.send(protocol.encode_request('join', 2, job='ghost', ep_rank=0, ep_size=2, spec=%r, pid=os.getpid(), "
            "device='host', timeout=30.0)); s.close(); print('SENT', flush=True)") % (SPEC,)
    before = daemon.request("status")["counters"]["bad_requests"]
    sender = subprocess.Popen([sys.executable, "-c", code, f"ipc://{daemon.runtime_dir}/ctl.sock"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(REPO))
    try:
        assert _readline(sender, 60).strip() == "READY"
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            sender.stdin.write("go\n")
            sender.stdin.flush()
            assert _readline(sender, 30).strip() == "SENT"
            sender.wait(30)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait(5)
        sender.stdin.close()
        sender.stdout.close()
    wait_for(lambda: daemon.request("status")["counters"]["bad_requests"] == before + 1, 10, "the join refused")
    assert "ghost" not in _jobs(daemon)  # refused before anything was created for it
    assert daemon.request("status")["memory"]["job_bytes"] == 0


def test_names_and_ranks_are_checked_in_full(daemon):
    with DaemonClient(daemon.runtime_dir, timeout=5) as c:
        with pytest.raises(errors.InvalidField):
            c.request("join", job="evil\n", ep_rank=0, ep_size=1, spec=SPEC, pid=os.getpid(), device="host")
        r = c.request("join", job="ranks", ep_rank=0, ep_size=1, spec=SPEC, pid=os.getpid(), device="host", timeout=5.0)
        for rtype, extra in (("leave", {}), ("recover", {}), ("renew", {"pid": os.getpid()})):
            with pytest.raises(errors.InvalidField, match="ep_rank 5"):
                c.request(rtype, job="ranks", ep_rank=5, lease=r["lease"], **extra)
        st = c.request("status")
    assert st["counters"]["bad_requests"] >= 4
    assert "internal error" not in daemon.log()


def test_a_busy_metrics_port_names_the_port_and_leaves_nothing_behind(runtime_dir):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        out = subprocess.run(
            [sys.executable, "-m", "a2ad.tools.cli", "serve", "--runtime-dir", str(runtime_dir), "--backend", "host",
             "--metrics-port", str(port)],
            capture_output=True, text=True, timeout=60, cwd=str(REPO),
        )
    finally:
        busy.close()
    assert out.returncode == 1 and str(port) in out.stderr, out.stderr
    wait_for(lambda: sorted(os.listdir(runtime_dir)) == [], 10, "an empty runtime folder (no lock, sockets or keeper)")
    assert _keeper_pid(runtime_dir) is None


# ------------------------------------------------------------------ watchdog
@pytest.mark.full
def test_the_watchdog_is_fed_while_a_flood_of_requests_is_served(runtime_dir, tmp_path, monkeypatch):
    """WATCHDOG=1 keeps coming, every half timeout, while the daemon works through tens of
    thousands of queued requests (the loop hands back to its timers between requests)."""
    import zmq

    from helpers import NotifyListener

    listener = NotifyListener("path", tmp_path)
    monkeypatch.setenv("NOTIFY_SOCKET", listener.env)
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # a ping every 0.2 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    d = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "60")
    holder = None
    socks = []
    try:
        d.start()
        monkeypatch.delenv("NOTIFY_SOCKET")
        monkeypatch.delenv("WATCHDOG_USEC")
        holder = Holder(runtime_dir, "busy", 40)  # makes every status request cost something
        ctx = zmq.Context.instance()
        for _ in range(4):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            s.connect(f"ipc://{runtime_dir}/ctl.sock")
            socks.append(s)
        n_each = 2500
        t0 = time.monotonic()
        for i in range(n_each):
            for s in socks:
                s.send(protocol.encode_request("status", i))
        got = 0
        end = time.monotonic() + 120
        last = time.monotonic()
        while got < n_each * len(socks) and time.monotonic() < end and time.monotonic() - last < 2.0:
            for s in socks:
                while s.poll(0):
                    s.recv()
                    got += 1
                    last = time.monotonic()
            time.sleep(0.001)
        t1 = last
        # the daemon keeps at most 64 replies queued per client, so not every reply comes back;
        # what matters is that it worked through all of them while feeding the watchdog
        pings = [t for t, f, _ in listener.snapshot() if f.get("WATCHDOG") == "1" and t0 <= t <= t1]
        gaps = [b - a for a, b in zip(pings, pings[1:])]
        print(f"\nfigure: {n_each * len(socks)} status requests ({got} replies read) in {t1 - t0:.2f} s with 40 jobs; "
              f"{len(pings)} watchdog pings, longest gap {max(gaps) if gaps else float('nan'):.3f} s (timeout 0.4 s)")
        assert t1 - t0 > 1.0, "the flood was too short to show anything"
        assert gaps and max(gaps) < 0.4
        assert d.request("hello")["pid"] == d.pid
    finally:
        for s in socks:
            s.close(0)
        if holder is not None:
            holder.close()
        d.stop()
        listener.close()


@pytest.mark.skipif(shutil.which("unshare") is None or os.getuid() != 0, reason="needs unshare and root")
def test_a_join_from_outside_the_daemons_pid_namespace_is_refused(runtime_dir):
    """The daemon in a pid namespace of its own cannot see a worker outside it (the kernel
    reports the peer's pid as 0): the join is refused with the reason, not matched to some
    other process that happens to have the claimed pid in the daemon's namespace."""
    from a2ad.runtime import python_command

    serve = python_command("a2ad.tools.cli", "serve", "--runtime-dir", str(runtime_dir), "--log-level", "debug",
                           "--backend", "host", "--fd-store", "none")
    d = DaemonProcess(runtime_dir, argv=["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM", *serve])
    try:
        d.start()
        with DaemonClient(runtime_dir, timeout=5) as c:
            with pytest.raises(errors.PermissionDenied, match="pid namespace"):
                c.request("join", job="ns", ep_rank=0, ep_size=1, spec=SPEC, pid=os.getpid(), device="host")
            assert c.request("jobs")["jobs"] == []
        # the daemon is pid 1 of its namespace, a child of unshare: stop it directly
        child = int(Path(f"/proc/{d.pid}/task/{d.pid}/children").read_text().split()[0])
        os.kill(child, signal.SIGTERM)
        assert d.proc.wait(15) == 0
    finally:
        d.stop()
