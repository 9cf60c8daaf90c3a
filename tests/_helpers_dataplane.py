"""Helpers of the data-plane tests: a pool of real client processes and a daemon per backend.

Spawning a process that imports torch takes seconds on a small CI machine, so the
data-plane tests share one pool of long-lived spawned rank processes
(:class:`RankPool`). ``pool.run(n, fn, *args)`` runs ``fn(rank, *args)`` (a
module-level function, e.g. from ``dataplane_cases``) in ranks ``0..n-1`` at the
same time and returns their results in rank order; a rank that raises is
reported with its traceback, and a run that does not finish in time kills the
pool (the next run starts a fresh one), so nothing hangs.

The daemons are real ``a2ad serve`` processes, one per backend for the session
(every test uses its own job name).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from pathlib import Path

import pytest

from helpers import DaemonProcess

#: Most ranks a test uses (the pool's size).
POOL_SIZE = 8

BACKENDS = [pytest.param("host", id="host"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _worker_loop(rank: int, commands, results) -> None:
    import torch

    torch.set_num_threads(1)
    results.put((None, rank, "ready", None))
    while True:
        msg = commands.get()
        if msg is None:
            return
        tag, fn, args = msg
        try:
            results.put((tag, rank, "ok", fn(rank, *args)))
        except BaseException as exc:  # report everything, typed a2ad errors included
            results.put((tag, rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class RankPool:
    """``size`` spawned client processes that run functions on request (see the module doc)."""

    def __init__(self, size: int = POOL_SIZE):
        self.size = size
        self._ctx = mp.get_context("spawn")
        self._tags = itertools.count()
        self._procs: list = [None] * size
        self._commands: list = [None] * size
        self._results = self._ctx.Queue()

    def _ensure(self, n: int, timeout: float = 300.0) -> None:
        """Ranks ``0..n-1`` running, a fresh process started where one is missing; returns once
        every fresh one has imported torch (seconds, longer on a busy machine), so that a
        job's rendezvous timeout never counts a process start (bounded by ``timeout``)."""
        fresh = set()
        for r in range(n):
            p = self._procs[r]
            if p is None or not p.is_alive():
                if p is not None:
                    p.join(1)
                commands = self._ctx.Queue()
                p = self._ctx.Process(
                    target=_worker_loop, args=(r, commands, self._results), daemon=True, name=f"a2ad-test-rank{r}"
                )
                p.start()
                self._procs[r], self._commands[r] = p, commands
                fresh.add(r)
        deadline = time.monotonic() + timeout
        while fresh:
            try:
                got_tag, rank, status, _ = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = sorted(r for r in fresh if not self._procs[r].is_alive())
                if dead:
                    codes = {r: self._procs[r].exitcode for r in dead}
                    self.kill()
                    raise AssertionError(f"rank process(es) {dead} died while starting (exit codes {codes})")
                if time.monotonic() > deadline:
                    waiting = sorted(fresh)
                    self.kill()
                    raise AssertionError(f"rank process(es) {waiting} did not start (import torch) within {timeout} s")
                continue
            if got_tag is None and status == "ready":
                fresh.discard(rank)

    def run(self, n: int, fn, *args, timeout: float = 120.0, may_exit: tuple[int, ...] = ()) -> list:
        """``[fn(rank, *args) for rank in range(n)]``, each in its own process, all at once.

        A rank in ``may_exit`` may end its process instead of answering (its result is
        None; the pool replaces the process). Raises AssertionError naming every rank
        that raised, died, or did not answer within ``timeout`` seconds.
        """
        if not 1 <= n <= self.size:
            raise ValueError(f"the pool has {self.size} ranks, asked for {n}")
        self._ensure(n)
        tag = next(self._tags)
        for r in range(n):
            self._commands[r].put((tag, fn, args))
        results: dict[int, object] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(failures) < n:
            try:
                got_tag, rank, status, value = self._results.get(timeout=0.2)
            except queue.Empty:
                for r in range(n):
                    if r not in results and r not in failures and not self._procs[r].is_alive():
                        if r in may_exit:
                            results[r] = None
                        else:
                            failures[r] = f"the process died (exit code {self._procs[r].exitcode})"
                if time.monotonic() > deadline:
                    missing = sorted(set(range(n)) - set(results) - set(failures))
                    self.kill()
                    raise AssertionError(f"{fn.__name__}: ranks {missing} did not answer in {timeout} s")
                continue
            if got_tag != tag:
                continue
            if status == "ok":
                results[rank] = value
            else:
                failures[rank] = value
        if failures:
            text = "\n".join(f"--- rank {r}: {msg}" for r, msg in sorted(failures.items()))
            raise AssertionError(f"{fn.__name__}: {len(failures)} of {n} ranks failed\n{text}")
        return [results[r] for r in range(n)]

    def kill(self) -> None:
        """End every process now (after a hang); the next run starts fresh ones."""
        for p in self._procs:
            if p is not None and p.is_alive():
                p.kill()
        for p in self._procs:
            if p is not None:
                p.join(5)
        self._procs = [None] * self.size
        self._commands = [None] * self.size
        self._results = self._ctx.Queue()

    def close(self, timeout: float = 10.0) -> None:
        for p, c in zip(self._procs, self._commands):
            if p is not None and p.is_alive():
                c.put(None)
        end = time.monotonic() + timeout
        for p in self._procs:
            if p is not None:
                p.join(max(0.1, end - time.monotonic()))
        self.kill()


@pytest.fixture(scope="session")
def rank_pool():
    pool = RankPool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def dataplane_daemons():
    """``get(backend) -> DaemonProcess``: one real daemon per backend for the session."""
    started: dict[str, DaemonProcess] = {}
    dirs = []

    def get(backend: str) -> DaemonProcess:
        if backend not in started:
            d = Path(tempfile.mkdtemp(prefix="a2ad-dp-"))
            dirs.append(d)
            started[backend] = DaemonProcess(d, "--backend", backend, "--grace", "1").start()
        return started[backend]

    yield get
    import shutil

    for d in started.values():
        d.stop()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


_job_ids = itertools.count()


def job_name(prefix: str) -> str:
    """A job name no other test of this session uses."""
    return f"{prefix}-{os.getpid()}-{next(_job_ids)}"


def make_job(daemons, backend: str, prefix: str, ep: int, *, max_num_tokens: int = 6, top_k: int = 4,
             num_experts: int = 16, hidden: int = 64, **kw):
    """A ``dataplane_cases.JobSpec`` on the shared daemon of ``backend``, with a fresh name."""
    import dataplane_cases as cases

    return cases.JobSpec(
        runtime_dir=str(daemons(backend).runtime_dir),
        name=job_name(prefix),
        backend=backend,
        ep_size=ep,
        max_num_tokens=max_num_tokens,
        top_k=top_k,
        num_experts=num_experts,
        hidden=hidden,
        timeout=20.0,
        **kw,
    )


def run_job(pool, job, fn, *args, timeout: float = 180.0):
    """Run scenario ``fn`` on every rank of ``job``, then close the job on every rank."""
    import dataplane_cases as cases

    try:
        return pool.run(job.ep_size, fn, job, *args, timeout=timeout)
    finally:
        pool.run(job.ep_size, cases.close_job, job.name, timeout=30.0)
