"""What a daemon knows of its links to the other nodes of its domain, and what it decides from
what it hears: who is up, who is lost, who restarted, who owes a full resync, and when two
daemons run as one node. The domain bus (domain.py) turns its sockets into these calls, at the
time it gives; the simulator calls the same code.

- ``heard``: a message of a peer instance (its boot id): the peer is up (or restarted: a new
  instance), unless the message comes from a second daemon running as that node;
- ``their_losses``: a heartbeat's count of the times the peer counted this node lost; when it
  grew, the peer forgot this node's reports and a resync to it is owed;
- ``receiver_ran``: the receiving side (the domain gate, a process of its own) ran at the
  time its report gives; a peer not heard yet can be heard only while it runs;
- ``tick``: this daemon's own stalls are not its peers' silence; heartbeats out; a peer
  silent for the loss bound is lost; the resyncs owed go out once its link is up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from a2ad import mutations
from a2ad.daemon.core.ratelog import RateLog

log = logging.getLogger("a2ad")

#: A peer node's state as this daemon sees it.
PEER_CONNECTING, PEER_UP, PEER_DOWN = "connecting", "up", "down"
#: superseded instances of a node remembered (a collision is told from an upgrade by them)
MAX_SUPERSEDED = 16


def _counters() -> dict:
    return {"heartbeats_received": 0, "heartbeats_sent": 0, "messages_received": 0, "messages_sent": 0,
            "bad_messages": 0, "send_drops": 0, "losses": 0, "ups": 0, "connects": 0, "handshake_failures": 0,
            "name_collisions": 0, "collision_drops": 0, "resyncs_asked": 0}


@dataclass(eq=False)
class Link:
    """Another node of the domain, as this daemon sees it."""

    name: str
    state: str = PEER_CONNECTING
    since: float = 0.0
    last_rx: float | None = None
    last_heartbeat: float | None = None
    boot: bytes | None = None
    #: the transport says the link is up (its handshake succeeded and it has not dropped)
    connected: bool = False
    #: a full resync of this daemon's state to the peer is owed (it came up, restarted, or a send failed)
    resync_due: bool = False
    #: daemon instances of this node that a newer one replaced -> [when replaced, when last heard]
    superseded: dict = field(default_factory=dict)
    #: while two daemons run as this node: the other instance's boot id (its messages are dropped)
    collision: bytes | None = None
    #: how many times this peer (its current instance) said in its heartbeats that it counted
    #: this node lost; None until its first heartbeat
    their_losses: int | None = None
    counters: dict = field(default_factory=_counters)


class Links:
    """This daemon's view of its peers (``peers``: name -> Link, kept by the caller too)."""

    def __init__(self, domain: str, peers: dict[str, Link], heartbeat_interval: float, loss_bound: float,
                 now: float, handler=None, receiver_period: float | None = None):
        self.domain = domain
        self.peers = peers
        self.heartbeat_interval = heartbeat_interval
        self.loss_bound = loss_bound
        #: how often the receiving side (the gate) reports while it runs; None: not followed
        #: (every moment counts as one it could hear in)
        self.receiver_period = receiver_period
        #: the time, summed, in which the receiving side did not run since this daemon started
        #: listening (not counted as the silence of peers not heard yet)
        self.deaf_s = 0.0
        #: told of ups, losses and resyncs owed: ``on_peer_up(node, restarted)``,
        #: ``on_peer_lost(node, why)``, ``on_resync(node)``
        self.handler = handler
        self.now = now
        self.listening(now)
        self.stalled_s = 0.0
        self._ratelog = RateLog(lambda: self.now)
        for p in peers.values():
            p.since = now

    def listening(self, now: float) -> None:
        """Peers can be heard from ``now`` on (the receiving side runs: the gate said READY):
        the time before is nobody's silence."""
        self.started = self._listening_since = self._last_tick = self._receiver_seen = now

    def _receiver_allowance(self) -> float:
        # a gate that runs reports at its first loop turn past each period: no report for
        # longer means no loop turn in the time past the period
        return self.receiver_period

    def receiver_ran(self, t: float) -> None:
        """The receiving side (the domain gate) ran at ``t`` (the time in its report: a clock
        shared with this daemon's). A peer's messages reach this daemon only through it, and
        a peer not heard yet only once it has authenticated that peer's connection (a
        handshake the gate's loop answers): while it does not run (a fresh gate starved of CPU,
        a gate that died and is started again) nobody can be heard for the first time, and
        that time is not the silence of the peers not heard yet: a gap between its reports,
        less one report period, is such time. (Peers already heard are
        judged by their last message alone: a receiving side that stops past the loss bound
        while the others hear this node is a one-sided loss, which the heartbeats' loss counts
        resolve.)"""
        if self.receiver_period is None or t <= self._receiver_seen:
            return
        gap = t - self._receiver_seen - self._receiver_allowance()
        self._receiver_seen = t
        if gap <= 0 or mutations.active("gate_deafness_counted"):
            return
        self.deaf_s += gap
        self._listening_since += gap
        if any(p.state == PEER_CONNECTING for p in self.peers.values()):
            self._ratelog(logging.WARNING, ("deaf",),
                          "domain %s: the domain gate did not run for %.2f s (a fresh gate, or one starved of CPU): "
                          "that time is not counted as the silence of the nodes not heard yet", self.domain,
                          gap + self._receiver_allowance())

    def _deaf_now(self, now: float) -> float:
        """How long the receiving side has not run, up to ``now``, past its allowance."""
        if self.receiver_period is None or mutations.active("gate_deafness_counted"):
            return 0.0
        return max(0.0, now - self._receiver_seen - self._receiver_allowance())

    # ------------------------------------------------------------------- hearing
    def heard(self, p: Link, boot: bytes, t: str, now: float) -> bool:
        """Note that ``p`` was heard (a message of type ``t`` from its instance ``boot``); False
        when the message is to be dropped (it comes from a second daemon running as the same
        node)."""
        self.now = now
        if p.boot is not None and boot != p.boot:
            old = p.superseded.get(boot)
            if old is not None:
                # an instance that a newer one replaced speaks again: not a restart (a daemon's
                # instance id is new at every start) but two daemons running as this node, unless
                # it is a message that was on its way when the other took over (an upgrade)
                old[1] = now
                if now - old[0] <= self.heartbeat_interval and p.collision != boot:
                    log.debug("domain %s: a late message of node %s's previous instance %s; dropped",
                              self.domain, p.name, boot.hex())
                    return False
                p.counters["collision_drops"] += 1
                if p.collision != boot:
                    p.collision = boot
                    p.counters["name_collisions"] += 1
                    log.error("domain %s: two daemons run as node %s (instances %s and %s, both heard within "
                              "%g s%s): only instance %s is listened to, the other's messages are "
                              "dropped. Run one daemon per node name: check --node (or the host name) of the "
                              "daemons of this domain", self.domain, p.name, p.boot.hex(), boot.hex(),
                              self.loss_bound, self._where(p), p.boot.hex())
                return False
            p.superseded[p.boot] = [now, now]
            while len(p.superseded) > MAX_SUPERSEDED:
                del p.superseded[min(p.superseded, key=lambda b: p.superseded[b][1])]
        p.last_rx = now
        if t == "hb":
            p.last_heartbeat = now
        restarted = p.boot is not None and p.boot != boot
        if restarted:
            p.their_losses = None  # a new instance counts anew
        p.boot = boot
        if p.state != PEER_UP or restarted:
            was = p.state
            p.state, p.since = PEER_UP, now
            p.counters["ups"] += 1
            p.resync_due = True
            if restarted:
                log.warning("domain %s: node %s restarted (new daemon instance)", self.domain, p.name)
            else:
                log.info("domain %s: node %s is up (was %s)", self.domain, p.name, was)
            if self.handler is not None:
                self.handler.on_peer_up(p.name, restarted)
        return True

    @staticmethod
    def _where(p: Link) -> str:
        address = getattr(p, "address", None)
        return f"; {p.name} is reached at {address}" if address else ""

    def their_losses(self, p: Link, lost) -> bool:
        """A heartbeat's count of the times ``p`` counted this node lost: when it grew, ``p``
        dropped what this node had reported to it (and its ranks' states) and waits to hear
        it again, which the link alone would not make happen (it may never have dropped): a
        full resync to ``p`` is owed. The first count heard from an instance is only noted:
        its start or this node's own came with a handshake, which owes one anyway. False when
        the count is not one (the message is bad)."""
        if isinstance(lost, bool) or not isinstance(lost, int) or not 0 <= lost < 1 << 62:
            return False
        if p.their_losses is not None and lost > p.their_losses and not mutations.active("loss_count_ignored"):
            p.resync_due = True
            p.counters["resyncs_asked"] += 1
            log.warning("domain %s: node %s counted this node lost (%d time(s)) and hears it again: its reports "
                        "are sent to it again", self.domain, p.name, lost)
        p.their_losses = lost
        return True

    def link_up(self, p: Link) -> None:
        """The transport's handshake with ``p`` succeeded: whatever was dropped while it was
        down is sent again."""
        p.connected = True
        p.counters["connects"] += 1
        p.resync_due = True

    def send_failed(self, p: Link, heartbeat: bool) -> None:
        p.counters["send_drops"] += 1
        if not heartbeat:
            p.resync_due = True

    # --------------------------------------------------------------------- ticks
    def discount_own_stall(self, now: float) -> None:
        """A tick that comes more than a heartbeat late: this daemon's loop did not run in the
        meantime, so it read none of what its peers sent (their messages wait in its socket
        and are read next). That time is not counted as their silence: every peer's last
        message, and this daemon's start, count as that much later. A peer that really went
        silent is still counted lost, later by the stalls discounted meanwhile (``stalled_s``
        in the status sums them): of each late tick, two heartbeat intervals still count."""
        self.now = now
        stall = now - self._last_tick - 2 * self.heartbeat_interval
        self._last_tick = now
        if stall <= 0:
            return
        self.stalled_s += stall
        self._listening_since += stall
        for p in self.peers.values():
            if p.last_rx is not None:
                p.last_rx += stall
        self._ratelog(logging.WARNING, ("stall",),
                      "domain %s: this daemon did not run its loop for %.2f s (a long step, or the process was stopped "
                      "or starved of CPU): that time is not counted as its peers' silence", self.domain,
                      stall + 2 * self.heartbeat_interval)

    def beat(self, now: float, send) -> None:
        """Heartbeats to every peer (``send(node, msg, heartbeat=True)``), and the peers that
        went silent for the loss bound are lost."""
        self.now = now
        bound = self.loss_bound
        for p in self.peers.values():
            # "lost": the times this daemon counted the peer lost. A peer that was counted lost
            # while its link stayed up (it stalled, or a partition ended without a reconnect)
            # sees the count grow and sends its reports again: they were forgotten here
            hb = {"t": "hb", "lost": p.counters["losses"]} if p.counters["losses"] else {"t": "hb"}
            send(p.name, hb, heartbeat=True)
            if p.collision is not None:
                self._collision_check(p, now)
            if p.state == PEER_UP and p.last_rx is not None and now - p.last_rx > bound:
                self._lost(p, f"no message for {now - p.last_rx:.2f} s (heartbeat every {self.heartbeat_interval:g} s, "
                              f"lost after {bound:g} s)")
            elif p.state == PEER_CONNECTING and now - self._listening_since - self._deaf_now(now) > bound:
                self._lost(p, f"not heard from since this daemon started listening "
                              f"{now - self._listening_since - self._deaf_now(now):.1f} s ago")

    def resyncs(self) -> None:
        """The full resyncs owed to peers whose link is up."""
        if self.handler is None:
            return
        for p in self.peers.values():
            if p.resync_due and p.state == PEER_UP and p.connected:
                p.resync_due = False
                self.handler.on_resync(p.name)

    def _collision_check(self, p: Link, now: float) -> None:
        """A node-name collision ends once either instance has been silent for the loss bound:
        the other one, if it still speaks, is then heard as a restart."""
        other = p.superseded.get(p.collision, [0.0, 0.0])[1]
        if now - other > self.loss_bound:
            log.warning("domain %s: the second daemon running as node %s (instance %s) has been silent for %g s: "
                        "the name collision is over", self.domain, p.name, p.collision.hex(), now - other)
            p.collision = None
        elif p.last_rx is None or now - p.last_rx > self.loss_bound:
            log.warning("domain %s: instance %s of node %s went silent while instance %s still speaks: that one is "
                        "node %s now", self.domain, p.boot.hex() if p.boot else "?", p.name, p.collision.hex(), p.name)
            p.superseded.pop(p.collision, None)
            p.collision = None

    def _lost(self, p: Link, why: str) -> None:
        was = p.state
        p.state, p.since = PEER_DOWN, self.now
        p.counters["losses"] += 1
        log.warning("domain %s: node %s is lost (was %s): %s", self.domain, p.name, was, why)
        if self.handler is not None:
            self.handler.on_peer_lost(p.name, why)
