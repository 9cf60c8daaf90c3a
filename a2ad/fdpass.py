"""File descriptors over AF_UNIX stream sockets (SCM_RIGHTS), with length-prefixed
msgpack frames (a2ad.protocol). No CUDA, no ZeroMQ: testable anywhere.

Two layers:

- ``send_frame`` / ``recv_frame``: one frame, with at most ``MAX_FDS`` fds riding along.
- ``send_frame_fds`` / ``recv_frame_fds``: one frame with any number of fds: the frame
  (its ``nfds`` key says how many in all) carries the first ``MAX_FDS``, and each
  continuation frame ``{"v", "more_fds": k}`` the next k (at most ``MAX_FDS``). The fd
  socket's answer to a ticket uses it: a job of ep_size ranks passes ep_size + 1 fds.
- ``send_named_fds`` / ``recv_named_fds``: any number of named fds, as a run of frames
  (``BATCH_FDS`` fds and at most ``protocol.FD_FRAME_MAX`` bytes each). Each frame is
  ``{"names": [...], "more": bool, "total": N, ...}`` with exactly ``len(names)`` fds; the
  last frame has ``more`` false. The fd keeper's ``get`` reply and the upgrade handover
  use this format.
"""

from __future__ import annotations

import os
import socket
import struct
import time

import msgpack

from . import errors, protocol

#: Most fds one received frame may carry (the receive buffer is sized for this many; the
#: kernel's own cap per message is 253, SCM_MAX_FD).
MAX_FDS = 128
#: Fds per frame in a named-fd transfer (well under MAX_FDS and SCM_MAX_FD).
BATCH_FDS = 64
#: Longest name (UTF-8 bytes) a named-fd transfer accepts.
MAX_NAME_BYTES = 1024
_HDR = 4
#: Bytes of a batch frame kept for its keys other than the names.
_BATCH_OVERHEAD = 512


class FdTransferError(errors.ProtocolError):
    """A named-fd transfer failed: malformed frames, a mismatch, or a bad name. Every fd
    received so far has been closed."""


class FdTransferTimeout(FdTransferError, TimeoutError):
    """A named-fd transfer did not complete in time."""


class FdTransferClosed(FdTransferError, ConnectionError):
    """The other end closed (or reset) the socket during a named-fd transfer."""


def send_frame(sock: socket.socket, obj, fds: list[int] | None = None, timeout: float | None = None) -> None:
    """Send one frame; ``fds`` ride along with its first byte. ``timeout``: seconds the whole
    send may block (None: leave the socket's own timeout as it is)."""
    data = protocol.frame_fd_message(obj)
    if timeout is not None:
        sock.settimeout(max(timeout, 1e-3))
    sent = socket.send_fds(sock, [data], fds) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def send_frame_fds(sock: socket.socket, obj: dict, fds: list[int], timeout: float | None = None) -> None:
    """Send ``obj`` (which must say ``nfds == len(fds)``) with all of ``fds``: the first
    MAX_FDS with the frame itself, the rest in continuation frames of at most MAX_FDS."""
    if obj.get("nfds") != len(fds):
        raise ValueError(f"the frame must announce nfds={len(fds)}")
    send_frame(sock, obj, fds[:MAX_FDS], timeout)
    for i in range(MAX_FDS, len(fds), MAX_FDS):
        chunk = fds[i : i + MAX_FDS]
        send_frame(sock, {"v": protocol.PROTOCOL_VERSION, "more_fds": len(chunk)}, chunk, timeout)


def recv_frame_fds(sock: socket.socket, timeout: float) -> tuple[object, list[int]]:
    """Receive a frame sent by :func:`send_frame_fds` and every fd it announced (``nfds``; a
    frame without it, such as a refusal, comes alone). The caller owns the fds; on any error
    the fds received so far are closed. ProtocolError for a continuation that does not match."""
    deadline = time.monotonic() + timeout
    obj, fds = recv_frame(sock, timeout)
    try:
        total = obj.get("nfds") if isinstance(obj, dict) else None
        if not isinstance(total, int) or isinstance(total, bool) or total <= len(fds):
            return obj, fds
        while len(fds) < total:
            more, got = recv_frame(sock, max(1e-3, deadline - time.monotonic()))
            fds.extend(got)
            if not isinstance(more, dict) or more.get("more_fds") != len(got) or not got:
                raise errors.ProtocolError(
                    f"expected a continuation frame carrying the next of {total} fds, got {more!r:.100} with {len(got)}")
        return obj, fds
    except BaseException:
        close_all(fds)
        raise


def _recv_exact(sock: socket.socket, n: int, fds: list[int], deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out reading from the fd socket")
        sock.settimeout(remaining)
        data, got, flags, _ = socket.recv_fds(sock, n - len(buf), MAX_FDS, socket.MSG_CMSG_CLOEXEC)
        fds.extend(got)
        for fd in got:  # some Pythons' recv_fds drop the flags (MSG_CMSG_CLOEXEC): mark them here
            os.set_inheritable(fd, False)
        if flags & socket.MSG_CTRUNC:
            raise errors.ProtocolError("file descriptors were truncated in transit")
        if not data:
            raise ConnectionError("the fd socket closed mid-frame")
        buf += data
    return bytes(buf)


def recv_frame(sock: socket.socket, timeout: float) -> tuple[object, list[int]]:
    """Receive one frame and any fds sent with it. The caller owns the fds; on any error
    the fds received so far are closed."""
    deadline = time.monotonic() + timeout
    fds: list[int] = []
    try:
        header = _recv_exact(sock, _HDR, fds, deadline)
        n = protocol.fd_frame_length(header)
        body = _recv_exact(sock, n, fds, deadline)
        return protocol.unpack(body), fds
    except BaseException:
        close_all(fds)
        raise


# --------------------------------------------------------------------------- named fds
def _packed_len(obj) -> int:
    return len(msgpack.packb(obj, use_bin_type=True))


def batches(names: list[str], max_fds: int = BATCH_FDS, max_bytes: int = protocol.FD_FRAME_MAX - _BATCH_OVERHEAD):
    """Split ``names`` into consecutive runs of at most ``max_fds`` names whose packed size
    stays under ``max_bytes``. Raises FdTransferError for a name that is not a str or is
    longer than MAX_NAME_BYTES."""
    out: list[list[str]] = []
    cur: list[str] = []
    size = 0
    for name in names:
        if not isinstance(name, str):
            raise FdTransferError(f"fd name {name!r} is not a string")
        try:
            nbytes = len(name.encode("utf-8"))
        except UnicodeEncodeError:
            raise FdTransferError(f"fd name {name!r} is not valid UTF-8 text") from None
        if nbytes > MAX_NAME_BYTES:
            raise FdTransferError(f"fd name of {nbytes} bytes exceeds {MAX_NAME_BYTES}")
        n = _packed_len(name)
        if cur and (len(cur) >= max_fds or size + n > max_bytes):
            out.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += n
    if cur:
        out.append(cur)
    return out


def send_named_fds(sock: socket.socket, fds: dict[str, int], timeout: float, extra: dict | None = None) -> None:
    """Send every fd of ``fds`` (name -> fd; the caller keeps ownership) over the connected
    AF_UNIX stream ``sock`` as a run of batch frames. ``extra``: small keys added to every
    frame (the keeper adds ``ok``). The whole send is bounded by ``timeout`` seconds.

    Raises FdTransferTimeout, FdTransferClosed (the peer went away) or FdTransferError."""
    if extra is not None and _packed_len(extra) > _BATCH_OVERHEAD // 2:
        raise ValueError("extra keys too large for a batch frame")
    names = list(fds)
    runs = batches(names) or [[]]
    total = len(names)
    deadline = time.monotonic() + timeout
    old_timeout = sock.gettimeout()
    try:
        for i, run in enumerate(runs):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FdTransferTimeout(f"sending {total} fds timed out after batch {i} of {len(runs)}")
            frame = dict(extra or {})
            frame.update({"names": run, "more": i + 1 < len(runs), "total": total})
            try:
                send_frame(sock, frame, [fds[n] for n in run], timeout=remaining)
            except TimeoutError as exc:  # socket.timeout is TimeoutError
                raise FdTransferTimeout(f"sending {total} fds timed out at batch {i + 1} of {len(runs)}") from exc
            except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as exc:
                raise FdTransferClosed(f"the peer closed the socket while {total} fds were being sent: {exc}") from exc
            except OSError as exc:
                raise FdTransferError(f"sending fds failed: {exc}") from exc
    finally:
        _restore_timeout(sock, old_timeout)


def recv_named_fds(sock: socket.socket, timeout: float) -> dict[str, int]:
    """Receive a run of batch frames sent by ``send_named_fds``; returns name -> fd (the
    caller owns the fds, which are close-on-exec). Bounded by ``timeout`` seconds in all.

    A frame ``{"ok": false, "message": ...}`` (the keeper's refusal) raises FdTransferError.
    On any failure every fd received so far is closed and FdTransferTimeout,
    FdTransferClosed or FdTransferError is raised."""
    deadline = time.monotonic() + timeout
    out: dict[str, int] = {}
    total: int | None = None
    old_timeout = sock.gettimeout()
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FdTransferTimeout(f"timed out receiving fds ({len(out)} so far)")
            try:
                obj, fds = recv_frame(sock, remaining)
            except TimeoutError as exc:
                raise FdTransferTimeout(f"timed out receiving fds ({len(out)} so far)") from exc
            except ConnectionError as exc:
                raise FdTransferClosed(f"the peer closed the socket after {len(out)} fds: {exc}") from exc
            except errors.A2ADError as exc:
                raise FdTransferError(f"bad fd batch frame: {exc.message}") from exc
            except OSError as exc:
                raise FdTransferError(f"receiving fds failed: {exc}") from exc
            try:
                more, total = _check_batch(obj, fds, out, total)
            except BaseException:
                close_all(fds)
                raise
            out.update(zip(obj["names"], fds))
            if not more:
                break
        if len(out) != total:
            raise FdTransferError(f"received {len(out)} fds, the sender announced {total}")
        return out
    except BaseException:
        close_all(out.values())
        raise
    finally:
        _restore_timeout(sock, old_timeout)


def _check_batch(obj, fds: list[int], seen: dict, total: int | None) -> tuple[bool, int]:
    if not isinstance(obj, dict):
        raise FdTransferError("fd batch frame is not a map")
    if obj.get("ok") is False:
        raise FdTransferError(f"the sender refused: {obj.get('message', 'no reason given')}")
    names = obj.get("names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise FdTransferError("fd batch frame has no list of names")
    if len(names) != len(fds):
        raise FdTransferError(f"fd batch frame names {len(names)} fds but carries {len(fds)}")
    if len(set(names)) != len(names) or any(n in seen for n in names):
        raise FdTransferError("fd batch frames repeat a name")
    more = obj.get("more", False)
    if not isinstance(more, bool):
        raise FdTransferError("fd batch frame: 'more' is not a bool")
    announced = obj.get("total", None)
    if announced is None and total is None and not more:
        announced = len(names)  # a single frame from a sender that does not count (an older keeper)
    if not isinstance(announced, int) or isinstance(announced, bool) or announced < 0:
        raise FdTransferError("fd batch frame: 'total' is not a count")
    if total is not None and announced != total:
        raise FdTransferError(f"fd batch frames announce {total} then {announced} fds")
    if len(seen) + len(names) > announced:
        raise FdTransferError(f"more fds arrived than the {announced} announced")
    return more, announced


def _restore_timeout(sock: socket.socket, value) -> None:
    try:
        sock.settimeout(value)
    except OSError:
        pass


def close_all(fds) -> None:
    for fd in list(fds):
        _close(fd)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)
