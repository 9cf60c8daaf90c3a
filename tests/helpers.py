"""Test helpers: a real daemon subprocess, process fd/RSS probes, and a runner that
executes a function in N real client processes and collects results with timeouts."""

from __future__ import annotations

import array
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import threading
import time
import traceback
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from a2ad.tools.launcher import DaemonLauncher, LaunchError, reap_keeper  # noqa: E402,F401


class DaemonProcess(DaemonLauncher):
    """A real ``a2ad serve`` for a test (debug log) through the shared launcher. Its log lives
    in the launcher's temp folder: still readable after ``stop``, removed once the object is
    gone (or at exit). ``stop`` fails the test if SIGTERM did not end the daemon in time."""

    def __init__(self, runtime_dir: Path, *args: str, **kw):
        super().__init__(Path(runtime_dir), "--log-level", "debug", *args, **kw)

    def start(self, timeout: float = 20.0) -> "DaemonProcess":
        super().start(timeout)
        return self

    def stop(self, timeout: float = 10.0, remove_log: bool | None = None) -> int | None:
        was_running = self.running()
        rc = super().stop(timeout, False if remove_log is None else remove_log)
        if was_running and self.stopped_by == "sigkill":
            raise AssertionError(f"daemon did not stop on SIGTERM within {timeout} s:\n{self.log_tail(60)}")
        return rc


class Mapping:
    """What FlashInfer's ``Mapping`` offers ``MoeAlltoAll``: this rank and the EP size."""

    def __init__(self, rank: int, size: int):
        self.moe_ep_rank = rank
        self.moe_ep_size = size


def end_daemon(d: DaemonLauncher, runtime_dir: Path, timeout: float = 15.0) -> None:
    """End a test's daemon whatever state the test left it in (SIGTERM, then SIGKILL after
    ``timeout``), and reap the fd keeper of its runtime folder: for ``finally`` blocks."""
    try:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.send_signal(signal.SIGTERM)
            try:
                d.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                d.proc.kill()
                d.proc.wait(10)
    finally:
        reap_keeper(runtime_dir)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def settled_fd_count(pid: int, timeout: float = 5.0, quiet: float = 0.3) -> int:
    """``pid``'s open fd count once it held still for ``quiet`` seconds (libzmq closes a departed
    peer's connection asynchronously, so a count taken right after a client left may still
    include it)."""
    end = time.monotonic() + timeout
    last, since = fd_count(pid), time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.02)
        n = fd_count(pid)
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return n
    raise AssertionError(f"pid {pid}: open fd count did not settle within {timeout} s (last {last})")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def wait_for(predicate, timeout: float, what: str, interval: float = 0.02):
    """Poll ``predicate`` until it returns a truthy value; fail naming ``what``."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last value {last!r})")


# --------------------------------------------------------------------------- ranks
def _rank_main(fn, rank, args, q):
    try:
        q.put((rank, "ok", fn(rank, *args)))
    except BaseException as exc:  # report everything, including typed a2ad errors
        q.put((rank, "error", (type(exc).__name__, str(exc), traceback.format_exc())))


def run_ranks(fn, ranks, args=(), timeout: float = 120.0, ctx=None):
    """Run ``fn(rank, *args)`` in one spawned process per rank; return {rank: result}.

    Raises AssertionError with the child's traceback if any rank raised or died without
    reporting, and never hangs: when a rank does not report within ``timeout``, or on any
    other way out (an error here, KeyboardInterrupt), every rank still running is killed.
    After a normal finish the ranks get 5 s in all to exit before they are killed too."""
    import queue as queue_mod

    ctx = ctx or mp.get_context("spawn")
    q = ctx.Queue()
    procs: dict = {}
    results, failures = {}, {}
    dead_since: dict = {}
    finished = False
    try:
        for r in ranks:
            procs[r] = ctx.Process(target=_rank_main, args=(fn, r, args, q), daemon=True)
            procs[r].start()
        end = time.monotonic() + timeout
        while len(results) + len(failures) < len(procs):
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"ranks {sorted(set(procs) - set(results) - set(failures))} did not finish in {timeout} s")
            try:
                rank, status, value = q.get(timeout=min(remaining, 0.5))
            except queue_mod.Empty:
                now = time.monotonic()
                for r, p in procs.items():
                    if r in results or r in failures or p.is_alive():
                        continue
                    # its report, if any, is flushed before it exits: give the pipe a moment
                    if now - dead_since.setdefault(r, now) > 2.0:
                        failures[r] = ("Died", f"exited with {p.exitcode} without reporting", "")
                continue
            (results if status == "ok" else failures)[rank] = value
        finished = True
    finally:
        grace_end = time.monotonic() + (5.0 if finished else 0.0)
        for p in procs.values():
            if p.pid is None:
                continue  # never started
            p.join(timeout=max(0.0, grace_end - time.monotonic()))
            if p.is_alive():
                p.kill()
        for p in procs.values():
            if p.pid is not None:
                p.join(5)
        q.close()
        q.cancel_join_thread()
    if failures:
        msgs = "\n".join(f"rank {r}: {v[0]}: {v[1]}\n{v[2]}" for r, v in sorted(failures.items()))
        raise AssertionError(f"{len(failures)} rank(s) failed:\n{msgs}")
    return results


# --------------------------------------------------------------------------- sd_notify
class NotifyListener:
    """A service manager's side of sd_notify: an AF_UNIX datagram socket, bound to a path
    or to an abstract name ('@...' in $NOTIFY_SOCKET), read promptly by a thread (as
    systemd does) that records every message. ``paused`` stops the reading, so that the
    socket's queue fills up like that of a busy service manager."""

    def __init__(self, kind: str, folder: Path):  # kind: "path" or "abstract"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            if kind == "path":
                path = str(folder / f"notify-{uuid.uuid4().hex[:8]}.sock")
                self.sock.bind(path)
                self.env = path
            else:
                name = f"a2ad-test-notify-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                self.sock.bind("\0" + name)
                self.env = "@" + name
        except BaseException:
            self.sock.close()
            raise
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, dict, list[int]]] = []
        self.paused = False
        #: messages whose fds did not all fit (a sender that passed more than it should)
        self.truncated = 0
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            if self.paused:
                time.sleep(0.01)
                continue
            try:
                data, anc, flags, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(16 * 4))
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                return
            fds: list[int] = []
            for level, ctype, cdata in anc:
                if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(cdata[: len(cdata) - len(cdata) % a.itemsize])
                    fds.extend(a)
            fields = dict(line.split("=", 1) for line in data.decode().split("\n") if "=" in line)
            with self._lock:
                self.messages.append((time.monotonic(), fields, fds))
                if flags & socket.MSG_CTRUNC:
                    self.truncated += 1

    def snapshot(self) -> list[tuple[float, dict, list[int]]]:
        with self._lock:
            return list(self.messages)

    def wait(self, predicate, timeout: float, what: str) -> dict:
        """The first recorded message (old or new) for which predicate(fields) holds."""
        end = time.monotonic() + timeout
        while True:
            for _, fields, _ in self.snapshot():
                if predicate(fields):
                    return fields
            if time.monotonic() >= end:
                raise AssertionError(f"no notify message with {what} in {timeout} s; got {[m[1] for m in self.snapshot()]}")
            time.sleep(0.01)

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self.sock.close()
        for _, _, fds in self.messages:
            for fd in fds:
                os.close(fd)


# --------------------------------------------------------------------------- holder processes
def wait_attached(*procs: subprocess.Popen, timeout: float = 60.0) -> None:
    """Each process prints ATTACHED once it holds its rank (bounded)."""
    import select

    for p in procs:
        r, _, _ = select.select([p.stdout], [], [], timeout)
        line = p.stdout.readline() if r else ""
        assert line.strip() == "ATTACHED", f"holder said {line!r} (exit {p.poll()})"


def release_holders(*procs: subprocess.Popen, kill: bool = False) -> None:
    """End holder processes (closing stdin tells them to leave; ``kill`` kills them first)
    and close their pipes; never waits unbounded."""
    for p in procs:
        if kill and p.poll() is None:
            p.kill()
        if p.poll() is None:
            try:
                p.stdin.close()
            except OSError:
                pass
    for p in procs:
        finish_process(p, 15)


def finish_process(p: subprocess.Popen, timeout: float) -> None:
    """Wait up to ``timeout`` s for ``p`` to exit, then kill it; close its pipes."""
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)
    for f in (p.stdin, p.stdout, p.stderr):
        if f is not None and not f.closed:
            f.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankReports:
    """Reports of rank processes on one queue, each ``(rank, kind, t, value)``.

    ``expect`` collects one report of a kind per rank, and an ``"error"`` report fails the
    test at once; reports nobody has asked for yet wait in ``backlog``. ``wait_rounds`` is
    for groups whose ranks count their completed rounds in ``self.shared["done"]``."""

    def __init__(self, ctx):
        self.results = ctx.Queue()
        self.backlog: list = []

    def expect(self, what, ranks, timeout=90.0) -> dict:
        """``{rank: (t, value)}``: one ``what`` report from every rank in ``ranks``."""
        import queue

        got = {}
        for item in list(self.backlog):
            rank, kind, t, value = item
            if kind == what and rank in ranks and rank not in got:
                got[rank] = (t, value)
                self.backlog.remove(item)
        end = time.monotonic() + timeout
        while set(got) != set(ranks):
            try:
                item = self.results.get(timeout=max(0.05, min(0.5, end - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > end:
                    raise AssertionError(f"waited {timeout} s for {what!r} from ranks {sorted(set(ranks) - set(got))}")
                continue
            rank, kind, t, value = item
            if kind == "error":
                raise AssertionError(f"rank {rank} failed: {value}")
            if kind == what and rank in ranks and rank not in got:
                got[rank] = (t, value)
            else:
                self.backlog.append(item)
        return got

    def drain(self) -> list:
        """Every report that has arrived, moved into the backlog; returns them."""
        import queue

        out = []
        while True:
            try:
                item = self.results.get_nowait()
            except queue.Empty:
                return out
            self.backlog.append(item)
            out.append(item)

    def forget(self, rank):
        """Drop what ``rank`` reported so far (a replacement reports anew); errors stay."""
        self.drain()
        self.backlog = [item for item in self.backlog if item[0] != rank or item[1] == "error"]

    @staticmethod
    def end_processes(procs, grace: float = 5.0) -> None:
        """End every rank process still running (also after a failed test): ``grace`` s to
        exit, then killed."""
        for p in procs:
            if p.is_alive():
                p.join(grace)
            if p.is_alive():
                p.kill()
                p.join(5)

    def wait_rounds(self, ranks, n, timeout=90.0, what="rounds"):
        """Until every rank in ``ranks`` completed ``n`` more rounds than now (an error report fails it)."""
        done = self.shared["done"]
        start = {r: done[r] for r in ranks}
        end = time.monotonic() + timeout
        while any(done[r] < start[r] + n for r in ranks):
            for item in self.drain():
                if item[1] == "error":
                    raise AssertionError(f"rank {item[0]} failed: {item[3]}")
            if time.monotonic() > end:
                raise AssertionError(f"waited {timeout} s for {n} {what} on ranks {list(ranks)}: "
                                     f"{ {r: done[r] - start[r] for r in ranks} }")
            time.sleep(0.01)


def running_site_dirs() -> list[str]:
    """The site-packages folders of the interpreter running the tests (a venv's own, plus the
    base interpreter's when that venv was made with --system-site-packages, plus the user's
    when enabled): where its torch, pyzmq and msgpack are installed."""
    import site

    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def make_venv(root: Path, *, pip: bool, timeout: float = 240.0) -> Path:
    """A fresh venv at ``root`` that sees the packages of the interpreter running the tests;
    returns its python. A .pth file of the venv lists that interpreter's site-packages
    (``running_site_dirs``), so this holds from inside a venv too, where --system-site-packages
    would reach the base interpreter instead. Those folders come after the venv's own on
    sys.path and the .pth files inside them are not read: an a2ad installed there (editable,
    say) does not shadow one installed into the venv. ``pip``: the venv gets its own pip
    (otherwise the running interpreter's pip, seen through the .pth, installs into it)."""
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    cmd = [sys.executable, "-m", "venv"] + ([] if pip else ["--without-pip"]) + [str(root)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, f"{' '.join(cmd)}: {r.stdout[-2000:]}{r.stderr[-2000:]}"
    py = Path(root) / "bin" / "python"
    r = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       capture_output=True, text=True, timeout=60, env=env, cwd=str(root))
    assert r.returncode == 0, r.stderr
    purelib = Path(r.stdout.strip())
    assert purelib.is_relative_to(root), purelib
    purelib.mkdir(parents=True, exist_ok=True)
    dirs = running_site_dirs()
    assert dirs, f"{sys.executable} has no site-packages folder"
    (purelib / "_running_interpreter_site.pth").write_text("".join(d + "\n" for d in dirs))
    r = subprocess.run([str(py), "-c", "import torch, zmq, msgpack, numpy, pip"], capture_output=True, text=True,
                       timeout=120, env=env, cwd=str(root))
    assert r.returncode == 0, f"the venv at {root} does not see the packages of {sys.executable} ({dirs}): " \
                              f"{r.stderr[-2000:]}"
    return py
