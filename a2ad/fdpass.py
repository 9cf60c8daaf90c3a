"""File descriptors over AF_UNIX stream sockets (SCM_RIGHTS), with length-prefixed
msgpack frames (a2ad.protocol). No CUDA, no ZeroMQ: testable anywhere."""

from __future__ import annotations

import array
import socket
import struct
import time

from . import errors, protocol

MAX_FDS = 128
_HDR = 4


def send_frame(sock: socket.socket, obj, fds: list[int] | None = None) -> None:
    """Send one frame; ``fds`` ride along with its first byte."""
    data = protocol.frame_fd_message(obj)
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sent = sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def _recv_exact(sock: socket.socket, n: int, fds: list[int], deadline: float) -> bytes:
    buf = bytearray()
    fd_space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out reading from the fd socket")
        sock.settimeout(remaining)
        data, ancdata, flags, _ = sock.recvmsg(n - len(buf), fd_space)
        for level, ctype, cdata in ancdata:
            if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(cdata[: len(cdata) - (len(cdata) % arr.itemsize)])
                fds.extend(arr)
        if flags & socket.MSG_CTRUNC:
            for fd in fds:
                _close(fd)
            raise errors.ProtocolError("file descriptors were truncated in transit")
        if not data:
            raise ConnectionError("the fd socket closed mid-frame")
        buf += data
    return bytes(buf)


def recv_frame(sock: socket.socket, timeout: float) -> tuple[object, list[int]]:
    """Receive one frame and any fds sent with it. The caller owns the fds."""
    deadline = time.monotonic() + timeout
    fds: list[int] = []
    try:
        header = _recv_exact(sock, _HDR, fds, deadline)
        n = protocol.fd_frame_length(header)
        body = _recv_exact(sock, n, fds, deadline)
        return protocol.unpack(body), fds
    except BaseException:
        for fd in fds:
            _close(fd)
        raise


def _close(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)
