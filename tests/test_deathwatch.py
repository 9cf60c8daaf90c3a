"""A rank's death seen through its watch threads, with real processes: the daemon's handle on
a thread of another process, and a kill -9 of a rank that holds torch and its mapped
workspaces, seen by a real daemon before the kernel has closed the rank's files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from a2ad import errors
from a2ad.daemon.hostio import RealHost
from helpers import REPO, wait_for

SPEC = dict(max_num_tokens=64, top_k=2, num_experts=8, dispatch_bytes_per_token=2048, combine_bytes_per_token=2048)

#: Attaches JOB rank R of N with the client library (torch imported, every rank's workspace
#: mapped), prints ATTACHED and its watch threads' ids, then sleeps until killed.
RANK = r"""
import json, sys, time
from a2ad.client import attach
from a2ad.client import deathwatch
rt, job, rank, n, spec = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
a = attach(job, rank, n, runtime_dir=rt, timeout=60, **spec)
print("ATTACHED", *deathwatch.tids(), flush=True)
time.sleep(600)
"""


def _rank(daemon, job, rank, n):
    return subprocess.Popen([sys.executable, "-c", RANK, str(daemon.runtime_dir), job, str(rank), str(n),
                             json.dumps(SPEC)], stdout=subprocess.PIPE, text=True, cwd=str(REPO))


def _state(daemon, job, rank):
    try:
        return daemon.request("job_info", job=job)["ranks"][rank]["state"]
    except errors.NoSuchJob:
        return None


def test_a_thread_handle_is_given_only_for_a_thread_of_the_named_process():
    """hostio's thread pidfd: a thread of ours, yes; our main thread (its pidfd would report the
    whole process) and a thread id that is another process's, no. It reports the thread's end."""
    stop = threading.Event()
    box = []
    t = threading.Thread(target=lambda: (box.append(threading.get_native_id()), stop.wait(60)))
    t.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        wait_for(lambda: box, 10, "the thread's id")
        fd = RealHost.open_thread_pidfd(os.getpid(), box[0])
        if fd is None:
            pytest.skip("this kernel has no thread pidfds (Linux 6.9 added them): deaths are seen by the lease socket")
        try:
            import select

            assert select.select([fd], [], [], 0)[0] == []  # the thread runs
            assert RealHost.open_thread_pidfd(os.getpid(), os.getpid()) is None
            assert RealHost.open_thread_pidfd(os.getpid(), child.pid) is None
            assert RealHost.open_thread_pidfd(child.pid, box[0]) is None
            stop.set()
            t.join(10)
            assert select.select([fd], [], [], 10)[0] == [fd]  # and its end is reported
        finally:
            os.close(fd)
    finally:
        stop.set()
        child.kill()
        child.wait()


def test_a_thread_handle_numbered_past_1024_is_checked_too():
    """A daemon with many ranks holds fds numbered past 1024 (select()'s limit): the check of a
    new thread handle works there as well."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the open-file limit ({hard}) leaves no fd numbers past 1024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    stop = threading.Event()
    box = []
    t = threading.Thread(target=lambda: (box.append(threading.get_native_id()), stop.wait(60)))
    t.start()
    held = []
    try:
        wait_for(lambda: box, 10, "the thread's id")
        while not held or held[-1] < 1030:
            held.append(os.open(os.devnull, os.O_RDONLY))
        fd = RealHost.open_thread_pidfd(os.getpid(), box[0])
        if fd is None:
            pytest.skip("this kernel has no thread pidfds")
        assert fd > 1024
        os.close(fd)
    finally:
        stop.set()
        t.join(10)
        for h in held:
            os.close(h)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_kill9_of_an_attached_rank_is_seen_by_its_watch_thread(daemon_factory):
    daemon = daemon_factory("--grace", "5", backend="host")
    procs = [_rank(daemon, "watched", r, 2) for r in range(2)]
    try:
        tids = []
        for p in procs:
            word, *ids = p.stdout.readline().split()
            assert word == "ATTACHED", word
            tids.append([int(i) for i in ids])
            assert len(tids[-1]) == 2 and all(os.path.exists(f"/proc/{p.pid}/task/{i}") for i in tids[-1])
        victim = procs[1]
        t0 = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        wait_for(lambda: _state(daemon, "watched", 1) == "dead", 10, "rank 1 dead")
        seen = time.monotonic() - t0
        victim.wait(10)
        log = daemon.log()
        kernel_has_thread_pidfds = "its watch thread ended" in log
        print(f"\nfigure: kill -9 of an attached rank (torch, 2 workspaces mapped) seen by the daemon after "
              f"{seen * 1e3:.1f} ms (polling job_info; by {'its watch thread' if kernel_has_thread_pidfds else 'its lease socket'})")
        if not kernel_has_thread_pidfds:
            assert "lease connection closed without leave" in log
            pytest.skip("this kernel has no thread pidfds: the death was seen by the lease socket")
        assert "rank 1 (pid %d) died (its watch thread ended with its process)" % victim.pid in log, daemon.log_tail(40)
        # seen once: the lease connection's EOF that follows is not a second death
        time.sleep(0.5)
        info = daemon.request("job_info", job="watched")
        assert info["ranks"][1]["deaths"] == 1 and info["ranks"][0]["state"] == "attached"
        assert seen < 2.0
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()
