"""The runtime directory: where the daemon's sockets, lock and state live."""

from __future__ import annotations

import errno
import fcntl
import grp
import os
import tempfile
from pathlib import Path

CTL_SOCK = "ctl.sock"
FD_SOCK = "fd.sock"
LOCK_FILE = "a2ad.lock"
STATE_FILE = "state.msgpack"


def python_command(module: str, *args: str) -> list[str]:
    """The argv that runs ``python -m module args`` with this very a2ad package, whatever the
    current folder holds (``-m`` would put the current folder first on sys.path, so a folder
    holding another ``a2ad/`` would win). Used for every process a2ad starts itself."""
    import sys

    root = str(Path(__file__).resolve().parent.parent)
    code = (
        "import runpy, sys; sys.path[0] = " + repr(root) + "; "
        "sys.argv[0] = " + repr(module) + "; runpy.run_module(" + repr(module) + ", run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", code, *args]


def default_runtime_dir() -> Path:
    """``$A2AD_RUNTIME_DIR``, else ``/run/a2ad`` where writable or where a daemon serves
    (a group member can reach its sockets without write access to the folder), else
    ``$XDG_RUNTIME_DIR/a2ad``, else ``<tmp>/a2ad-<uid>``."""
    env = os.environ.get("A2AD_RUNTIME_DIR")
    if env:
        return Path(env)
    run = Path("/run/a2ad")
    if run.is_dir() and (os.access(run, os.W_OK | os.X_OK) or (run / CTL_SOCK).exists()):
        return run
    if not run.exists() and os.access("/run", os.W_OK | os.X_OK):
        return run
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "a2ad"
    return Path(tempfile.gettempdir()) / f"a2ad-{os.getuid()}"


def resolve(runtime_dir: str | os.PathLike | None) -> Path:
    return Path(runtime_dir) if runtime_dir else default_runtime_dir()


def ctl_endpoint(runtime_dir: Path) -> str:
    return f"ipc://{runtime_dir / CTL_SOCK}"


class RuntimeDirError(Exception):
    pass


def prepare(runtime_dir: Path, group: str | None = None) -> int | None:
    """Create the folder with mode 0700 (0750 and the group when ``group`` is given).
    Returns the group id or None."""
    gid = None
    if group is not None:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise RuntimeDirError(f"group {group!r} does not exist") from None
    mode = 0o750 if gid is not None else 0o700
    runtime_dir.mkdir(parents=True, exist_ok=True, mode=mode)
    st = runtime_dir.stat()
    if st.st_uid != os.getuid():
        raise RuntimeDirError(f"{runtime_dir} is owned by uid {st.st_uid}, not by this daemon's uid {os.getuid()}")
    os.chmod(runtime_dir, mode)
    if gid is not None:
        os.chown(runtime_dir, -1, gid)
    return gid


class Lock:
    """An exclusive flock on the runtime folder's lock file, held for the daemon's life.

    A second daemon on the same folder would otherwise re-bind the ipc endpoint and
    silently steal it from the first."""

    def __init__(self, runtime_dir: Path):
        self.path = runtime_dir / LOCK_FILE
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = ""
            try:
                holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip()
            except OSError:
                pass
            os.close(self.fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RuntimeDirError(
                    f"another a2ad daemon{' (pid ' + holder + ')' if holder else ''} is already serving "
                    f"{runtime_dir}; stop it or use another --runtime-dir"
                ) from None
            raise
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self, remove: bool = True) -> None:
        if self.fd is None:
            return
        if remove:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        os.close(self.fd)
        self.fd = None
