"""The daemon's open-file budget: how many fds it may spend on what, and what it does near
its limit.

Every workspace row, control block, lease connection, pidfd and ZeroMQ connection is an fd.
The daemon spends the fds it accepts or opens itself (fd.sock connections, pidfds, workspace
fds) only below a ceiling, and refuses the work that would cross it. What it cannot meter
before the fd is spent is libzmq's ``ctl.sock`` listener: libzmq accepts on its own thread
and aborts the whole process when ``accept()`` fails with EMFILE. So the fds between the
ceiling and the limit are kept for libzmq, and the daemon stops listening on ``ctl.sock``
well before libzmq could reach the limit. Untrusted network peers never reach this process's
fd table at all: the domain port is served by a gate process of its own (gate.py).

The figures scale with the limit ``L`` (the soft RLIMIT_NOFILE once raised to the hard one):

- ``slack = clamp(L // 4, 256, 2048)``: once a ``ctl.sock`` connection is numbered within
  ``slack`` of the limit (fds are numbered from the lowest free one, so its number says how
  many are open), the daemon stops listening on ``ctl.sock``; the slack is libzmq's room for
  the connections it accepts before the daemon's loop sees the first of them;
- ``reserve = slack + slack // 2``: what the daemon keeps for itself; a join that would use
  those fds is refused (``limit_exceeded``), an fd.sock connection landing there is closed;
- ``resume = 2 * slack``: ``ctl.sock`` is listened on again once fewer than ``L - resume``
  fds are open;
- ``ctl_total = (L - resume) // 2``: ctl.sock connections of non-admin uids, all of them
  together, past which a new one is shut down at once (per-uid caps do not bound a total);
- below ``minimum()`` (1024, or the fds needed at start plus ``resume`` plus room for work,
  whichever is more) the daemon refuses to start and says which limit it needs.
"""

from __future__ import annotations

import logging
import os
import resource

from a2ad import errors

log = logging.getLogger("a2ad")

#: The least open-file limit the daemon serves with.
MIN_NOFILE = 1024
#: fds the daemon takes at start besides the ones open before it (ZeroMQ contexts, sockets,
#: monitors, the keeper connection, the wake-up pair, the metrics listener).
STARTUP_FDS = 48
#: fds per domain peer: a link socket and its monitor pair, the TCP connection.
FDS_PER_PEER = 4
#: Room for work the daemon must have beyond its reserves to be worth starting.
WORK_MIN = 128


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft open-file limit to the hard one (every lease, pidfd and workspace is an
    fd); returns the limits now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft, hard


def count_fds() -> int:
    """How many fds this process has open (-1 when /proc cannot tell)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


class FdBudget:
    """The figures of the module doc for one open-file limit, and the checks that use them."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.slack = max(256, min(2048, self.limit // 4))
        self.reserve = self.slack + self.slack // 2
        self.resume = 2 * self.slack
        self.ctl_total = max(0, (self.limit - self.resume) // 2)
        #: refusals of work for want of fds (joins, allocations)
        self.refused = 0

    @property
    def ceiling(self) -> int:
        """fd numbers at or above this are never spent on work (the reserve)."""
        return self.limit - self.reserve

    @property
    def pause_at(self) -> int:
        """A ctl.sock connection numbered at or above this stops the listening."""
        return self.limit - self.slack

    def minimum(self, peers: int = 0, open_now: int | None = None) -> int:
        """The least limit this daemon can serve with: what is open now, what it takes at start
        (and per domain peer), the ctl.sock resume margin, and room for work."""
        now = count_fds() if open_now is None else open_now
        return max(MIN_NOFILE, max(now, 0) + STARTUP_FDS + FDS_PER_PEER * peers + self.resume + WORK_MIN)

    def check_startable(self, peers: int = 0) -> None:
        """Raise LimitExceeded naming the limit needed when this one is too low to serve."""
        need = self.minimum(peers)
        if self.limit < need:
            raise errors.LimitExceeded(
                f"the open-file limit is {self.limit}, too low to serve: this daemon needs at least {need} "
                f"(it keeps {self.reserve} fds in reserve and stops listening on ctl.sock within {self.slack} of "
                f"the limit); raise it (ulimit -n, or LimitNOFILE= in the unit; 65536 is a good value)",
                needed=need, limit=self.limit,
            )

    def charge(self, needed: int) -> None:
        """Refuse work that would take the daemon into its reserve (the fds it needs to keep
        serving everyone else come first)."""
        used = count_fds()
        if used < 0:
            return
        if used + needed > self.ceiling:
            self.refused += 1
            raise errors.LimitExceeded(
                f"the daemon has {used} of its {self.limit} file descriptors open and keeps the last {self.reserve}; "
                f"this request needs {needed} more (raise LimitNOFILE, or free jobs)",
                needed=needed, limit=self.limit,
            )

    def should_pause(self, fd: int) -> bool:
        return fd >= self.pause_at

    def may_resume(self) -> bool:
        n = count_fds()
        return 0 <= n < self.limit - self.resume

    def describe(self) -> dict:
        return {"open_files": self.limit, "fd_reserve": self.reserve, "ctl_pause_margin": self.slack,
                "ctl_resume_margin": self.resume, "ctl_connections_total": self.ctl_total}
