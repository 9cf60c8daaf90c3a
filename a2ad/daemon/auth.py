"""Who may do what. Peers are identified by the kernel (SO_PEERCRED on fd.sock, the
``uid:gid:pid`` that libzmq reports for ipc peers), never by what a message claims.

- Connecting at all: the daemon's uid, root, ``--allow-uid`` uids, and members (primary or
  supplementary) of the allowed groups (``--group``, ``--allow-gid``).
- Admins: root, the daemon's uid, and members of ``--admin-group``. Only admins drain,
  upgrade or shut down the daemon, and see or touch other users' jobs.
- A job belongs to the uid that created it: only that uid or an admin may join it, see it,
  abort or destroy it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from a2ad import errors


@dataclass(frozen=True)
class Peer:
    uid: int | None
    gid: int | None
    pid: int | None

    @classmethod
    def from_cred(cls, cred: tuple[int, int, int] | None) -> "Peer":
        """From a ZeroMQ ``(uid, gid, pid)`` triple; None (the peer is unknown) gives a peer
        with no identity, which only happens for in-process callers."""
        if cred is None:
            return cls(None, None, None)
        return cls(*cred)

    def groups(self) -> set[int]:
        out = {self.gid} if self.gid is not None else set()
        return out | supplementary_groups(self.pid) if self.pid else out


def supplementary_groups(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


class Auth:
    def __init__(self, allow_uids=(), allow_gids=(), admin_gids=()):
        self.daemon_uid = os.getuid()
        self.allowed_uids = {self.daemon_uid, 0} | set(allow_uids)
        self.allowed_gids = set(allow_gids)
        self.admin_gids = set(admin_gids)

    def check_connect(self, peer: Peer) -> None:
        """May ``peer`` use this daemon at all?"""
        if peer.uid is None or peer.uid in self.allowed_uids:
            return
        if self.allowed_gids and self.allowed_gids & peer.groups():
            return
        raise errors.PermissionDenied(f"uid {peer.uid} is not allowed to use this daemon")

    def is_admin(self, peer: Peer) -> bool:
        if peer.uid is None or peer.uid in (0, self.daemon_uid):
            return True
        return bool(self.admin_gids and self.admin_gids & peer.groups())

    def require_admin(self, peer: Peer, what: str) -> None:
        if not self.is_admin(peer):
            raise errors.PermissionDenied(
                f"{what} is for administrators (root, the daemon's uid {self.daemon_uid}"
                + (", or members of the admin group" if self.admin_gids else "")
                + f"); uid {peer.uid} is not one"
            )

    def may_use(self, peer: Peer, owner_uid: int | None) -> bool:
        """May ``peer`` join, see, abort or destroy a job created by ``owner_uid``?"""
        return owner_uid is None or peer.uid == owner_uid or self.is_admin(peer)
