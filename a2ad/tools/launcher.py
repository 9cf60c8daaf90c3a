"""Start and stop an ``a2ad serve`` child process: the one launcher behind ``a2ad demo``,
``a2ad-bench`` and the tests.

- The daemon runs through :func:`a2ad.runtime.python_command`, so it is this very a2ad
  package whatever the current folder holds.
- :meth:`DaemonLauncher.start` returns once the daemon answers ``hello``, or raises
  :class:`LaunchError` with the tail of its log within ``timeout`` (having stopped it).
- :meth:`DaemonLauncher.stop` sends SIGTERM, then SIGKILL after a bound, and asks the fd
  keeper a daemon may leave behind to exit (:func:`reap_keeper`).
- The log goes where the caller says (``log_path``, left in place), else to a temp folder
  that ``stop`` removes unless ``keep_log`` is set.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path

from a2ad import runtime

KEEPER_SOCK = "keeper.sock"


class LaunchError(RuntimeError):
    """The daemon exited or did not answer in time; the message holds the end of its log."""


def reap_keeper(runtime_dir: str | os.PathLike, timeout: float = 5.0) -> bool:
    """Ask the fd keeper serving ``runtime_dir`` (if any) to exit; True when one answered."""
    from a2ad import fdpass

    path = Path(runtime_dir) / KEEPER_SOCK
    if not path.exists():
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout)
        s.connect(str(path))
        fdpass.send_frame(s, {"op": "exit"})
        fdpass.recv_frame(s, timeout=timeout)
        return True
    except OSError:
        return False
    finally:
        s.close()


class DaemonLauncher:
    """One ``a2ad serve --runtime-dir RUNTIME_DIR *serve_args`` child process.

    ``log_path``: where its stdout and stderr go (appended; left in place). Without it the
    log goes to a fresh temp folder removed by :meth:`stop` unless ``keep_log``.
    ``env``: the child's environment (default: ours), PYTHONUNBUFFERED set either way.
    ``argv``: run this instead of ``a2ad serve`` (tests that wrap the daemon).
    ``trust_uids``: uids the readiness check trusts besides the usual ones (a daemon this
    launcher started as another user)."""

    def __init__(self, runtime_dir: str | os.PathLike, *serve_args: str, log_path: str | os.PathLike | None = None,
                 keep_log: bool = False, env: dict | None = None, cwd: str | os.PathLike | None = None,
                 argv: list[str] | None = None, trust_uids=()):
        self.runtime_dir = Path(runtime_dir)
        self.args = list(serve_args)
        self.keep_log = keep_log
        self.env = env
        self.cwd = cwd
        self.trust_uids = tuple(trust_uids)
        self._argv = argv
        self._log_dir: Path | None = None
        if log_path is None:
            log_path = self._new_log_dir() / "daemon.log"
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self.hello: dict | None = None
        #: how the daemon ended: "exited" (by itself), "sigterm", "sigkill" (SIGTERM was not
        #: enough within stop's bound) or "kill9" (:meth:`kill9`)
        self.stopped_by: str | None = None

    def _new_log_dir(self) -> Path:
        self._log_dir = Path(tempfile.mkdtemp(prefix="a2ad-log-"))
        if not self.keep_log:  # also when the launcher is dropped without a stop, or at exit
            weakref.finalize(self, shutil.rmtree, str(self._log_dir), True)
        return self._log_dir

    # ------------------------------------------------------------------ start
    def command(self) -> list[str]:
        if self._argv is not None:
            return list(self._argv)
        return runtime.python_command("a2ad.tools.cli", "serve", "--runtime-dir", str(self.runtime_dir), *self.args)

    def start(self, timeout: float = 30.0) -> "DaemonLauncher":
        if self.proc is not None and self.proc.poll() is None:
            raise LaunchError(f"the daemon (pid {self.proc.pid}) is already running")
        if self._log_dir is not None and not self._log_dir.exists():  # started again after a stop
            self.log_path = self._new_log_dir() / "daemon.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        env = dict(os.environ if self.env is None else self.env, PYTHONUNBUFFERED="1")
        log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log_fd,
                                         stderr=subprocess.STDOUT, env=env, cwd=self.cwd)
        finally:
            os.close(log_fd)
        self.stopped_by = None
        try:
            self.hello = self.wait_ready(timeout)
        except BaseException:
            self.stop(timeout=5.0)  # the error carries the log's tail
            raise
        return self

    def wait_ready(self, timeout: float) -> dict:
        """Poll ``hello`` until the daemon answers; LaunchError if it exits or stays silent."""
        from a2ad import errors
        from a2ad.connection import DaemonClient

        end = time.monotonic() + timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise LaunchError(f"the a2ad daemon exited with {rc} before answering; its log ends:\n"
                                  f"{self.log_tail()}")
            try:
                with DaemonClient(self.runtime_dir, timeout=0.5, trust_uids=self.trust_uids) as c:
                    return c.request("hello")
            except errors.DaemonUnavailable:
                pass
            if time.monotonic() >= end:
                raise LaunchError(f"the a2ad daemon (pid {self.proc.pid}) did not answer within {timeout:g} s"
                                  f"{_cpu_used(self.proc.pid)}; its log ends:\n{self.log_tail()}")
            time.sleep(0.05)

    # ------------------------------------------------------------------ state
    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except (FileNotFoundError, NotADirectoryError):
            return ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def client(self, timeout: float = 5.0):
        from a2ad.connection import DaemonClient

        return DaemonClient(self.runtime_dir, timeout=timeout, trust_uids=self.trust_uids)

    def request(self, rtype: str, **fields) -> dict:
        with self.client() as c:
            return c.request(rtype, **fields)

    # ------------------------------------------------------------------- stop
    def kill9(self) -> None:
        """SIGKILL the daemon and reap it; its fd keeper, if any, lives on (as in production)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
            self.stopped_by = "kill9"

    def stop(self, timeout: float = 10.0, remove_log: bool | None = None) -> int | None:
        """SIGTERM, SIGKILL if it is still there after ``timeout`` s, reap the fd keeper, remove
        the launcher's own log folder (unless keep_log / ``remove_log=False``). Returns the
        daemon's exit status (None if never started); ``stopped_by`` says how it ended."""
        rc = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.stopped_by = "sigterm"
                try:
                    self.proc.send_signal(signal.SIGTERM)
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.stopped_by = "sigkill"
                    self.proc.kill()
                    self.proc.wait(10)
            elif self.stopped_by is None:
                self.stopped_by = "exited"
            rc = self.proc.returncode
        reap_keeper(self.runtime_dir)
        if remove_log is None:
            remove_log = not self.keep_log
        if remove_log and self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
        return rc

    def __enter__(self) -> "DaemonLauncher":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _cpu_used(pid: int) -> str:
    """", having used N s of CPU" for a process (Linux), to tell a start starved of CPU (little
    used) from one stuck computing (much used); empty where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
        return (f", having used {ticks / os.sysconf('SC_CLK_TCK'):.2f} s of CPU (this machine's load average "
                f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    except (OSError, ValueError, IndexError):
        return ""
