"""Watch threads: threads that end only with their process, so the daemon learns of a death
sooner than from the lease connection.

A process killed with SIGKILL closes its files (the lease connection among them) only once
the kernel has torn down its memory: tens of milliseconds for a process with torch and
mapped workspaces, more under load. Each of its threads ends before that, and a thread that
is not the last one to go ends without waiting for it. A join names two such threads (their
thread ids, ``watch``); the daemon watches each with a thread pidfd and counts the rank
dead when one ends (docs/PROTOCOL.md, "Failure detection"). Two, because the last thread to
exit is the one that tears the memory down: at least one of the two is not it.

The threads block on a lock nobody releases; they are daemon threads, cost no fd, and run no
Python code after they start. A forked child starts its own on its first join.
"""

from __future__ import annotations

import os
import threading

#: Threads a join names. The daemon takes up to four (protocol.MAX_WATCH_THREADS).
COUNT = 2

_lock = threading.Lock()
_pid: int | None = None
_tids: tuple[int, ...] = ()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it


os.register_at_fork(after_in_child=_after_fork_in_child)


def tids() -> list[int]:
    """This process's watch threads' ids, started on the first call in each process."""
    global _pid, _tids
    with _lock:
        if _pid != os.getpid():
            _tids = tuple(_start(i) for i in range(COUNT))
            _pid = os.getpid()
        return list(_tids)


def _start(i: int) -> int:
    ready = threading.Event()
    box: list[int] = []
    never = threading.Lock()
    never.acquire()

    def run() -> None:
        box.append(threading.get_native_id())
        ready.set()
        never.acquire()  # released by no one: the thread ends with its process

    threading.Thread(target=run, name=f"a2ad-watch-{i}", daemon=True).start()
    if not ready.wait(10.0):
        raise RuntimeError("a2ad: a watch thread did not start within 10 s")
    return box[0]
