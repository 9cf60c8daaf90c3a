"""systemd integration without any systemd Python package.

- ``notify(state, fds=None)``: the sd_notify protocol. One datagram to ``$NOTIFY_SOCKET``
  (a filesystem path, or an abstract-namespace name when it starts with ``@``), optionally
  carrying file descriptors with SCM_RIGHTS (for ``FDSTORE=1``/``FDNAME=``). Every helper is
  a no-op returning False when ``$NOTIFY_SOCKET`` is unset, i.e. outside systemd.
- ``Notifier``: what the daemon holds. It sends READY/STATUS/STOPPING, pets the watchdog
  every half interval from the daemon's own poll loop (so a wedged loop stops petting and
  systemd restarts the unit), and keeps STATUS= in step with the daemon's jobs.
- ``journal_stream()`` / ``log_format()``: whether stderr is connected to journald, and a
  log format suited to it (no timestamp, which journald adds; a ``<N>`` priority prefix,
  which journald turns into the entry's priority).
"""

from __future__ import annotations

import array
import logging
import os
import socket
import time

log = logging.getLogger("a2ad")

#: Seconds a notification may block on a full notify socket before it is given up. The
#: daemon's periodic messages (WATCHDOG=1, STATUS=) use 0: never block the poll loop.
SEND_TIMEOUT = 2.0


def _address(value: str) -> str | bytes | None:
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None  # vsock: and other families are not supported here


def notify(state: str, fds: list[int] | None = None, timeout: float = SEND_TIMEOUT) -> bool:
    """Send ``state`` (newline-separated ``KEY=VALUE`` assignments) to the service manager,
    with ``fds`` attached (SCM_RIGHTS) when given.

    Returns True when the datagram was sent, False when there is no notify socket or the
    send failed, including when the socket's queue stayed full for ``timeout`` seconds
    (0: do not wait at all). Failures are logged at debug level; it never raises."""
    value = os.environ.get("NOTIFY_SOCKET")
    if not value:
        return False
    addr = _address(value)
    if addr is None:
        log.debug("sd_notify: unsupported NOTIFY_SOCKET %r", value)
        return False
    ancillary = []
    if fds:
        ancillary.append((socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes()))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            if timeout > 0:
                sock.settimeout(timeout)
            else:
                sock.setblocking(False)
            sock.sendmsg([state.encode()], ancillary, 0, addr)
        return True
    except OSError as exc:
        log.debug("sd_notify %r to %r failed: %s", state.split("\n", 1)[0], value, exc)
        return False


def ready(status_text: str | None = None) -> bool:
    return notify("READY=1" + (f"\nSTATUS={_one_line(status_text)}" if status_text else ""))


def status(text: str) -> bool:
    return notify(f"STATUS={_one_line(text)}")


def watchdog() -> bool:
    return notify("WATCHDOG=1")


def stopping(status_text: str | None = None) -> bool:
    return notify("STOPPING=1" + (f"\nSTATUS={_one_line(status_text)}" if status_text else ""))


def watchdog_interval() -> float | None:
    """The watchdog timeout in seconds that systemd asks this process to honour, or None.

    Read from ``$WATCHDOG_USEC``; when ``$WATCHDOG_PID`` is set it must name this process
    (otherwise the variables were inherited and are meant for a parent)."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    try:
        n = int(usec)
    except ValueError:
        return None
    return n / 1e6 if n > 0 else None


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def summary(daemon) -> str:
    """The STATUS= line for a daemon: 'N jobs, M ranks attached, K dead[, draining]'."""
    from a2ad import layout as L

    attached = dead = 0
    for job in daemon.jobs.values():
        for slot in job.slots:
            if slot.state == L.RANK_ATTACHED:
                attached += 1
            elif slot.state == L.RANK_DEAD:
                dead += 1
    n = len(daemon.jobs)
    text = f"{n} job{'' if n == 1 else 's'}, {attached} rank{'' if attached == 1 else 's'} attached, {dead} dead"
    return text + (", draining" if daemon.draining else "")


class Notifier:
    """The daemon's link to systemd. Everything is a cheap no-op outside systemd."""

    def __init__(self):
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        interval = watchdog_interval() if self.enabled else None
        #: seconds between WATCHDOG=1 pings (half of systemd's timeout), or None
        self.watchdog_every = interval / 2 if interval else None
        self._next_watchdog = 0.0
        self._status: str | None = None

    def ready(self, daemon) -> None:
        if not self.enabled:
            return
        self._status = summary(daemon)
        ready(self._status)
        self._pet(time.monotonic())

    def poll_timeout_ms(self, timeout_ms: int) -> int:
        """``timeout_ms`` shortened so that the loop wakes when the next ping is due."""
        if self.watchdog_every is None:
            return timeout_ms
        due = int((self._next_watchdog - time.monotonic()) * 1000) + 1
        return max(0, min(timeout_ms, due))

    def tick(self, daemon) -> None:
        """Once per loop iteration: ping the watchdog when due, update STATUS= when it changed."""
        if not self.enabled:
            return
        now = time.monotonic()
        if self.watchdog_every is not None and now >= self._next_watchdog:
            self._pet(now)
        text = summary(daemon)
        if text != self._status and notify(f"STATUS={text}", timeout=0):
            self._status = text  # not sent (queue full): tried again next iteration

    def stopping(self, daemon=None) -> None:
        if self.enabled:
            stopping(f"stopping: {summary(daemon)}" if daemon is not None else None)

    def _pet(self, now: float) -> None:
        if self.watchdog_every is not None:
            # never blocks; a ping lost to a full queue is followed by the next one, half
            # a timeout later, so one loss alone does not trip the watchdog
            notify("WATCHDOG=1", timeout=0)
            self._next_watchdog = now + self.watchdog_every


# ------------------------------------------------------------------ journald
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def journal_stream() -> bool:
    """True when stderr is the journal stream systemd connected (``$JOURNAL_STREAM``
    names stderr's device and inode), so journald already stamps every line."""
    value = os.environ.get("JOURNAL_STREAM")
    if not value:
        return False
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(2)
    except (ValueError, OSError):
        return False
    return st.st_dev == dev and st.st_ino == ino


class JournalFormatter(logging.Formatter):
    """``<priority>message``: journald strips the prefix into the entry's PRIORITY and adds
    the timestamp, the unit and the pid itself."""

    def format(self, record: logging.LogRecord) -> str:
        prio = _PRIORITY.get(record.levelno, 6 if record.levelno < logging.WARNING else 3)
        return f"<{prio}>" + super().format(record)


def log_handler(stream) -> logging.Handler:
    """A stderr handler: journald-friendly under systemd, timestamped otherwise."""
    handler = logging.StreamHandler(stream)
    if journal_stream():
        handler.setFormatter(JournalFormatter("%(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s a2ad[%(process)d] %(levelname)s %(message)s"))
    return handler
