"""Test helpers: a real daemon subprocess, process fd/RSS probes, and a runner that
executes a function in N real client processes and collects results with timeouts."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class DaemonProcess:
    def __init__(self, runtime_dir: Path, *args: str):
        self.runtime_dir = Path(runtime_dir)
        self.args = list(args)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.runtime_dir.parent / f"{self.runtime_dir.name}-daemon.log"

    def start(self, timeout: float = 20.0) -> "DaemonProcess":
        from a2ad.connection import ping
        from a2ad.errors import DaemonUnavailable

        self._log = open(self.log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "a2ad.tools.cli", "serve", "--runtime-dir", str(self.runtime_dir), "--log-level", "debug", *self.args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(REPO),
        )
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                ping(self.runtime_dir, timeout=0.5)
                return self
            except DaemonUnavailable:
                time.sleep(0.05)
        raise RuntimeError(f"daemon did not come up in {timeout} s:\n{self.log()}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def client(self, timeout: float = 5.0):
        from a2ad.connection import DaemonClient

        return DaemonClient(self.runtime_dir, timeout=timeout)

    def request(self, rtype: str, **fields) -> dict:
        with self.client() as c:
            return c.request(rtype, **fields)

    def kill9(self) -> None:
        """SIGKILL the daemon (its fd keeper, if any, lives on, as in production)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if not self._log.closed:
            self._log.close()

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                raise AssertionError(f"daemon did not stop on SIGTERM within {timeout} s:\n{self.log()}")
        if not self._log.closed:
            self._log.close()
        reap_keeper(self.runtime_dir)
        return self.proc.returncode


def reap_keeper(runtime_dir: Path) -> None:
    """Ask a keeper left by a killed daemon to exit (tests must not leave processes behind)."""
    import socket

    from a2ad import fdpass

    path = Path(runtime_dir) / "keeper.sock"
    if not path.exists():
        return
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        fdpass.send_frame(s, {"op": "exit"})
        fdpass.recv_frame(s, timeout=5)
    except OSError:
        pass
    finally:
        s.close()


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

    Raises AssertionError with the child's traceback if any rank raised, and kills
    everything (never hangs) if a rank does not report within ``timeout``."""
    ctx = ctx or mp.get_context("spawn")
    q = ctx.Queue()
    procs = {r: ctx.Process(target=_rank_main, args=(fn, r, args, q), daemon=True) for r in ranks}
    for p in procs.values():
        p.start()
    results, failures = {}, {}
    end = time.monotonic() + timeout
    try:
        while len(results) + len(failures) < len(procs):
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"ranks {sorted(set(procs) - set(results) - set(failures))} did not finish in {timeout} s")
            try:
                rank, status, value = q.get(timeout=min(remaining, 1.0))
            except Exception:
                continue
            (results if status == "ok" else failures)[rank] = value
    finally:
        for p in procs.values():
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(5)
    if failures:
        msgs = "\n".join(f"rank {r}: {v[0]}: {v[1]}\n{v[2]}" for r, v in sorted(failures.items()))
        raise AssertionError(f"{len(failures)} rank(s) failed:\n{msgs}")
    return results
