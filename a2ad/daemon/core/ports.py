"""What the core acts through, and nothing else: the seams between the daemon's decisions and
the machine.

The core (this package) decides; it reads no clock and opens no socket, file or process
handle. Time comes with every event (``Registry.now``, ``Federation`` calls take ``now``),
and whatever touches the machine goes through one of these:

- ``Host``: the process table and file descriptors (pidfds on rank processes, closing fds,
  control blocks in shared memory). ``a2ad.daemon.hostio.RealHost`` is the daemon's; the
  simulator's stands in for it with a process table of its own.
- the memory backend (``a2ad.daemon.backends.base.Backend``): a rank's row. The simulator
  uses the real host backend's interface over memory of its own.
- the fd store (``put``/``drop`` by name): the keeper's copies of the fds across restarts.
- the domain bus (``send``/``send_many``/``broadcast``, ``state(node)``, ``boot``): messages to
  other nodes' daemons.

Replies, lease connections to close and the state to persist leave as effects: the registry's
``outbox``, ``closing`` and ``dirty``.
"""

from __future__ import annotations

from typing import Protocol


class Host(Protocol):
    #: this machine's short host name (a daemon's node name outside a domain)
    hostname: str
    #: descriptors a control block keeps open while the daemon holds it (its fd, and any
    #: its mapping keeps): what a job's block costs against the per-uid fd cap
    control_block_fds: int

    def open_pidfd(self, pid: int) -> int | None:
        """A handle that reports ``pid``'s death (``pid_exited`` is called with it). Raises
        ProcessLookupError when no such process runs; None where deaths cannot be watched."""

    def open_thread_pidfd(self, pid: int, tid: int) -> int | None:
        """A handle that reports the end of thread ``tid`` of process ``pid`` (``pid_exited``
        is called with it); None when ``tid`` is not a thread of ``pid`` or threads cannot be
        watched (a kernel older than 6.9)."""

    def token(self, n: int) -> bytes:
        """``n`` unpredictable bytes (tickets, leases, attempt ids)."""

    def close_fd(self, fd: int) -> None:
        """Give back a descriptor the core held (a pidfd, a row's or a control block's fd)."""

    def alive(self, pid: int) -> bool:
        """Whether ``pid`` runs (and is not a zombie)."""

    def new_control_block(self, ep_size: int, policy: int):
        """A fresh control block for a new job: ``(fd, ControlBlock)``."""

    def adopt_control_block(self, fd: int, job: str):
        """The kept control block ``fd`` of ``job`` mapped again (after a restart): a
        ControlBlock; raises BackendError when it cannot be adopted."""


class Store(Protocol):
    def put(self, name: str, fd: int) -> None: ...

    def drop(self, name: str) -> None: ...
