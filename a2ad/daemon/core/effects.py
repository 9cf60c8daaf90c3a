"""The time of the event being handled and what the core decided that its caller carries out:
one object the Registry and its parts (leases.py, policy.py, mirror.py) share, and the
fields the server and the simulator read and reset (``Registry.now``, ``outbox``,
``closing``, ``dirty``, ``counters`` are its own).

- ``now``: the time of the event being handled (a monotonic clock's seconds), set by whoever
  hands the registry an event: the server before each, the simulator from its clock;
- ``outbox``: (ZeroMQ identity, encoded frame) for held replies released or ended with an
  error (``reply``, ``fail``);
- ``closing``: lease connections (opaque objects of the fd socket) to close;
- ``dirty``: the state file is to be written;
- ``counters``: the registry's event counts (metrics, status).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from a2ad import errors, protocol

if TYPE_CHECKING:
    from a2ad.daemon.core.jobs import Held


class Effects:
    def __init__(self) -> None:
        self.now = 0.0
        self.outbox: list[tuple[bytes, bytes]] = []
        self.closing: list[object] = []
        self.dirty = False
        self.counters = {"joins": 0, "attaches": 0, "detaches": 0, "deaths": 0, "rendezvous": 0,
                         "bad_requests": 0, "rearms": 0, "refused": 0, "readmits": 0,
                         "mask_restores": 0}

    def reply(self, held: Held, payload: dict) -> None:
        self.outbox.append((held.identity, protocol.encode_reply(held.request_id, payload)))

    def fail(self, held: Held, exc: errors.A2ADError) -> None:
        self.outbox.append((held.identity, protocol.encode_error(held.request_id, exc)))
