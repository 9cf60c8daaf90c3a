"""What happens to a job's memory when its daemon goes: ranks learn when nothing holds their
job any more, the fd keeper frees jobs whose daemon does not come back, and neither a rank
nor the keeper trips over fd numbers above 1024 (no select()). Real daemon, real keeper,
real client processes over real sockets and shared memory (host backend)."""

from __future__ import annotations

import json
import os
import queue
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from a2ad import fdpass, layout as L
from a2ad.daemon.keeper import KEEPER_SOCK
from a2ad.runtime import python_command
from helpers import REPO, DaemonProcess, finish_process, reap_keeper, release_holders, wait_for

pytestmark = pytest.mark.timeout(180)

#: A rank that runs dispatch/combine rounds with its peer until a call raises. With a third
#: argument > 0 it first opens that many extra fds, so that every socket it makes afterwards
#: (its lease connection included) is numbered above 1024.
RANK = r"""
import json, os, resource, sys, time
rt, job, rank, n, extra = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
held = []
if extra:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    base = os.open("/dev/null", os.O_RDONLY)
    held = [os.dup(base) for _ in range(extra)]
import torch
from a2ad import errors
from a2ad.client import MoeAlltoAll

class Mapping:
    moe_ep_rank, moe_ep_size = rank, n

a2a = MoeAlltoAll(Mapping(), max_num_tokens=8, top_k=2, num_experts=4, hidden_size=16, job=job, runtime_dir=rt, timeout=60)
lease_fd = a2a._att._shared._lease_sock.fileno()
print("ATTACHED", flush=True)
print("LEASE_FD", lease_fd, flush=True)
experts = torch.tensor([[0, 2], [1, 3], [2, 3], [0, 1]], dtype=torch.int32)
hidden = torch.randn(4, 16).to(torch.bfloat16)
rounds, t_end = 0, time.monotonic() + float(os.environ.get("RANK_SECONDS", "120"))
try:
    while time.monotonic() < t_end:
        recv = a2a.dispatch(experts, [hidden], runtime_max_tokens_per_rank=4)
        a2a.combine(recv[0], runtime_max_tokens_per_rank=4)
        rounds += 1
        if rounds % 20 == 0:
            print("ROUNDS", rounds, a2a._att._shared.lease_alive(), flush=True)
        time.sleep(0.002)
except errors.JobDestroyed as exc:
    print("DESTROYED", json.dumps({"reason": exc.details.get("reason"), "at": time.time(), "message": exc.message,
                                   "rounds": rounds}), flush=True)
    a2a.close()
    sys.exit(0)
except Exception as exc:
    print("ERROR", repr(exc), flush=True)
    sys.exit(1)
print("DONE", rounds, flush=True)
a2a.close()
"""

#: A rank that attaches and holds its rank until its stdin closes (then closes cleanly).
HOLDER = r"""
import sys, time
from a2ad.client import attach
rt, job, rank, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
a = attach(job, rank, n, runtime_dir=rt, timeout=60, max_num_tokens=16, top_k=2, num_experts=8,
           workspace_size_per_rank=1 << 20)
print("ATTACHED", flush=True)
sys.stdin.read()
a.close()
print("CLOSED", time.time(), flush=True)
"""


def _rank(rt: Path, job: str, rank: int, n: int, extra: int = 0, seconds: float = 120) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", RANK, str(rt), job, str(rank), str(n), str(extra)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, cwd=str(REPO),
        env=dict(os.environ, RANK_SECONDS=str(seconds)),
    )


def _holder(rt: Path, job: str, rank: int, n: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(rt), job, str(rank), str(n)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(REPO))


_QUEUES: dict[int, "queue.Queue[str]"] = {}


def _read_line(p: subprocess.Popen, prefix: str, timeout: float) -> str:
    """The next line of ``p`` starting with ``prefix`` (other lines skipped), bounded. A
    thread per process reads its stdout (a buffered readline and select() do not mix)."""
    q = _QUEUES.get(p.pid)
    if q is None:
        q = _QUEUES[p.pid] = queue.Queue()

        def pump():
            for line in p.stdout:
                q.put(line)
            q.put("")

        threading.Thread(target=pump, daemon=True).start()
    end = time.monotonic() + timeout
    skipped: list[str] = []
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise AssertionError(f"pid {p.pid}: no {prefix!r} line within {timeout} s (exit {p.poll()}; "
                                 f"last lines {skipped[-3:]})")
        try:
            line = q.get(timeout=left)
        except queue.Empty:
            continue
        if not line:
            q.put("")
            raise AssertionError(f"pid {p.pid} ended (exit {p.wait(5)}) before a {prefix!r} line "
                                 f"(last lines {skipped[-3:]})")
        if line.startswith(prefix):
            return line[len(prefix):].strip()
        if line.startswith("ERROR"):
            raise AssertionError(f"pid {p.pid}: {line.strip()}")
        skipped.append(line.strip())


def _keeper_call(rt: Path, req: dict, fds=None, timeout: float = 5.0):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        s.connect(str(rt / KEEPER_SOCK))
        fdpass.send_frame(s, req, fds, timeout=timeout)
        reply, extra = fdpass.recv_frame(s, timeout=timeout)
        fdpass.close_all(extra)
        return reply
    finally:
        s.close()


def _kill_pid(pid: int | None) -> None:
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _sigterm(d: DaemonProcess, timeout: float = 15.0) -> None:
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout) == 0, d.log_tail(40)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# --------------------------------------------------------------------------- item: no holder left
def test_rank_learns_when_no_daemon_and_no_keeper_holds_its_job(runtime_dir):
    """kill -9 of the daemon: the ranks run on (the keeper holds the job). kill -9 of the
    keeper as well: within a bound, the next call raises JobDestroyed (reason: no holder)."""
    d = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30", "--fd-store", "keeper")
    ranks: list[subprocess.Popen] = []
    keeper_pid = None
    try:
        d.start()
        keeper_pid = _keeper_call(runtime_dir, {"op": "ping"})["pid"]
        ranks = [_rank(runtime_dir, "orphan:1", r, 2) for r in range(2)]
        for p in ranks:
            _read_line(p, "ATTACHED", 60)
        for p in ranks:
            _read_line(p, "ROUNDS", 30)
        d.kill9()
        # the keeper still holds the job: the ranks keep serving, nobody raises
        for p in ranks:
            assert _read_line(p, "ROUNDS", 30).endswith("False")  # rounds after the lease went
        time.sleep(2.0)
        for p in ranks:
            assert p.poll() is None, "a rank stopped while the keeper still held its job"
        t_kill = time.time()
        _kill_pid(keeper_pid)
        results = [json.loads(_read_line(p, "DESTROYED", 30)) for p in ranks]
        for res in results:
            assert res["reason"] == L.ABORT_ORPHANED, res
            assert "no daemon and no fd store" in res["message"], res
        took = max(r["at"] for r in results) - t_kill
        print(f"figure: ranks raised JobDestroyed (no holder) {took:.3f} s after the keeper's kill -9 "
              f"(daemon killed first; lease check every 0.5 s)")
        assert took < 5.0, took
        for p in ranks:
            assert p.wait(15) == 0
    finally:
        for p in ranks:
            finish_process(p, 5)
        d.stop()
        _kill_pid(keeper_pid)
        reap_keeper(runtime_dir)


def test_fd_store_none_stop_tells_ranks_at_once(runtime_dir):
    """--fd-store none: a stop keeps the jobs for nobody; the ranks learn it at their next
    lease check, and the stop log says so."""
    d = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30", "--fd-store", "none")
    ranks: list[subprocess.Popen] = []
    try:
        d.start()
        ranks = [_rank(runtime_dir, "none:1", r, 2) for r in range(2)]
        for p in ranks:
            _read_line(p, "ATTACHED", 60)
        for p in ranks:
            _read_line(p, "ROUNDS", 30)
        t0 = time.time()
        d.stop()
        results = [json.loads(_read_line(p, "DESTROYED", 30)) for p in ranks]
        assert all(r["reason"] == L.ABORT_ORPHANED for r in results), results
        print(f"figure: --fd-store none, SIGTERM: ranks raised JobDestroyed {max(r['at'] for r in results) - t0:.3f} s "
              "after the stop began")
        assert "held by no one once this daemon exits" in d.log()
    finally:
        for p in ranks:
            finish_process(p, 5)
        d.stop()


# --------------------------------------------------------------------------- item: the keeper lingers, then frees
def test_keeper_frees_jobs_after_the_linger_once_no_rank_is_attached(runtime_dir):
    linger = 2.0
    d = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30", "--fd-store", "keeper",
                      "--keeper-linger", str(linger))
    holders: list[subprocess.Popen] = []
    keeper_pid = None
    try:
        d.start()
        holders = [_holder(runtime_dir, job, r, 2) for job in ("linger:a", "linger:b") for r in range(2)]
        for h in holders:
            _read_line(h, "ATTACHED", 60)
        keeper_pid = _keeper_call(runtime_dir, {"op": "ping"})["pid"]
        _sigterm(d)  # as systemctl stop would: the keeper stays (DaemonProcess.stop would reap it)
        log = d.log()
        # the stop log names the keeper, what it holds and how to free it now
        assert f"the fd keeper (pid {keeper_pid}) holds 2 job(s), " in log, log[-2000:]
        assert f"kill {keeper_pid}" in log and "a2ad-ctl shutdown --free-jobs" in log and f"{linger:g} s" in log
        ping = _keeper_call(runtime_dir, {"op": "ping"})
        assert ping["jobs"] == 2 and ping["linger"] == linger and ping["bytes"] > 0, ping
        # ranks attached: nothing is freed however long the daemon stays away
        time.sleep(linger + 2.0)
        assert _keeper_call(runtime_dir, {"op": "ping"})["jobs"] == 2
        # job a's ranks close (and exit); job b's stay
        for h in holders[:2]:
            h.stdin.close()
        closed = max(float(_read_line(h, "CLOSED", 30)) for h in holders[:2])
        wait_for(lambda: _keeper_call(runtime_dir, {"op": "ping"})["jobs"] == 1, linger + 10, "job a freed")
        took = time.time() - closed
        print(f"figure: keeper freed a job {took:.2f} s after its last rank closed "
              f"(--keeper-linger {linger:g}, daemon stopped; the keeper looks once a second)")
        assert linger - 0.2 <= took <= linger + 3.0, took  # the keeper looks once a second
        ping = _keeper_call(runtime_dir, {"op": "ping"})
        assert ping["jobs"] == 1 and ping["freed_jobs"] == 1, ping
        # a daemon that comes back stops the clock and re-adopts what is left
        d2 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30", "--fd-store", "keeper",
                           "--keeper-linger", str(linger))
        try:
            d2.start()
            assert [j["name"] for j in d2.request("jobs")["jobs"]] == ["linger:b"]
            release_holders(*holders[2:])
            time.sleep(linger + 1.5)  # the daemon is connected: the keeper frees nothing by itself
            ping = _keeper_call(runtime_dir, {"op": "ping"})
            assert ping["freed_jobs"] == 1 and ping["jobs"] == 1, ping  # job b stays (the daemon's grace decides)
        finally:
            d2.stop()
    finally:
        release_holders(*holders)
        d.stop()
        reap_keeper(runtime_dir)
        _kill_pid(keeper_pid)


def test_serve_refuses_a_bad_keeper_linger(runtime_dir):
    out = subprocess.run(python_command("a2ad.tools.cli", "serve", "--runtime-dir", str(runtime_dir),
                                        "--keeper-linger", "-1"), capture_output=True, text=True, timeout=60,
                         cwd=str(REPO))
    assert out.returncode == 2 and "--keeper-linger" in out.stderr and ">= 0" in out.stderr, out.stderr
    out = subprocess.run(python_command("a2ad.tools.cli", "serve", "--runtime-dir", str(runtime_dir), "--backend", "host"),
                         capture_output=True, text=True, timeout=60, cwd=str(REPO),
                         env=dict(os.environ, A2AD_KEEPER_LINGER="soon"))
    assert out.returncode == 1 and "$A2AD_KEEPER_LINGER" in out.stderr and "'soon'" in out.stderr, out.stderr
    assert not [p for p in runtime_dir.iterdir()], list(runtime_dir.iterdir())  # no lock, socket or keeper left


# --------------------------------------------------------------------------- item: fds above 1024
@pytest.mark.full
def test_rank_with_fds_above_1024_keeps_serving_through_a_restart(runtime_dir):
    """A rank whose lease socket is numbered above 1024: dispatch's lease check (poll, not
    select) raises nothing, and after a kill -9 of the daemon it renews its lease with the
    next one."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard open-file limit ({hard}) is below 1200")
    d = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30", "--fd-store", "keeper")
    d2 = None
    ranks: list[subprocess.Popen] = []
    try:
        d.start()
        ranks = [_rank(runtime_dir, "many:fds", r, 2, extra=1100 if r == 0 else 0, seconds=150) for r in range(2)]
        for p in ranks:
            _read_line(p, "ATTACHED", 60)
        lease_fd = int(_read_line(ranks[0], "LEASE_FD", 10))
        assert lease_fd > 1024, lease_fd
        for _ in range(3):  # > 1.5 s of rounds: the lease check ran several times
            _read_line(ranks[0], "ROUNDS", 30)
        d.kill9()
        d2 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30", "--fd-store", "keeper")
        d2.start()

        def renewed():
            info = d2.request("job_info", job="many:fds")
            return all(r["state"] == "attached" for r in info["ranks"])

        wait_for(renewed, 30, "both ranks' leases renewed with the new daemon")
        # lines the rank printed while its lease was down may still wait in the pipe: read on
        # until a report of the renewed lease, or fail at the bound
        end, line = time.monotonic() + 30, ""
        while not line.endswith("True"):
            assert time.monotonic() < end, f"rank 0 never reported its renewed lease (last: {line!r})"
            line = _read_line(ranks[0], "ROUNDS", max(0.1, end - time.monotonic()))
        print(f"figure: rank with lease fd {lease_fd}: rounds and a lease renewal across kill -9, no error")
    finally:
        for p in ranks:
            finish_process(p, 5)
        if d2 is not None:
            d2.stop()
        d.stop()
        reap_keeper(runtime_dir)


def _start_keeper(path: Path) -> subprocess.Popen:
    """A keeper on ``path``, once it printed READY (within 20 s); its log goes to a file
    beside the socket (a pipe nobody reads could fill and stall it)."""
    with open(path.parent / "keeper.log", "wb") as err:
        proc = subprocess.Popen(python_command("a2ad.daemon.keeper", "--socket", str(path)),
                                stdout=subprocess.PIPE, stderr=err, cwd=str(REPO))
    ready, _, _ = select.select([proc.stdout], [], [], 20.0)
    line = proc.stdout.readline() if ready else b"(nothing within 20 s)"
    if line.strip() != b"READY":
        proc.kill()
        proc.wait(5)
        proc.stdout.close()
        raise AssertionError(f"keeper did not start: {line!r}; log: {(path.parent / 'keeper.log').read_text()[-2000:]}")
    return proc


def test_keeper_holding_1100_fds_survives_a_second_connection(runtime_dir):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2600:
        pytest.skip(f"the hard open-file limit ({hard}) is below 2600")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    path = runtime_dir / KEEPER_SOCK
    proc = _start_keeper(path)
    fds = []
    first = None
    try:
        for i in range(1100):
            fd = os.memfd_create(f"t{i}")
            fds.append(fd)
        names = [f"ws.big.{i}" for i in range(1100)]
        first = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        first.connect(str(path))
        for run in fdpass.batches(names):
            fdpass.send_frame(first, {"op": "put_many", "names": run, "epoch": 1},
                              [fds[int(n.rsplit(".", 1)[1])] for n in run], timeout=10)
            reply, _ = fdpass.recv_frame(first, timeout=10)
            assert reply["ok"], reply
        # the keeper's next accepted connection is numbered above 1024
        for _ in range(3):
            reply = _keeper_call(runtime_dir, {"op": "ping"})
            assert reply["count"] == 1100, reply
        fdpass.send_frame(first, {"op": "ping"}, timeout=5)
        assert fdpass.recv_frame(first, timeout=5)[0]["count"] == 1100
        assert proc.poll() is None
        print("figure: keeper holding 1100 fds answered 3 new connections and the first one")
    finally:
        if first is not None:
            first.close()
        for fd in fds:
            os.close(fd)
        try:
            _keeper_call(runtime_dir, {"op": "exit"})
        except OSError:
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        proc.stdout.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --------------------------------------------------------------------------- item: keeper peer credentials
def _ping_as(uid: int | None, path: Path) -> str:
    """'ANSWERED' or 'REFUSED <error>' for a ping to the keeper at ``path`` from a forked
    child running as ``uid`` (None: this process's uid)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            if uid is not None:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(str(path))
            try:
                fdpass.send_frame(s, {"op": "ping"}, timeout=5)
                fdpass.recv_frame(s, timeout=5)
                out = "ANSWERED"
            except Exception as exc:
                out = f"REFUSED {type(exc).__name__}"
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


def test_keeper_serves_only_its_own_uid_not_even_root(tmp_path):
    """A keeper running as another uid than root (as the daemon's keeper does under systemd's
    User=): with its socket opened to everyone, root and a third uid are closed unanswered
    (SO_PEERCRED); its own uid is served."""
    import a2ad.daemon.fdstore  # noqa: F401  (imported before the child drops its uid)
    from a2ad.daemon import keeper

    if os.getuid() != 0:
        pytest.skip("needs root to run the keeper as a second uid")
    owner = 65534
    folder = Path(tempfile.mkdtemp(prefix="a2ad-k-"))
    path = folder / KEEPER_SOCK
    pid = None
    try:
        os.chown(folder, owner, 65534)
        folder.chmod(0o755)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the keeper
            code = 1
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(owner)
                sys.stdout = open(os.devnull, "w")
                code = keeper.serve(str(path), linger=60)
            finally:
                os._exit(code)
        wait_for(path.exists, 20, "the keeper's socket")
        path.chmod(0o666)  # only the peer check stands between the keeper and anyone
        assert _ping_as(owner, path) == "ANSWERED"
        assert _ping_as(None, path).startswith("REFUSED"), "root was served by another uid's keeper"
        assert _ping_as(12345, path).startswith("REFUSED")
        assert _ping_as(owner, path) == "ANSWERED"  # and it is still up
    finally:
        if pid:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


# --------------------------------------------------------------------------- item: metrics name no other user's job
def _scrape(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def _metrics_as(uid: int, runtime_dir: Path) -> str:
    """``metrics`` over ctl.sock from a forked child running as ``uid`` (gid 65534)."""
    from a2ad.connection import DaemonClient

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(uid)
            with DaemonClient(runtime_dir, timeout=10) as c:
                text = c.request("metrics")["text"]
            os.write(w, text.encode())
            code = 0
        except BaseException as exc:
            os.write(w, f"CHILD ERROR {exc!r}".encode())
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    with os.fdopen(r, "rb") as f:
        chunks.append(f.read())
    _, status = os.waitpid(pid, 0)
    out = b"".join(chunks).decode()
    assert status == 0, out
    return out


def test_metrics_name_other_users_jobs_only_to_admins(runtime_dir):
    import grp

    if os.getuid() != 0:
        pytest.skip("needs root to ask as a second uid")
    try:
        group = grp.getgrgid(65534).gr_name
    except KeyError:
        pytest.skip("no group 65534 on this machine")
    from helpers import free_port

    other = 12345
    port = free_port()
    args = ("--backend", "host", "--grace", "30", "--fd-store", "keeper", "--group", group,
            "--allow-uid", str(other), "--metrics-port", str(port))
    d = DaemonProcess(runtime_dir, *args)
    d2 = None
    holder = None
    job = "secret-model:layer0"
    try:
        d.start()
        holder = subprocess.Popen([sys.executable, "-c", r"""
import sys
from a2ad.client import attach
a = attach(sys.argv[2], 0, 1, runtime_dir=sys.argv[1], timeout=60, max_num_tokens=16, top_k=2, num_experts=8,
           workspace_size_per_rank=1 << 20, on_peer_loss="degrade")
print("ATTACHED", flush=True)
sys.stdin.read()
a.close()
""", str(runtime_dir), job], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(REPO))
        _read_line(holder, "ATTACHED", 60)
        own = d.request("metrics")["text"]  # root: an admin
        assert f'a2ad_job_active_ranks{{job="{job}"}}' in own, own
        http = _scrape(port)
        assert job not in http and "a2ad_jobs 1.0" in http, http
        theirs = _metrics_as(other, runtime_dir)
        assert job not in theirs and "a2ad_jobs 1.0" in theirs and "a2ad_job_active_ranks" in theirs, theirs
        print("figure: /metrics and another uid's a2ad-ctl metrics count the job (a2ad_jobs 1) without naming it")
        d.kill9()
        d2 = DaemonProcess(runtime_dir, *args, "--metrics-job-names")
        d2.start()
        assert f'a2ad_job_active_ranks{{job="{job}"}}' in _scrape(port)
    finally:
        if holder is not None:
            release_holders(holder)
        if d2 is not None:
            d2.stop()
        d.stop()
        reap_keeper(runtime_dir)
