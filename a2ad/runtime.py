"""The runtime directory: where the daemon's sockets, lock and state live."""

from __future__ import annotations

import errno
import fcntl
import grp
import os
import socket
import stat
import struct
import tempfile
import time
from pathlib import Path

from a2ad import errors

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


# ------------------------------------------------------------------ client-side trust
#: the system user a packaged daemon runs as; its uid is trusted when it exists
DAEMON_USER = "a2ad"
#: names one more uid to trust as the daemon's (a daemon run under another service account)
DAEMON_UID_ENV = "A2AD_DAEMON_UID"


def daemon_uids() -> set[int]:
    """The uids a daemon may run as besides root and the caller: the system user ``a2ad``
    when it exists, and ``$A2AD_DAEMON_UID`` when set."""
    import pwd

    uids = set()
    try:
        uids.add(pwd.getpwnam(DAEMON_USER).pw_uid)
    except KeyError:
        pass
    env = os.environ.get(DAEMON_UID_ENV, "").strip()
    if env:
        try:
            uids.add(int(env))
        except ValueError:
            raise errors.InvalidField(f"${DAEMON_UID_ENV} must be a numeric uid, not {env!r}") from None
    return uids


def trusted_uids(extra=()) -> set[int]:
    """Whom a client trusts to own its runtime folder and to run its daemon: itself, root,
    the daemon's uid (:func:`daemon_uids`) and ``extra``."""
    return {os.getuid(), os.geteuid(), 0} | daemon_uids() | {int(u) for u in extra}


def _owner(uid: int) -> str:
    import pwd

    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


_HOW = (
    "a client only uses a runtime folder owned by itself, root or the daemon's user "
    f"(the system user {DAEMON_USER!r}, or ${DAEMON_UID_ENV}) that no one else may write to; "
    "remove or fix that folder, or point --runtime-dir / $A2AD_RUNTIME_DIR at the folder your daemon serves"
)


def check_trusted(path: str | os.PathLike, extra_uids=()) -> None:
    """Raise :class:`a2ad.errors.PermissionDenied` unless ``path`` is a folder a client may
    trust: someone who controls the folder controls the sockets in it, hence which process
    the client hands its requests to and whose memory it maps.

    The rules:

    - the folder (symlinks followed) is owned by a trusted uid (:func:`trusted_uids`) and
      has no group or other write bit, whoever owns it: a sticky, tmp-style folder is refused
      too, since anyone may create the sockets there first;
    - a symlink on the way is owned by a trusted uid (others could re-point it later);
    - every folder above it is owned by a trusted uid and, if group or others may write to
      it, has the sticky bit (``/tmp``), so that nobody else can rename the folder away and
      put another in its place.

    A missing folder raises FileNotFoundError."""
    trusted = trusted_uids(extra_uids)
    given = Path(os.path.abspath(path))
    real = Path(os.path.realpath(given))
    st = os.stat(real)
    where = str(given) if real == given else f"{given} (-> {real})"
    if not stat.S_ISDIR(st.st_mode):
        raise errors.PermissionDenied(f"runtime folder {where} is not a folder", path=str(given))
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in trusted:
        raise errors.PermissionDenied(
            f"refusing the runtime folder {where}: it is owned by {_owner(st.st_uid)} (mode {mode:04o}), "
            f"who could run a daemon there and read your workspaces; {_HOW}",
            path=str(given), owner=st.st_uid, mode=oct(mode),
        )
    if mode & 0o022:
        raise errors.PermissionDenied(
            f"refusing the runtime folder {where}: mode {mode:04o} (owner {_owner(st.st_uid)}) lets "
            f"{'other users' if mode & 0o002 else 'group members'} replace its sockets; {_HOW} "
            "(`a2ad serve` makes it 0700, or 0750 with --group)",
            path=str(given), owner=st.st_uid, mode=oct(mode),
        )
    # symlinks on the given path
    probe = Path(given.anchor)
    for part in given.parts[1:]:
        probe = probe / part
        try:
            lst = os.lstat(probe)
        except OSError:
            break
        if stat.S_ISLNK(lst.st_mode) and lst.st_uid not in trusted:
            raise errors.PermissionDenied(
                f"refusing the runtime folder {where}: the symlink {probe} is owned by {_owner(lst.st_uid)}; {_HOW}",
                path=str(given), owner=lst.st_uid,
            )
        if stat.S_ISLNK(lst.st_mode):
            probe = Path(os.path.realpath(probe))
    # the folders above it
    for parent in real.parents:
        pst = os.stat(parent)
        pmode = stat.S_IMODE(pst.st_mode)
        if pst.st_uid not in trusted or (pmode & 0o022 and not pmode & stat.S_ISVTX):
            raise errors.PermissionDenied(
                f"refusing the runtime folder {where}: the folder above it, {parent} (owner "
                f"{_owner(pst.st_uid)}, mode {pmode:04o}), lets someone else replace it; {_HOW}",
                path=str(given), owner=pst.st_uid, mode=oct(pmode),
            )


def _peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    fmt = "3i"
    pid, uid, gid = struct.unpack(fmt, sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(fmt)))
    return pid, uid, gid


def probe_daemon(runtime_dir: str | os.PathLike, extra_uids=(), busy_wait: float = 1.0) -> tuple[int, int, int]:
    """Connect to ``fd.sock`` once (non-blocking) and close at once: is a daemon listening, and
    is it one we trust? Returns the listener's (pid, uid, gid).

    Raises :class:`a2ad.errors.DaemonUnavailable` when no process listens there (a stale
    socket left by a daemon that died) or the listener's backlog stays full for
    ``busy_wait`` seconds, and :class:`a2ad.errors.PermissionDenied` when the socket may not
    be opened or the listening process runs as a uid we do not trust (SO_PEERCRED gives the
    credentials of the process that called listen())."""
    rd = Path(runtime_dir)
    path = rd / FD_SOCK
    end = time.monotonic() + busy_wait
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            try:
                s.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError) as exc:
                why = "connection refused" if isinstance(exc, ConnectionRefusedError) else f"{FD_SOCK} is missing"
                raise errors.DaemonUnavailable(
                    f"stale a2ad socket in {rd}: no daemon is listening ({why}); the daemon that made it "
                    f"likely died (see its log, or `journalctl -u a2ad`); start one with "
                    f"`a2ad serve --runtime-dir {rd}`",
                    runtime_dir=str(rd), stale=True,
                ) from None
            except PermissionError:
                raise errors.PermissionDenied(
                    f"may not connect to {path}: the daemon there serves its own user only (or the members "
                    "of its --group); ask its admin for access",
                    runtime_dir=str(rd),
                ) from None
            except BlockingIOError:
                if time.monotonic() >= end:
                    raise errors.DaemonUnavailable(
                        f"the daemon at {rd} accepts no connections (its backlog stayed full for {busy_wait:g} s)",
                        runtime_dir=str(rd),
                    ) from None
                time.sleep(0.01)
                continue
            pid, uid, gid = _peer_credentials(s)
        finally:
            s.close()
        if uid not in trusted_uids(extra_uids):
            raise errors.PermissionDenied(
                f"refusing the daemon at {rd}: it runs as {_owner(uid)} (pid {pid}), which is not you, root "
                f"or the daemon's user (the system user {DAEMON_USER!r}, or ${DAEMON_UID_ENV}); "
                "it could read your workspaces. Stop using that folder, or set "
                f"${DAEMON_UID_ENV}={uid} if that daemon is the one you mean to use",
                runtime_dir=str(rd), pid=pid, uid=uid,
            )
        return pid, uid, gid


class RuntimeDirError(Exception):
    pass


def prepare(runtime_dir: Path, group: str | None = None) -> int | None:
    """Create the folder with mode 0700 (0750 and the group when ``group`` is given), or take
    an existing one that this daemon may trust. Returns the group id or None.

    An existing folder (and a symlink naming it) must be owned by this daemon's uid or root.
    Whoever could write to it before the daemon started may have planted its lock, state or
    keeper socket (a symlink the daemon would write through, a keeper it would hand every
    workspace to); so a folder that group members or others may write to is closed first
    (its mode set) and then taken only if it holds nothing at all, as a fresh volume does;
    one that holds anything is refused with RuntimeDirError naming what it holds."""
    gid = None
    if group is not None:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise RuntimeDirError(f"group {group!r} does not exist") from None
    mode = 0o750 if gid is not None else 0o700
    me = os.geteuid()
    try:
        lst = os.lstat(runtime_dir)
    except FileNotFoundError:
        lst = None
    if lst is not None and stat.S_ISLNK(lst.st_mode) and lst.st_uid not in (me, 0):
        raise RuntimeDirError(f"refusing the runtime folder {runtime_dir}: it is a symlink owned by {_owner(lst.st_uid)}, "
                              f"who could point it elsewhere; remove it or use another --runtime-dir")
    if lst is None:
        runtime_dir.mkdir(parents=True, exist_ok=True, mode=mode)
    st = os.stat(runtime_dir)
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(f"refusing the runtime folder {runtime_dir}: it is not a folder")
    if st.st_uid not in (me, 0):
        raise RuntimeDirError(f"refusing the runtime folder {runtime_dir}: it is owned by {_owner(st.st_uid)}, not by "
                              f"this daemon's uid {me} or root; remove it or use another --runtime-dir")
    cur = stat.S_IMODE(st.st_mode)
    if cur != mode:
        try:
            os.chmod(runtime_dir, mode)  # closed before it is looked into: nobody else adds to it now
        except PermissionError:
            raise RuntimeDirError(f"{runtime_dir} is owned by uid {st.st_uid}, not by this daemon's uid {me}, and "
                                  f"its mode {cur:04o} cannot be set to {mode:04o}; chown it to uid {me}") from None
    if lst is not None and cur & 0o022:
        held = sorted(os.listdir(runtime_dir))
        if held:
            who = "other users" if cur & 0o002 else "its group's members"
            shown = ", ".join(held[:8]) + (f" and {len(held) - 8} more" if len(held) > 8 else "")
            raise RuntimeDirError(
                f"refusing the runtime folder {runtime_dir}: its mode was {cur:04o}, which let {who} write to it, "
                f"and it holds {shown}, which they may have planted (a lock symlink, a keeper socket); it is "
                f"{mode:04o} now: check what it holds and remove it, or use another --runtime-dir")
    if gid is not None and st.st_gid != gid:
        os.chown(runtime_dir, -1, gid)
    return gid


def open_private(path: Path, flags: int, mode: int = 0o600) -> int:
    """Open a file of the runtime folder without following a symlink (O_NOFOLLOW), and check
    that it is a plain file of this process's uid with one link (not a hard link to a file
    elsewhere). Raises RuntimeDirError naming the file otherwise."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RuntimeDirError(f"{path} is a symlink; the daemon never follows links in its runtime folder "
                                  "(someone planted it?): remove it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            what = ("not a plain file" if not stat.S_ISREG(st.st_mode) else
                    f"owned by {_owner(st.st_uid)}" if st.st_uid != os.geteuid() else f"a hard link ({st.st_nlink} names)")
            raise RuntimeDirError(f"{path} is {what}; the daemon only uses files of its own there (someone planted "
                                  "it?): remove it")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Lock:
    """An exclusive flock on the runtime folder's lock file, held for the daemon's life.

    A second daemon on the same folder would otherwise re-bind the ipc endpoint and
    silently steal it from the first."""

    def __init__(self, runtime_dir: Path):
        self.path = runtime_dir / LOCK_FILE
        self.fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
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
