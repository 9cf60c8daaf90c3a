"""The companion fd socket (``fd.sock``): accept connections, read one ticket frame, hand the
redeemed fds over with SCM_RIGHTS, and keep the connection as the rank's lease until EOF.

A redeemed ticket's fds are not sent at once: the redeem is queued (``ready``) and the server
sends the turn's queue (``send_ready``) after writing the state file, which then holds the
rank as attached. A daemon killed in between comes back holding the rank for its process;
that process saw its connection end without an answer and joins again.

Nothing a client does here can stop the daemon: every error on a connection (a reset, a
broken pipe, garbage, a stall) ends that connection only; running out of fds on accept
sheds the newest connection instead of spinning or dying; handshakes are capped per uid.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time

from a2ad import errors, layout as L, protocol
from a2ad.daemon.auth import Peer
from a2ad.daemon.core.registry import Redeemed, Registry
from a2ad.fdpass import peer_credentials, send_frame_fds

log = logging.getLogger("a2ad")

#: Seconds a new connection has to present its ticket.
HANDSHAKE_TIMEOUT = 10.0
#: Default cap on one uid's fd.sock connections that have no lease yet: the ranks of the
#: largest job redeem their tickets all at once when its rendezvous completes, plus room.
DEFAULT_HANDSHAKES_PER_UID = L.MAX_EP_SIZE + 64


class FdConn:
    """One connection on fd.sock: first a ticket handshake, then (once fds are delivered)
    the rank's lease, which ends at EOF."""

    def __init__(self, sock: socket.socket, peer: Peer):
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.pid, self.uid, self.gid = peer.pid, peer.uid, peer.gid
        self.buf = bytearray()
        self.deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        self.lease = False
        #: the ticket was redeemed; its answer waits in FdSocket.ready
        self.redeemed = False

    def fileno(self) -> int:
        return self.fd


class FdSocket:
    def __init__(self, path: str, registry: Registry, max_handshakes_per_uid: int = DEFAULT_HANDSHAKES_PER_UID, backlog: int = 512,
                 fd_ceiling: int | None = None):
        self.registry = registry
        self.max_handshakes_per_uid = max_handshakes_per_uid
        #: an accepted connection whose fd number reaches this is shed at once: fds are
        #: numbered from the lowest free one, so that many are open, and the last ones are
        #: kept for what the daemon needs to go on serving (libzmq aborts on EMFILE)
        self.fd_ceiling = fd_ceiling
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self.listener.bind(path)
            self.listener.listen(backlog)
        except BaseException:
            self.listener.close()
            raise
        self.listener.setblocking(False)
        self.conns: dict[int, FdConn] = {}
        #: redeems whose answers go out at the end of the server's turn (``send_ready``)
        self.ready: list[tuple[FdConn, Redeemed]] = []
        #: one spare fd, given up to accept-and-close a connection when the process is out of fds
        self._spare: int | None = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self.shed = 0
        self.refused = 0

    def fileno(self) -> int:
        return self.listener.fileno()

    # ------------------------------------------------------------------ accept
    def accept(self, budget: int = 256) -> None:
        for _ in range(budget):
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self._shed_one()
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EINTR, errno.EPROTO):
                    continue
                log.warning("fd socket: accept failed: %s", exc)
                return
            if self.fd_ceiling is not None and sock.fileno() >= self.fd_ceiling:
                sock.close()
                self._note_shed()
                continue
            try:
                sock.setblocking(False)
                pid, uid, gid = peer_credentials(sock)
            except OSError:
                sock.close()
                continue
            peer = Peer(uid, gid, pid)
            waiting = sum(1 for c in self.conns.values() if not c.lease and c.uid == uid)
            if waiting >= self.max_handshakes_per_uid:
                self.refused += 1
                self._answer_and_close(sock, errors.LimitExceeded(
                    f"uid {uid} has {waiting} fd-socket connections without a ticket (limit {self.max_handshakes_per_uid})"))
                continue
            conn = FdConn(sock, peer)
            self.conns[conn.fd] = conn

    def _shed_one(self) -> None:
        """Out of fds: free the spare, accept the next connection and close it at once (its
        client sees EOF and a clear error), then take the spare back. Without this the
        listener stays readable and the loop spins."""
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
        try:
            sock, _ = self.listener.accept()
            sock.close()
        except OSError:
            pass
        try:
            self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._spare = None
        self._note_shed()

    def _note_shed(self) -> None:
        self.shed += 1
        if self.shed == 1 or self.shed % 100 == 0:
            log.error("fd socket: near the open-file limit; shed %d connection(s) so far", self.shed)

    @staticmethod
    def _answer_and_close(sock: socket.socket, exc: errors.A2ADError) -> None:
        try:
            sock.send(protocol.frame_fd_message(
                {"v": protocol.PROTOCOL_VERSION, "ok": False, "code": exc.code, "message": exc.message}), socket.MSG_DONTWAIT)
        except OSError:
            pass
        sock.close()

    # -------------------------------------------------------------------- reads
    def readable(self, fd: int) -> None:
        conn = self.conns.get(fd)
        if conn is None:
            return
        try:
            data = conn.sock.recv(protocol.FD_FRAME_MAX + 4)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if conn.lease:
            # a lease: EOF (or anything at all) ends the attachment
            if not data:
                self.registry.lease_closed(conn)
                self.close_pending()
            return
        if not data:
            self.close(conn)  # (a redeemed one: send_ready finds it gone)
            return
        if conn.redeemed:
            return  # (nothing is to come before its answer)
        conn.buf += data
        if len(conn.buf) < 4:
            return
        try:
            n = protocol.fd_frame_length(bytes(conn.buf[:4]))
            if len(conn.buf) < 4 + n:
                return
            obj = protocol.unpack(bytes(conn.buf[4 : 4 + n]))
            if not isinstance(obj, dict) or obj.get("v") != protocol.PROTOCOL_VERSION:
                raise errors.BadMessage("fd-socket request must be a version-1 map")
            redeemed = self.registry.redeem(obj.get("ticket"), conn.peer)
        except errors.A2ADError as exc:
            self.refuse(conn, exc)
            return
        conn.redeemed = True
        conn.buf.clear()
        self.ready.append((conn, redeemed))

    def send_ready(self) -> None:
        """Answer the queued redeems (the state file was written since they were made): those
        still valid get their fds; a redeem that events since made stale (its job freed, its
        rank's process dead or joined again) is refused; one whose client went is undelivered."""
        ready, self.ready = self.ready, []
        for conn, r in ready:
            try:
                if self.conns.get(conn.fd) is not conn:
                    self.registry.undelivered(r, "its connection closed before the answer went out")
                    continue
                exc = self.registry.undeliverable(r)
                if exc is not None:
                    self.refuse(conn, exc)
                    continue
                self._deliver(conn, r)
            except Exception:  # a bug costs this answer only: its client sees the connection end
                log.exception("fd socket: internal error answering pid %s's ticket", conn.pid)
                if not conn.lease:
                    self.close(conn)

    def drop_ready(self) -> None:
        """Close the queued redeems' connections unanswered (the jobs were handed to a
        successor: their clients join again there)."""
        ready, self.ready = self.ready, []
        for conn, _ in ready:
            self.close(conn)

    def _deliver(self, conn: FdConn, r: Redeemed) -> None:
        answer = {"v": protocol.PROTOCOL_VERSION, "ok": True, "code": "ok", "message": "", "nfds": len(r.fds)}
        try:
            # non-blocking: the few small frames (fdpass.MAX_FDS fds each) always fit a live
            # client's empty receive buffer
            send_frame_fds(conn.sock, answer, r.fds)
        except OSError as exc:  # EPIPE, ECONNRESET, a client that stalled: this connection only
            self.close(conn)
            self.registry.undelivered(r, f"{type(exc).__name__}: {exc}")
            return
        conn.lease = True
        self.registry.delivered(r, conn)

    def refuse(self, conn: FdConn, exc: errors.A2ADError) -> None:
        log.warning("fd socket: refused pid %s: %s", conn.pid, exc.message)
        self.conns.pop(conn.fd, None)
        self._answer_and_close(conn.sock, exc)

    def close(self, conn: FdConn) -> None:
        if self.conns.pop(conn.fd, None) is not None:
            conn.sock.close()

    def close_pending(self) -> None:
        """Close the lease connections the registry let go of."""
        closing, self.registry.closing = self.registry.closing, []
        for conn in closing:
            self.close(conn)

    def expire(self, now: float) -> None:
        for conn in list(self.conns.values()):
            if not conn.lease and not conn.redeemed and now >= conn.deadline:
                self.refuse(conn, errors.BadTicket("no ticket was presented in time"))

    def next_deadline(self) -> float | None:
        times = [c.deadline for c in self.conns.values() if not c.lease and not c.redeemed]
        return min(times) if times else None

    def shutdown(self) -> None:
        self.ready = []
        for conn in list(self.conns.values()):
            self.close(conn)
        self.listener.close()
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
