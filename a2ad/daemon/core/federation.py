"""Jobs that span the nodes of a domain: how the daemons of a domain agree on a job, run one
rendezvous for it, and tell each other about the losses of its ranks.

Every rank attaches to its own node's daemon, exactly as on one node; that daemon
allocates the rank's row and holds its join. The daemons then share what they hold:

- **Reports.** Whenever a daemon's part of a domain job changes (a rank joins, attaches,
  dies, leaves, waits in a recover; the abort word, the generation), it sends its *report*
  of the job (``job`` message: the spec, its rows with their fabric handles, each local
  rank's state and held request), at once and numbered, to the job's coordinator, and to
  the job's other holders when it is news for them (``Federation._peer_key``: a rank's
  liveness, its row, an abort word that starts on this node); nodes without rows of the
  job hear nothing of it. Every daemon keeps the latest report it got from each node per
  job (``FedJob.views``) and mirrors the other nodes' ranks into its own copy of the job
  (``Registry.apply_remote``, by the job's name: this module reads a job held here only as
  plain data, ``Registry.job_facts`` and ``Registry.domain_report``, and changes it only
  through the registry's calls; a release marks the ranks it released attached), where a
  remote rank's death or departure goes through the job's policy exactly as a local one
  does: the abort word (raise) or the active mask (degrade) of this node's control block.
  So a rank death reaches the ranks of every node one hop after its own daemon saw it.
- **A coordinator per job.** The job's coordinator is the first node, in an order picked
  by rendezvous hashing of the job's name over the configured nodes, that this daemon does
  not count as down. Every daemon computes the same order; while views of who is down
  agree, they name the same coordinator, and when the coordinator is lost the next one in
  the order takes over from the reports (which hold everything it needs).
- **First join wins.** The coordinator takes the spec of the first report of the job that
  reaches it (a report of a node that already holds the decision wins over it) and sends
  it (``decide``) to the nodes that report it; a node that creates the job before the
  decision reached it holds a *tentative* job. A report with another spec is refused
  everywhere (``refuse``): every daemon fails the joins it holds for the job with a
  SpecMismatch naming the field and both values, and the refused node drops its tentative
  job. A rank whose row two nodes hold (simultaneous joins) stays with the first.
- **One rendezvous, two steps.** When every rank of the job is live on its node, some wait
  in a join or recover, and (if the job needs a re-arm) every attached rank waits in a
  recover, the coordinator sends ``prepare`` to every node that holds rows: each checks
  that it has seen nothing newer than what the coordinator saw, re-arms the rows it holds
  (or takes the picked generation) and answers ``prepared``. Once every node did, it sends
  ``release`` with every row's handle: each daemon answers its held joins and recovers.
  No rank is released before every row of the job is re-armed. A node that answers no,
  or a prepare that times out, makes the coordinator try again from newer reports.
- **Lost nodes.** When the domain link counts a peer lost (heartbeats), that node's live
  ranks count as dead in every job: raise jobs set the abort word (ABORT_PEER_LOST),
  degrade jobs clear their bits. A node that comes back sends its reports again to the
  nodes that hold rows of its jobs or coordinate them, and they to it; a daemon whose view
  of a job's coordinator changed sends the new one its current report.
- **Work.** The coordinator's pass after a report looks at that report's ranks only (the
  decision, refusals, placement and live/waiting counts are kept between passes); one
  pass over the whole job builds a prepare once the counts say every rank can be present.
  docs/DOMAIN.md, "Scale", states the message bounds.
- A job whose ranks all attach to one node never leaves that node except for its reports;
  with its coordinator elsewhere, agreement costs one ``decide`` and the two rendezvous
  steps.

Nothing here blocks: messages go out through the domain bus (non-blocking; a message the
link cannot take makes a full resend owed), messages to this daemon itself go through a
local inbox handled in the same loop turn.

What a peer says is checked before it is used, as a client's request is: every field of
every message (types, ranges, sizes: devices, row sizes, ranks, node names), and only the
fields this daemon knows are kept (a report is stored as its checked copy). A message that
does not fit is dropped, counted and logged. Besides:

- only a job's coordinator (as this daemon sees the domain) may decide, prepare, release
  or refuse a rank of it; the same message from another node is refused and logged;
- a node is believed only about its own ranks: a report that claims a rank this daemon
  holds, or one whose row another node holds, does not reach the mirror (logged); the
  job's coordinator settles who keeps it;
- what this daemon keeps per peer is bounded (MAX_PEER_JOBS reports, MAX_PEER_REPORT_BYTES
  of them) and freed when the peer is counted lost (it sends everything again when it is
  heard again).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgpack

from a2ad import errors, layout as L, mutations, protocol
from a2ad.daemon.core.links import PEER_DOWN
from a2ad.daemon.core.ratelog import RateLog

if TYPE_CHECKING:
    from a2ad.daemon.core.jobs import JobFacts
    from a2ad.daemon.domain import Domain

log = logging.getLogger("a2ad")

#: Seconds the coordinator waits for every node's ``prepared`` before it tries again.
PREPARE_TIMEOUT = 5.0
#: Seconds before a coordinator tries a rendezvous again after a node answered no.
RETRY_DELAY = 0.05
_LIVE = (L.RANK_JOINING, L.RANK_ATTACHED)
_SPEC_KEYS = ("ep_size", "spec")

# --- what a peer's messages may hold (docs/DOMAIN.md, "Security")
#: Job reports kept per peer at once (one per job it holds); a report of one more is refused.
MAX_PEER_JOBS = 2048
#: Bytes of job reports kept per peer at once (each counted as its checked copy, msgpack-encoded).
MAX_PEER_REPORT_BYTES = 32 << 20
#: Longest reason a report may give for a row without a fabric handle (characters).
MAX_HANDLE_ERROR = 2000
#: Longest fabric handle (bytes; CUDA's are 64, the host backend's 32) and handle type name.
MAX_HANDLE = 256
MAX_HANDLE_TYPE = 32
#: Longest backend name, and a refusal's message and values (characters).
MAX_BACKEND = 16
MAX_REFUSAL_TEXT = 4000
MAX_REFUSAL_VALUE = 256
#: Largest rank counter (deaths, attaches) and generation or rendezvous count a report may carry.
MAX_COUNT = 2**31 - 1
MAX_GENERATION = L.MAX_GENERATION
#: A report's job-wide fields and a rank record's fields: nothing else of a report is kept.
REPORT_FIELDS = ("ep_size", "spec", "owner_uid", "backend", "row_stride", "size_per_rank", "confirmed", "generation",
                 "rendezvous_count", "needs_rearm", "abort", "abort_rank", "admits")
RANK_FIELDS = ("rank", "state", "waiting", "pid", "device", "deaths", "attaches", "size", "handle_type", "handle",
               "handle_error", "readmit")


@dataclass
class Attempt:
    id: int
    generation: int
    rearm: bool
    nodes: set[str]
    seqs: dict[str, list]
    table: list[dict]
    rendezvous_count: int
    started: float
    prepared: set[str] = field(default_factory=set)
    #: each node's report number right after it prepared
    after: dict[str, list] = field(default_factory=dict)


@dataclass
class FedJob:
    """Everything this daemon knows about one job of the domain."""

    name: str
    #: node -> its latest report of the job (this daemon's own included)
    views: dict[str, dict] = field(default_factory=dict)
    #: node -> (daemon instance, number) of that report
    seqs: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    #: nodes in the order their first report arrived here
    order: list[str] = field(default_factory=list)
    #: nodes lost since their report arrived: their ranks count as dead
    lost: set[str] = field(default_factory=set)
    #: the domain's decision {ep_size, spec, owner_uid, backend, row_stride} (the
    #: coordinator's own, or what a decide brought)
    decided: dict | None = None
    # --- the coordinator's bookkeeping
    placement: dict[int, str] = field(default_factory=dict)
    refused: dict[str, tuple] = field(default_factory=dict)
    decide_sent: dict[str, tuple] = field(default_factory=dict)
    rank_refused: set[tuple] = field(default_factory=set)
    attempt: Attempt | None = None
    retry_at: float = 0.0
    last_join_at: float = 0.0
    #: the report numbers the latest released rendezvous was decided on (no second one on them)
    released_on: dict | None = None
    # --- what the coordinator keeps between its passes over the job, so that a report costs
    # it work for that report's ranks only (``Federation._coordinate``)
    #: node -> (report number, decision, _differs of its report against that decision)
    diffs: dict[str, tuple] = field(default_factory=dict)
    #: rank -> the nodes whose reports (of the decided spec) hold it, in ``order``
    claims: dict[int, list[str]] = field(default_factory=dict)
    #: node -> the ranks its report (of the decided spec) holds
    claimed: dict[str, set[int]] = field(default_factory=dict)
    #: node -> (live ranks, ranks waiting and not released yet) of its report; their sums
    counts: dict[str, tuple[int, int]] = field(default_factory=dict)
    live_total: int = 0
    wait_total: int = 0
    #: whether claims, claimed and counts follow the views (else the next pass rebuilds them)
    cache_ok: bool = False


def coordinator_order(job: str, nodes) -> list[str]:
    """The nodes in the order that picks ``job``'s coordinator: highest random weight first
    (a BLAKE2b of the job's and the node's names), the same on every node."""
    return sorted(nodes, key=lambda n: hashlib.blake2b(f"{job}\0{n}".encode(), digest_size=8).digest(), reverse=True)


def _decision(view: dict) -> dict:
    return {k: view[k] for k in ("ep_size", "spec", "owner_uid", "backend", "row_stride")}


def _ranks(view: dict) -> dict[int, dict]:
    return {rec["rank"]: rec for rec in view["ranks"]}


def _fields(view: dict) -> dict:
    return {k: view[k] for k in ("generation", "abort", "abort_rank", "needs_rearm", "admits")}


def _only_attaching(old: dict, new: dict) -> bool:
    """Whether report body ``new`` differs from ``old`` only in ranks that attached after
    their joins were answered (joining -> attached, no request held before or after)."""
    if len(old["ranks"]) != len(new["ranks"]) or any(old[k] != new[k] for k in old if k != "ranks"):
        return False
    for a, b in zip(old["ranks"], new["ranks"]):
        if a == b:
            continue
        if not (a["state"] == L.RANK_JOINING and b["state"] == L.RANK_ATTACHED and a["waiting"] is None
                and b["waiting"] is None):
            return False
        if any(a[k] != b[k] for k in a if k not in ("state", "attaches")):
            return False
    return True


def _differs(decided: dict, view: dict) -> tuple[str, str, object, object] | None:
    """(kind, field, the job's value, the other value) of the first difference, or None."""
    if view["ep_size"] != decided["ep_size"]:
        return "spec", "ep_size", decided["ep_size"], view["ep_size"]
    a, b = decided["spec"], view["spec"]
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            return "spec", key, a.get(key), b.get(key)
    if view["backend"] != decided["backend"]:
        return "config", "backend", decided["backend"], view["backend"]
    if view["row_stride"] != decided["row_stride"]:
        return "config", "row_stride", decided["row_stride"], view["row_stride"]
    if decided["owner_uid"] is not None and view["owner_uid"] is not None and view["owner_uid"] != decided["owner_uid"]:
        return "owner", "owner_uid", decided["owner_uid"], view["owner_uid"]
    return None


def _spec_error(job: str, kind: str, fld: str, a, b, node: str) -> errors.A2ADError:
    if kind == "spec":
        what = "ep_size" if fld == "ep_size" else f"spec field {fld}"
        return errors.SpecMismatch(
            f"job {job!r}: {what} differs (job has {a}, a join on node {node} asked for {b})",
            field=fld, job_value=a, requested=b, node=node)
    if kind == "owner":
        return errors.PermissionDenied(f"job {job!r} belongs to another user (uid {a}); choose another job name")
    return errors.BackendError(f"job {job!r}: the nodes disagree on {fld} (the job has {a}, node {node} has {b}); "
                               "every daemon of a domain must run the same backend", field=fld)


# ------------------------------------------------------------------------ checking messages
def _int(v, lo: int = 0, hi: int = 2**63 - 1) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _opt_str(v, n: int) -> bool:
    return v is None or (isinstance(v, str) and len(v) <= n)


def _printable(v, n: int) -> bool:
    return isinstance(v, str) and 1 <= len(v) <= n and v.isprintable()


def _device(v) -> bool:
    """What a client's join may declare as its device (protocol.py): 'host' or a GPU's UUID."""
    return _printable(v, protocol.MAX_DEVICE_LEN)


def _handle(v) -> bool:
    return v is None or (isinstance(v, bytes) and 1 <= len(v) <= MAX_HANDLE)


def _row_size(v, size_per_rank: int, row_stride: int) -> bool:
    """A row holds the workspace and fits the job's row stride."""
    return _int(v, size_per_rank, row_stride)


def _boot_seq(v) -> bool:
    return isinstance(v, list) and len(v) == 2 and isinstance(v[0], bytes) and len(v[0]) == 8 and _int(v[1])


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _check_name(msg: dict) -> str:
    try:
        return protocol.check_job_name("job", msg.get("job"))
    except errors.InvalidField as exc:
        raise ValueError(exc.message) from None


def _check_report(msg: dict) -> dict:
    """A ``job`` message's fields, all of them, before anything uses one (ValueError: why
    not). Returns the checked copy, which holds the known fields only: that is what is kept."""
    name = _check_name(msg)
    _need(_int(msg.get("seq"), 1, MAX_GENERATION), "bad seq")
    _need(isinstance(msg.get("gone"), bool), "bad gone")
    if msg["gone"]:
        return {"job": name, "seq": msg["seq"], "gone": True}
    ep = msg.get("ep_size")
    _need(_int(ep, 1, L.MAX_EP_SIZE), "bad ep_size")
    try:
        spec = protocol.REQUESTS["join"]["spec"].check("spec", msg.get("spec"))
    except errors.InvalidField as exc:
        raise ValueError(exc.message) from None
    spec = protocol.normalize_spec(spec, ep)
    _need(spec == msg["spec"], "spec not normalized")
    _need(msg.get("owner_uid") is None or _int(msg["owner_uid"], 0, 2**32 - 1), "bad owner_uid")
    _need(_printable(msg.get("backend"), MAX_BACKEND), "bad backend")
    size = msg.get("size_per_rank")
    _need(_int(size, 1, protocol.MAX_SIZE_PER_RANK) and size == spec["workspace_size_per_rank"], "bad size_per_rank")
    stride = msg.get("row_stride")
    _need(_int(stride, size, protocol.MAX_SIZE_PER_RANK), "bad row_stride (smaller than a row's workspace)")
    for k in ("generation", "rendezvous_count"):
        _need(_int(msg.get(k), 0, MAX_GENERATION), f"bad {k}")
    for k in ("confirmed", "needs_rearm"):
        _need(isinstance(msg.get(k), bool), f"bad {k}")
    _need(_int(msg.get("abort"), 0, 2**32 - 1) and msg["abort"] in L.ABORT_NAMES, "bad abort word")
    _need(_int(msg.get("abort_rank"), -1, ep - 1), "bad abort rank")
    admits = msg.get("admits", [])  # (absent from a daemon that predates re-admission across nodes)
    _need(isinstance(admits, list) and len(admits) <= ep, "bad admits")
    for pair in admits:
        _need(isinstance(pair, (list, tuple)) and len(pair) == 2 and _int(pair[0], 0, ep - 1)
              and _int(pair[1], 0, MAX_COUNT), "bad admits entry (a [rank, deaths] pair)")
    ranks = msg.get("ranks")
    _need(isinstance(ranks, list) and len(ranks) <= ep, "bad ranks")
    seen, kept = set(), []
    for rec in ranks:
        _need(isinstance(rec, dict), "a rank record is not a map")
        r = rec.get("rank")
        _need(_int(r, 0, ep - 1) and r not in seen, "bad rank")
        seen.add(r)
        _need(_int(rec.get("state")) and rec["state"] in L.RANK_STATE_NAMES, f"rank {r}: bad state")
        _need(rec.get("waiting") in (None, "join", "recover"), f"rank {r}: bad waiting")
        _need(rec.get("pid") is None or _int(rec["pid"], 1, 2**31 - 1), f"rank {r}: bad pid")
        _need(rec.get("device") is None or _device(rec["device"]), f"rank {r}: bad device")
        _need(_int(rec.get("deaths"), 0, MAX_COUNT) and _int(rec.get("attaches"), 0, MAX_COUNT), f"rank {r}: bad counts")
        _need(rec.get("size") is None or _row_size(rec["size"], size, stride),
              f"rank {r}: bad row size (must be in [{size}, {stride}])")
        _need(_handle(rec.get("handle")), f"rank {r}: bad handle")
        _need(rec.get("handle_type") is None or _printable(rec["handle_type"], MAX_HANDLE_TYPE), f"rank {r}: bad handle type")
        _need(_opt_str(rec.get("handle_error"), MAX_HANDLE_ERROR), f"rank {r}: bad handle error")
        _need(isinstance(rec.get("readmit", False), bool), f"rank {r}: bad readmit")
        kept.append({k: rec.get(k) for k in RANK_FIELDS})
        kept[-1]["readmit"] = bool(rec.get("readmit", False))
    out = {"job": name, "seq": msg["seq"], "gone": False}
    out.update((k, msg[k]) for k in REPORT_FIELDS if k != "admits")
    out["spec"], out["ranks"] = spec, kept
    out["admits"] = [[int(r), int(d)] for r, d in admits]
    # whether that daemon takes part in re-admissions across nodes (one from before them
    # neither sends nor answers them: a replacement then comes back through a re-arm)
    out["admits_known"] = "admits" in msg
    return out


def _check_table(table, job, nodes) -> None:
    """A ``release`` table: one record per rank of ``job``, each on a configured node, with a
    device a client could declare and a row that fits the job (ValueError: why not)."""
    _need(isinstance(table, list) and len(table) == job.ep_size, f"bad release table (not {job.ep_size} records)")
    seen = set()
    for rec in table:
        _need(isinstance(rec, dict), "bad release table (a record is not a map)")
        r = rec.get("rank")
        _need(_int(r, 0, job.ep_size - 1) and r not in seen, f"bad release table (rank {r!r:.20})")
        seen.add(r)
        _need(rec.get("node") in nodes, f"bad release table: rank {r}'s node {rec.get('node')!r:.70} is not a node "
                                        "of the domain")
        _need(_device(rec.get("device")), f"bad release table: rank {r}'s device {rec.get('device')!r:.70}")
        _need(_row_size(rec.get("size"), job.size_per_rank, job.row_stride),
              f"bad release table: rank {r}'s row size {rec.get('size')!r:.30} (the job's rows hold "
              f"{job.size_per_rank}-{job.row_stride} bytes)")
        _need(_handle(rec.get("handle")), f"bad release table: rank {r}'s handle")
        _need(rec.get("pid") is None or _int(rec["pid"], 1, 2**31 - 1), f"bad release table: rank {r}'s pid")
        _need(rec.get("handle_type") is None or _printable(rec["handle_type"], MAX_HANDLE_TYPE),
              f"bad release table: rank {r}'s handle type")


def _refusal_value(v) -> bool:
    return v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= MAX_REFUSAL_VALUE)


def _check_decision(d) -> dict:
    _need(isinstance(d, dict), "bad decision")
    spec = d.get("spec")
    probe = {"ep_size": d.get("ep_size"), "spec": spec, "owner_uid": d.get("owner_uid"),
             "backend": d.get("backend"), "row_stride": d.get("row_stride"), "job": "x", "seq": 1, "gone": False,
             "size_per_rank": spec.get("workspace_size_per_rank") if isinstance(spec, dict) else None,
             "generation": 0, "rendezvous_count": 0, "confirmed": True, "needs_rearm": False,
             "abort": 0, "abort_rank": -1, "ranks": []}
    return _decision(_check_report(probe))


class Federation:
    """The domain side of the registry (see the module doc). ``flush`` runs after every
    event the daemon handles; ``tick`` and ``next_deadline`` with its timers."""

    def __init__(self, registry, bus: Domain, backend_name: str):
        self.reg = registry
        registry.fed = self
        self.bus = bus
        bus.handler = self
        self.node = bus.node
        self.nodes = bus.cfg.names
        self.backend = backend_name
        self.jobs: dict[str, FedJob] = {}
        self._sent: dict[str, dict] = {}
        self._seq: dict[str, int] = {}
        #: job -> the peer key (``_peer_key``) of the report its other holders last heard
        self._peer_keys: dict[str, tuple] = {}
        #: job -> the coordinator this daemon last sent its report to
        self._coord_of: dict[str, str] = {}
        #: job -> the peers that may hold a report of it from this daemon (a "gone" goes to them)
        self._told: dict[str, set[str]] = {}
        self._inbox: list[dict] = []
        #: job -> the id of the coordinator's prepare this daemon carried out last for it (the
        #: release must name it)
        self._prepared: dict[str, int] = {}
        #: job -> the nodes whose reports changed since the coordinator's last pass over it
        #: (None: look at everything again)
        self._coord_dirty: dict[str, set[str] | None] = {}
        self._force_sync = True
        self._next_force = 0.0
        self._order_cache: dict[str, list[str]] = {}
        self.counters = {"reports_sent": 0, "reports_received": 0, "rendezvous_coordinated": 0, "prepare_retries": 0,
                         "refusals": 0, "nodes_lost": 0, "refused_messages": 0, "reports_refused": 0,
                         "claims_refused": 0}
        #: peer -> job -> bytes of the report of it kept here (bounded: MAX_PEER_JOBS, MAX_PEER_REPORT_BYTES)
        self._held: dict[str, dict[str, int]] = {}
        self._held_bytes: dict[str, int] = {}
        self._ratelog = RateLog(lambda: self.reg.now)
        #: the coordinator's "last join seen to release sent" of its latest rendezvous, seconds
        self.coordinated: list[float] = []

    # --------------------------------------------------------------- coordinator
    def order(self, job: str) -> list[str]:
        """The nodes in the order that picks ``job``'s coordinator (highest random weight)."""
        o = self._order_cache.get(job)
        if o is None:
            o = coordinator_order(job, self.nodes)
            if len(self._order_cache) > 4096:
                self._order_cache.clear()
            self._order_cache[job] = o
        return o

    def coordinator(self, job: str) -> str:
        for n in self.order(job):
            if n == self.node or self.bus.state(n) != PEER_DOWN:
                return n
        return self.node

    def _from_coordinator(self, node: str, name: str, t: str) -> str | None:
        """None when ``node`` is ``name``'s coordinator as this daemon sees the domain, else
        why its ``t`` message is refused (counted and logged)."""
        coord = self.coordinator(name)
        if node == coord or mutations.active("decide_from_anyone"):
            return None
        self.counters["refused_messages"] += 1
        self._ratelog(logging.WARNING, ("coord", node, t),
                      "domain: refused a %r of job %s from node %s, which is not the job's coordinator (node %s is, "
                      "as this node sees the domain)", t, name, node, coord)
        return f"node {node} is not the job's coordinator here (node {coord} is)"

    # --------------------------------------------------------- registry's calls
    def check_new_job(self, name: str, ep_size: int, spec: dict, peer) -> bool:
        """A join creates ``name`` on this node: check it against what the domain already
        decided; True when that decision is known (the job is then not tentative)."""
        fj = self.jobs.get(name)
        decided = self._known(fj)
        if decided is None:
            return False
        probe = {"ep_size": ep_size, "spec": spec, "owner_uid": None, "backend": self.backend,
                 "row_stride": decided["row_stride"]}
        diff = _differs(decided, probe)
        if diff is not None:
            kind, fld, a, b = diff
            exc = _spec_error(name, kind, fld, a, b, self.node)
            if kind == "spec":
                self._broadcast_refusal(name, kind, fld, a, b, self.node, decided)
            raise exc
        if decided["owner_uid"] is not None and not self.reg.auth.may_use(peer, decided["owner_uid"]):
            raise _spec_error(name, "owner", "owner_uid", decided["owner_uid"], peer.uid, self.node)
        return True

    def _known(self, fj: FedJob | None) -> dict | None:
        if fj is None:
            return None
        if fj.decided is not None:
            return fj.decided
        for n in fj.order:
            v = fj.views.get(n)
            if v is not None and v["confirmed"] and n not in fj.lost:
                return _decision(v)
        return None

    def job_created(self, name: str) -> None:
        """A join created job ``name`` here (a job of the domain): the other nodes' ranks of it,
        as they reported them, are mirrored into it."""
        self._prepared.pop(name, None)  # a prepare carried out for an earlier job of that name
        job = self.reg.job_facts(name)
        fj = self.jobs.get(name)
        if fj is not None and job is not None:
            for n in list(fj.order):
                v = fj.views.get(n)
                if v is not None and n != self.node and n not in fj.lost and self._same_job(job, v):
                    self._mirror(job, n, v)

    def spread_refusal(self, name: str, exc: errors.SpecMismatch) -> None:
        d = exc.details
        job = self.reg.job_facts(name)
        self._broadcast_refusal(name, "spec", d.get("field"), d.get("job_value"), d.get("requested"), self.node,
                                self._probe(job))

    def spread_destroy(self, name: str, why: str) -> None:
        self.bus.broadcast({"t": "destroy", "job": name, "why": why})

    @staticmethod
    def _same_job(job: JobFacts, view: dict) -> bool:
        return view["ep_size"] == job.ep_size and view["spec"] == job.spec

    def _probe(self, job: JobFacts) -> dict:
        """Job ``job`` as held here, in the form of a decision (to compare with one)."""
        return {"ep_size": job.ep_size, "spec": job.spec, "owner_uid": job.owner_uid, "backend": self.backend,
                "row_stride": job.row_stride}

    # ---------------------------------------------------------------- the mirror
    def _believed(self, name: str, node: str, ranks: dict[int, dict]) -> dict[int, dict]:
        """The part of ``node``'s report that it may be believed about: its own ranks. A rank
        this daemon holds, or whose row another node holds here, is left out (logged); the
        job's coordinator settles which node keeps a rank two nodes claim."""
        out = {}
        owners = self.reg.rank_holders(name, ranks)
        for r, rec in ranks.items():
            if r not in owners:
                continue  # not a rank of the job
            owner = owners[r]
            if owner is None or owner == node:
                out[r] = rec
                continue
            self.counters["claims_refused"] += 1
            self._ratelog(logging.WARNING, ("claim", name, node, r),
                          "job %s: node %s reports rank %d as its own, which is %s: not believed", name, node, r,
                          "this node's" if owner == self.node else f"node {owner}'s")
        return out

    def _mirror(self, job: JobFacts, node: str, view: dict | None, why_gone: str = "",
                known: set[int] | None = None) -> None:
        """Mirror ``node``'s report ``view`` of ``job`` into the registry's copy (None: the node
        holds the job no more); ranks it let go of may then be another node's. ``known``: the
        ranks of its previous report (what the mirror looks at besides the new one's)."""
        name = job.name
        if view is None:
            cleared = self.reg.apply_remote(name, node, None, why_gone=why_gone, known=known)
        else:
            cleared = self.reg.apply_remote(name, node, self._believed(name, node, _ranks(view)), _fields(view),
                                            known=known)
        fj = self.jobs.get(name)
        if fj is None or (known is not None and not cleared):
            return  # no slot was let go of: no other node's report can hold one now
        for n in list(fj.order):
            v = fj.views.get(n)
            if n in (node, self.node) or n in fj.lost or v is None or not self._same_job(job, v):
                continue
            if any(owner is None for owner in self.reg.rank_holders(name, _ranks(v)).values()):
                self.reg.apply_remote(name, n, self._believed(name, n, _ranks(v)), _fields(v))

    # ------------------------------------------------------- what is kept per peer
    def _hold(self, node: str, name: str, report: dict) -> bool:
        """Count ``node``'s report of ``name`` against its bounds; False (the report is refused,
        counted and logged; the one kept before stays) when it would pass one."""
        held = self._held.setdefault(node, {})
        size = len(msgpack.packb(report, use_bin_type=True))
        prev = held.get(name)
        total = self._held_bytes.get(node, 0) - (prev or 0) + size
        if prev is None and len(held) >= MAX_PEER_JOBS:
            why = (f"node {node} already has {MAX_PEER_JOBS} job reports here (the bound per node); its report of "
                   f"job {name} is refused")
        elif total > MAX_PEER_REPORT_BYTES:
            why = (f"node {node}'s job reports would hold {total} bytes here, over the bound of "
                   f"{MAX_PEER_REPORT_BYTES} per node; its report of job {name} ({size} bytes) is refused")
        else:
            held[name] = size
            self._held_bytes[node] = total
            return True
        self.counters["reports_refused"] += 1
        self._ratelog(logging.WARNING, ("bound", node, prev is None and len(held) >= MAX_PEER_JOBS), "domain: %s", why)
        return False

    def _unhold(self, node: str, name: str) -> None:
        held = self._held.get(node)
        if held is not None and name in held:
            self._held_bytes[node] -= held.pop(name)

    def _forget_view(self, fj: FedJob, node: str) -> None:
        """Drop what this daemon keeps of ``node``'s part of ``fj``."""
        fj.views.pop(node, None)
        fj.seqs.pop(node, None)
        if node in fj.order:
            fj.order.remove(node)
        fj.decide_sent.pop(node, None)
        fj.refused.pop(node, None)
        fj.diffs.pop(node, None)
        fj.rank_refused = {k for k in fj.rank_refused if k[1] != node}
        self._unhold(node, fj.name)

    # ------------------------------------------------------------------- reports
    def sync_local(self, force: bool = True) -> bool:
        """Send the report of every domain job whose part here changed; True if one did.
        Without ``force``, a change that is only ranks attaching (after the release that
        answered their joins) waits for the next forced pass (every heartbeat interval, or
        a prepare): the attaches of many ranks then share one report."""
        changed = False
        for name in self.reg.domain_jobs():
            body = self.reg.domain_report(name, self.backend)
            sent = self._sent.get(name)
            if body != sent:
                if not force and sent is not None and _only_attaching(sent, body):
                    continue
                self._publish(name, body)
                changed = True
        for name in [n for n in self._sent if not self._holds(n)]:
            self._publish(name, None)
            changed = True
        self._follow_coordinators()
        return changed

    @staticmethod
    def _peer_key(body: dict) -> tuple:
        """What of a report the job's other holders need to hear about (the coordinator hears
        every report): which of this node's ranks are live, dead or gone, their rows, a
        replacement held for the others to take it back in (``readmit``) and the
        re-admissions of theirs applied here (``admits``), and an abort word that starts here
        (a rank of this node's, or an operator's). Not news for
        them: a rank's held request, joining becoming attached (the release that did it
        reached them too), the generation and the abort word of a re-arm (its prepare reached
        them), an abort word taken over from another node's report (they take it over from
        that report themselves) and needs_rearm (it follows a rank state they hear of)."""
        own = {rec["rank"] for rec in body["ranks"]}
        r = body["abort_rank"]
        abort = (body["abort"], r) if body["abort"] and (r < 0 or r in own) else None
        ranks = tuple((rec["rank"], -1 if rec["state"] in _LIVE else rec["state"], rec["pid"], rec["deaths"],
                       rec["device"], rec["size"], rec["handle"], rec["readmit"]) for rec in body["ranks"])
        admits = tuple(tuple(a) for a in body["admits"])
        return (body["ep_size"], body["backend"], body["row_stride"], body["owner_uid"], abort, ranks, admits)

    def _holds(self, name: str) -> bool:
        """Whether this daemon holds job ``name`` as a job of the domain."""
        job = self.reg.job_facts(name)
        return job is not None and job.domain

    def readmit_capable(self, name: str, nodes: set[str]) -> bool:
        """Whether every other node with live ranks of job ``name`` (``nodes``: the registry
        names them, ``policy.readmit_nodes``) answers re-admissions across
        nodes: none of its reports kept here lacks ``admits`` (a daemon from before them; the
        replacement then comes back through a re-arm, as in the middle of a rolling upgrade).
        A node whose report this daemon has not kept (its reports reach the nodes holding rows
        only with news for them) counts as answering; if it does not, the held join ends in
        RendezvousTimeout naming it."""
        fj = self.jobs.get(name)
        if fj is None:
            return True
        return all(fj.views[n].get("admits_known", False) for n in nodes if n in fj.views)

    def holders(self, name: str) -> set[str]:
        """The other nodes that hold rows of job ``name``, as far as this daemon knows: those
        whose reports it keeps and those its copy of the job places ranks on (the release
        table names every one)."""
        out: set[str] = self.reg.remote_nodes(name)
        fj = self.jobs.get(name)
        if fj is not None:
            out.update(n for n in fj.views if n not in fj.lost)
        out.discard(self.node)
        return out

    def _send_report(self, node: str, msg: dict) -> None:
        if self.bus.state(node) != PEER_DOWN or self.bus.peers[node].connected:
            self.bus.send(node, msg)
        self._told.setdefault(msg["job"], set()).add(node)

    def _publish(self, name: str, body: dict | None) -> None:
        """Number and send this daemon's report of ``name``: to the job's coordinator always,
        to the job's other holders when its peer key changed (``_peer_key``); a "gone" to
        every node that may keep a report of it."""
        seq = self._seq[name] = self._seq.get(name, 0) + 1
        msg = {"t": "job", "job": name, "seq": seq, "gone": body is None, **(body or {})}
        coord = self.coordinator(name)
        if body is None:
            self._sent.pop(name, None)
            self._prepared.pop(name, None)
            targets = self._told.pop(name, set()) | self.holders(name) | {coord}
            self._peer_keys.pop(name, None)
            self._coord_of.pop(name, None)
        else:
            self._sent[name] = body
            targets = {coord}
            key = self._peer_key(body)
            if key != self._peer_keys.get(name):
                self._peer_keys[name] = key
                targets |= self.holders(name)
            self._coord_of[name] = coord
        self.counters["reports_sent"] += 1
        for n in sorted(targets - {self.node}):
            self._send_report(n, msg)
        if body is None:
            self._told.pop(name, None)
        self._take_report(self.node, self.bus.boot, msg)

    def _follow_coordinators(self) -> None:
        """A job whose coordinator changed (as this daemon sees the domain) gets this daemon's
        current report at once: it may have heard only this node's changes that were news
        for every holder."""
        for name, body in self._sent.items():
            coord = self.coordinator(name)
            if coord != self._coord_of.get(name):
                self._coord_of[name] = coord
                if coord != self.node:
                    self._send_report(coord, {"t": "job", "job": name, "seq": self._seq[name], "gone": False, **body})

    def on_resync(self, node: str) -> None:
        """Send ``node`` this daemon's report of every job it holds rows of or coordinates,
        then the list of this daemon's jobs (jobs it does not list are gone from here)."""
        for name, body in self._sent.items():
            if node == self.coordinator(name) or node in self.holders(name):
                self._send_report(node, {"t": "job", "job": name, "seq": self._seq[name], "gone": False, **body})
        self.bus.send(node, {"t": "sync", "jobs": sorted(self._sent)})
        for fj in self.jobs.values():  # what a coordinator told the node may have been lost with the link
            fj.decide_sent.pop(node, None)
            fj.refused.pop(node, None)
            fj.rank_refused = {k for k in fj.rank_refused if k[1] != node}
        self._mark_all()

    # -------------------------------------------------------------- the bus's calls
    def on_peer_up(self, node: str, restarted: bool) -> None:
        self._mark_all()  # the coordinator of some jobs may have changed
        self._force_sync = True

    def on_peer_lost(self, node: str, why: str) -> None:
        self.counters["nodes_lost"] += 1
        for fj in self.jobs.values():
            if node in fj.views or node in self.holders(fj.name):
                fj.lost.add(node)
        self.reg.domain_node_lost(node, why)  # re-adopted jobs too, whose reports of it never came
        # what it reported is freed (the mirror keeps its ranks, dead); it sends it all again
        # when it is heard again
        for fj in list(self.jobs.values()):
            if node in fj.views or node in fj.seqs:
                self._forget_view(fj, node)
                self._gc(fj)
        self._held.pop(node, None)
        self._held_bytes.pop(node, None)
        self._mark_all()
        self._force_sync = True  # jobs it coordinated have another coordinator now

    def on_message(self, node: str, msg: dict) -> None:
        t = msg["t"]
        handler = _HANDLERS.get(t)
        if handler is None:
            raise ValueError(f"unknown message type {t!r:.40}")
        handler(self, node, msg)

    # ----------------------------------------------------------------- handlers
    def _on_job(self, node: str, msg: dict) -> None:
        report = _check_report(msg)
        self.counters["reports_received"] += 1
        self._take_report(node, msg["boot"], report)

    def _take_report(self, node: str, boot: bytes, msg: dict) -> None:
        name = msg["job"]
        fj = self.jobs.get(name)
        if fj is None and msg["gone"]:
            return
        prev = fj.seqs.get(node) if fj is not None else None
        if prev is not None and prev[0] == boot and (msg["seq"] < prev[1] or (msg["seq"] == prev[1] and node not in fj.lost)):
            return  # not newer than what we have
        if node != self.node:
            if msg["gone"]:
                self._unhold(node, name)
            elif not self._hold(node, name, msg):
                return
        if fj is None:
            fj = self.jobs[name] = FedJob(name)
        fj.seqs[node] = (boot, msg["seq"])
        fj.lost.discard(node)
        old = fj.views.get(node)
        if msg["gone"]:
            fj.views.pop(node, None)
            if node in fj.order:
                fj.order.remove(node)
        else:
            fj.views[node] = msg
            if node not in fj.order:
                fj.order.append(node)
            before = _ranks(old) if old is not None else {}
            if any(rec["state"] == L.RANK_JOINING and before.get(r, {}).get("state") != L.RANK_JOINING
                   for r, rec in _ranks(msg).items()):
                fj.last_join_at = self.reg.now
        if node != self.node:
            job = self.reg.job_facts(name)
            if job is not None and job.domain:
                known = {rec["rank"] for rec in old["ranks"]} if old is not None and self._same_job(job, old) else None
                if msg["gone"] or not self._same_job(job, msg):
                    self._mirror(job, node, None, why_gone=f"node {node} no longer holds the job", known=known)
                else:
                    self._mirror(job, node, msg, known=known)
        self._mark(name, node)
        self._gc(fj)

    def _gc(self, fj: FedJob) -> None:
        if not fj.views and self.reg.job_facts(fj.name) is None:
            self.jobs.pop(fj.name, None)

    def _on_sync(self, node: str, msg: dict) -> None:
        names = msg.get("jobs")
        _need(isinstance(names, list) and all(isinstance(n, str) and len(n) <= protocol.MAX_JOB_NAME for n in names),
              "bad job list")
        keep = set(names)
        for fj in list(self.jobs.values()):
            if node in fj.views and fj.name not in keep:
                fj.views.pop(node, None)
                if node in fj.order:
                    fj.order.remove(node)
                fj.lost.discard(node)
                self._unhold(node, fj.name)
                job = self.reg.job_facts(fj.name)
                if job is not None and job.domain:
                    self._mirror(job, node, None, why_gone=f"node {node} no longer holds the job")
                self._mark(fj.name)
                self._gc(fj)

    def _on_decide(self, node: str, msg: dict) -> None:
        name = _check_name(msg)
        decided = _check_decision(msg.get("decision"))
        if self._from_coordinator(node, name, "decide") is not None:
            return
        job = self.reg.job_facts(name)
        fj = self.jobs.get(name)
        if fj is None:
            if job is None:
                return  # a decision is sent to the nodes that report the job: nothing to keep
            fj = self.jobs[name] = FedJob(name)
        if self.coordinator(name) != self.node:
            fj.decided = decided
        if job is None or not job.domain:
            return
        diff = _differs(decided, self._probe(job))
        if diff is None:
            self.reg.domain_confirm(name)
        elif not job.confirmed:
            kind, fld, a, b = diff
            self.reg.domain_refuse(name, _spec_error(name, kind, fld, a, b, self.node), drop=True)

    def _on_refuse(self, node: str, msg: dict) -> None:
        name = _check_name(msg)
        kind, fld = msg.get("kind"), msg.get("field")
        _need(kind in ("spec", "owner", "config", "backend") and _printable(fld, protocol.MAX_JOB_NAME), "bad refusal")
        _need(msg.get("node") in self.nodes, "bad refusal (not a node of the domain)")
        _need(_opt_str(msg.get("message"), MAX_REFUSAL_TEXT), "bad refusal message")
        _need(_refusal_value(msg.get("job_value")) and _refusal_value(msg.get("requested")), "bad refusal values")
        decided = _check_decision(msg.get("decision")) if msg.get("decision") is not None else None
        if msg["node"] != node and self._from_coordinator(node, name, "refuse") is not None:
            return  # a node refuses its own joins; another node's only the coordinator
        job = self.reg.job_facts(name)
        self.counters["refusals"] += 1
        if job is None or not job.domain:
            return
        if kind == "backend":
            exc = errors.BackendError(msg.get("message") or f"job {name!r} was refused by the domain")
        else:
            exc = _spec_error(name, kind, fld, msg.get("job_value"), msg.get("requested"), msg["node"])
        drop = False
        if decided is not None and not job.confirmed:
            drop = _differs(decided, self._probe(job)) is not None
        self.reg.domain_refuse(name, exc, drop)

    def _on_refuse_rank(self, node: str, msg: dict) -> None:
        name = _check_name(msg)
        r, holder = msg.get("rank"), msg.get("holder")
        _need(_int(r, 0, L.MAX_EP_SIZE - 1) and holder in self.nodes, "bad rank refusal")
        if self._from_coordinator(node, name, "refuse_rank") is not None:
            return
        job = self.reg.job_facts(name)
        if job is None or not job.domain or r >= job.ep_size:
            return
        self.reg.domain_refuse_rank(name, r, errors.RankTaken(
            f"job {name!r} rank {r} is held on node {holder} (its join there came first)", node=holder))
        fj = self.jobs.get(name)
        v = fj.views.get(holder) if fj is not None else None
        if v is not None and holder not in fj.lost and self._same_job(job, v):
            self._mirror(job, holder, v)  # the slot is the holder's now

    def _on_prepare(self, node: str, msg: dict) -> None:
        name = _check_name(msg)
        attempt, gen, rearm, seqs = msg.get("attempt"), msg.get("generation"), msg.get("rearm"), msg.get("seqs")
        _need(_int(attempt) and _int(gen, 0, MAX_GENERATION) and isinstance(rearm, bool) and isinstance(seqs, dict),
              "bad prepare")
        _need(all(n in self.nodes and _boot_seq(v) for n, v in seqs.items()), "bad prepare (report numbers)")
        job = self.reg.job_facts(name)
        why = self._from_coordinator(node, name, "prepare")  # answered no: a coordinator that thinks
        if why is not None:                                  # itself one tries again soon
            pass
        elif job is None or not job.domain:
            why = "no such job here"
        else:
            self.sync_local()  # the number compared below must be that of the current state
            fj = self.jobs.get(name)
            mine = seqs.get(self.node)
            if not (isinstance(mine, list) and len(mine) == 2 and mine[0] == self.bus.boot and mine[1] == self._seq.get(name)):
                why = "its part changed since the coordinator saw it"
            else:
                for n, pair in seqs.items():
                    cur = fj.seqs.get(n) if fj is not None else None
                    if n != self.node and cur is not None and isinstance(pair, list) and len(pair) == 2 and (
                            cur[0] != pair[0] or cur[1] > pair[1]):
                        why = f"it has newer news from node {n}"
                        break
            if why is None and rearm:
                why = self.reg.domain_quiesced(name)
            if why is None:
                self.reg.domain_prepare(name, gen, rearm)
                self._prepared[name] = attempt
                # what the prepare changed is no news for the job's other holders (it reached them too)
                self._peer_keys[name] = self._peer_key(self.reg.domain_report(name, self.backend))
                self.sync_local()  # the report as prepared goes out before the answer
        self._send(node, {"t": "prepared", "job": name, "attempt": attempt, "ok": why is None, "why": why,
                          "seq": [self.bus.boot, self._seq.get(name, 0)]})

    def _on_prepared(self, node: str, msg: dict) -> None:
        name = _check_name(msg)
        fj = self.jobs.get(name)
        a = fj.attempt if fj is not None else None
        if a is None or msg.get("attempt") != a.id or node not in a.nodes:
            return
        if msg.get("ok") is not True:
            self.counters["prepare_retries"] += 1
            log.debug("job %s: node %s answered the rendezvous' prepare with no (%s); trying again", name, node,
                      msg.get("why"))
            fj.attempt = None
            fj.retry_at = self.reg.now + RETRY_DELAY
            self._mark(name)
            return
        a.prepared.add(node)
        seq = msg.get("seq")
        if _boot_seq(seq):
            a.after[node] = seq
        if a.prepared != a.nodes:
            return
        fj.attempt = None
        fj.released_on = a.after
        if fj.decided is not None:
            self._count(fj, fj.decided, None)  # what waited is released now
        release = {"t": "release", "job": name, "attempt": a.id, "generation": a.generation,
                   "rendezvous_count": a.rendezvous_count, "table": a.table}
        self._send_many(a.nodes, release)
        latency = self.reg.now - (fj.last_join_at or a.started)
        self.coordinated.append(latency)
        del self.coordinated[:-1000]
        self.counters["rendezvous_coordinated"] += 1
        log.info("job %s: coordinated the domain rendezvous of %d ranks on node(s) %s at generation %d%s "
                 "(%.3f ms after the last join reached this coordinator)", name, len(a.table), ", ".join(sorted(a.nodes)),
                 a.generation, " with a re-arm" if a.rearm else "", latency * 1e3)

    def _on_release(self, node: str, msg: dict) -> None:
        name = _check_name(msg)
        attempt, gen, count, table = msg.get("attempt"), msg.get("generation"), msg.get("rendezvous_count"), msg.get("table")
        _need(_int(attempt) and _int(gen, 0, MAX_GENERATION) and _int(count, 0, MAX_GENERATION)
              and isinstance(table, list), "bad release")
        if self._from_coordinator(node, name, "release") is not None:
            return
        job = self.reg.job_facts(name)
        if job is None or not job.domain or self._prepared.get(name) != attempt:
            log.debug("job %s: a release from node %s for another rendezvous attempt; ignored", name, node)
            return
        _check_table(table, job, self.nodes)
        self._prepared.pop(name, None)
        self.reg.domain_release(name, gen, count, table)

    def _on_destroy(self, node: str, msg: dict) -> None:
        name = _check_name(msg)
        _need(_opt_str(msg.get("why"), 500), "bad destroy")
        job = self.reg.job_facts(name)
        if job is not None and job.domain:
            self.reg.domain_destroy(name, msg.get("why") or f"destroyed on node {node}")

    # ------------------------------------------------------------- coordinating
    def _send(self, node: str, msg: dict) -> None:
        if node == self.node:
            self._inbox.append(msg)
        else:
            self.bus.send(node, msg)

    def _send_many(self, nodes, msg: dict) -> None:
        others = sorted(n for n in nodes if n != self.node)
        if len(others) != len(nodes):
            self._inbox.append(msg)
        self.bus.send_many(others, msg)

    def _broadcast_refusal(self, name, kind, fld, a, b, node, decided: dict | None, to: str | None = None,
                           message: str | None = None) -> None:
        msg = {"t": "refuse", "job": name, "kind": kind, "field": fld, "job_value": a, "requested": b, "node": node,
               "decision": decided, "message": message}
        if to is not None:
            self._send(to, msg)
            return
        self.bus.broadcast(msg)
        if kind != "spec" or node != self.node:  # a refusal this node raised itself is handled already
            self._inbox.append(msg)

    def _mark(self, name: str, node: str | None = None) -> None:
        """The coordinator is to look at job ``name`` again: at ``node``'s report only, or
        (None) at everything."""
        if node is None:
            self._coord_dirty[name] = None
        elif name not in self._coord_dirty:
            self._coord_dirty[name] = {node}
        elif self._coord_dirty[name] is not None:
            self._coord_dirty[name].add(node)

    def _mark_all(self) -> None:
        for name in self.jobs:
            self._coord_dirty[name] = None

    def _diff(self, fj: FedJob, n: str, d: dict):
        """``_differs(d, node n's report)``, computed once per report and decision."""
        seq = fj.seqs.get(n)
        c = fj.diffs.get(n)
        if c is not None and c[0] == seq and c[1] is d:
            return c[2]
        r = _differs(d, fj.views[n])
        fj.diffs[n] = (seq, d, r)
        return r

    def _good(self, fj: FedJob, n: str, d: dict) -> bool:
        return n in fj.views and n not in fj.lost and self._diff(fj, n, d) is None

    def _coordinate(self, fj: FedJob, now: float, changed: set[str] | None = None) -> None:
        """The coordinator's pass over job ``fj`` after reports of the nodes in ``changed``
        (None: after anything else). A pass over a few nodes' reports costs work for their
        ranks only: the decision, refusals and placement are checked for them, and the
        rendezvous is looked at (one pass over the job) only once every rank can be present."""
        if self.coordinator(fj.name) != self.node:
            fj.attempt = None
            fj.cache_ok = False
            return
        d = fj.decided
        if d is not None and not any(self._good(fj, n, d) for n in fj.views):
            d = None  # nobody holds the decided job any more: the next report decides anew
        if d is None:
            views = {n: v for n, v in fj.views.items() if n not in fj.lost}
            if not views:
                return
            first = next((v for n in fj.order for v in [views.get(n)] if v is not None and v["confirmed"]), None)
            if first is None:
                first = next(views[n] for n in fj.order if n in views)
            d = fj.decided = _decision(first)
            changed = None
        if not fj.cache_ok:
            changed = None
        if changed is None:
            nodes = [n for n in fj.views if n not in fj.lost]
        else:
            nodes = [n for n in changed if n in fj.views and n not in fj.lost]
        for n in nodes:
            v = fj.views[n]
            diff = self._diff(fj, n, d)
            if diff is not None:
                key = (fj.seqs.get(n), diff[:2])
                if fj.refused.get(n) != key:
                    fj.refused[n] = key
                    kind, fld, a, b = diff
                    log.warning("job %s: node %s's report differs in %s (job has %s, node %s has %s): refused",
                                fj.name, n, fld, a, n, b)
                    if kind == "spec":
                        self._broadcast_refusal(fj.name, kind, fld, a, b, n, d)
                    else:
                        self._broadcast_refusal(fj.name, kind, fld, a, b, n, d, to=n)
                continue
            if not v["confirmed"] and fj.decide_sent.get(n) != fj.seqs.get(n):
                fj.decide_sent[n] = fj.seqs.get(n)
                self._send(n, {"t": "decide", "job": fj.name, "decision": d})
        self._place(fj, d, changed)
        self._count(fj, d, changed)
        fj.cache_ok = True
        self._rendezvous(fj, d, now)

    def _place(self, fj: FedJob, d: dict, changed: set[str] | None) -> None:
        """A rank's row stays with the first node that reported it; another node's join of it
        is refused. Looks at the ranks of the ``changed`` nodes' reports (None: all)."""
        if fj.rank_refused:
            fj.rank_refused = {k for k in fj.rank_refused if fj.seqs.get(k[1]) == k[2]}  # only the current reports'
        if changed is None:
            fj.claims, fj.claimed = {}, {}
            for n in fj.order:
                if not self._good(fj, n, d):
                    continue
                rs = {rec["rank"] for rec in fj.views[n]["ranks"]}
                fj.claimed[n] = rs
                for r in rs:
                    fj.claims.setdefault(r, []).append(n)
            affected = set(fj.claims) | set(fj.placement)
        else:
            affected = set()
            pos = None
            for n in changed:
                old = fj.claimed.pop(n, set())
                new = {rec["rank"] for rec in fj.views[n]["ranks"]} if self._good(fj, n, d) else set()
                for r in old - new:
                    ns = fj.claims.get(r)
                    if ns is not None and n in ns:
                        ns.remove(n)
                        if not ns:
                            del fj.claims[r]
                for r in new - old:
                    ns = fj.claims.setdefault(r, [])
                    ns.append(n)
                    if len(ns) > 1:
                        pos = pos or {x: i for i, x in enumerate(fj.order)}
                        ns.sort(key=lambda x: pos.get(x, len(pos)))
                if new:
                    fj.claimed[n] = new
                affected |= old | new
        for r in affected:
            ns = fj.claims.get(r)
            if not ns:
                fj.placement.pop(r, None)
                continue
            keep = fj.placement.get(r)
            if keep not in ns:
                attached = [n for n in ns if _ranks(fj.views[n])[r]["state"] == L.RANK_ATTACHED]
                keep = (attached or ns)[0]
                fj.placement[r] = keep
            for n in ns:
                key = (r, n, fj.seqs.get(n))
                if n != keep and key not in fj.rank_refused:
                    fj.rank_refused.add(key)
                    log.warning("job %s: rank %d is held on node %s; node %s's join of it is refused", fj.name, r, keep, n)
                    self._send(n, {"t": "refuse_rank", "job": fj.name, "rank": r, "holder": keep})

    def _count(self, fj: FedJob, d: dict, changed: set[str] | None) -> None:
        """Per node, its live ranks and its ranks that wait and were not released on that very
        report; their sums tell whether a rendezvous can be due at all."""
        released = fj.released_on or {}

        def of(n):
            if not self._good(fj, n, d):
                return (0, 0)
            rel = released.get(n) == [fj.seqs[n][0], fj.seqs[n][1]]
            live = wait = 0
            for rec in fj.views[n]["ranks"]:
                if rec["state"] in _LIVE:
                    live += 1
                    if rec["waiting"] and not rel:
                        wait += 1
            return (live, wait)

        if changed is None:
            fj.counts = {n: of(n) for n in fj.views}
            fj.live_total = sum(c[0] for c in fj.counts.values())
            fj.wait_total = sum(c[1] for c in fj.counts.values())
            return
        for n in changed:
            old = fj.counts.pop(n, (0, 0))
            new = of(n) if n in fj.views else (0, 0)
            fj.counts[n] = new
            fj.live_total += new[0] - old[0]
            fj.wait_total += new[1] - old[1]

    def _rendezvous(self, fj: FedJob, d: dict, now: float) -> None:
        a = fj.attempt
        if a is not None:
            if now - a.started < PREPARE_TIMEOUT:
                return
            log.warning("job %s: node(s) %s did not answer the rendezvous' prepare within %g s; trying again",
                        fj.name, sorted(a.nodes - a.prepared), PREPARE_TIMEOUT)
            self.counters["prepare_retries"] += 1
            fj.attempt = None
        if now < fj.retry_at:
            return
        if fj.live_total < d["ep_size"] or fj.wait_total <= 0:
            return  # a rank is missing, or none waits: nothing to do (the counts tell without a pass)
        views = {n: v for n, v in fj.views.items() if n not in fj.lost and self._diff(fj, n, d) is None}
        by_rank = {n: _ranks(v) for n, v in views.items()}
        recs: dict[int, tuple[str, dict]] = {}
        released = fj.released_on or {}
        for r in range(d["ep_size"]):
            n = fj.placement.get(r)
            rec = by_rank[n].get(r) if n in by_rank else None
            if rec is None or rec["state"] not in _LIVE:
                return  # a rank is missing
            if rec["waiting"] and released.get(n) == [fj.seqs[n][0], fj.seqs[n][1]]:
                rec = dict(rec, waiting=None)  # released on this very report: not waiting any more
            recs[r] = (n, rec)
        if not any(rec["waiting"] for _, rec in recs.values()):
            return
        nodes = {n for n, _ in recs.values()}
        if any(not views[n]["confirmed"] for n in nodes):
            return  # the decision is on its way to them; their next reports bring them back here
        rearm = any(views[n]["needs_rearm"] or views[n]["abort"] for n in nodes) or any(
            rec["waiting"] == "recover" for _, rec in recs.values())
        if rearm and any(rec["state"] == L.RANK_ATTACHED and rec["waiting"] != "recover" for _, rec in recs.values()):
            return  # a survivor has not quiesced yet
        if len(nodes) > 1:
            missing = [(r, n, rec.get("handle_error")) for r, (n, rec) in sorted(recs.items()) if not rec["handle"]]
            if missing:
                r, n, why = missing[0]
                message = (f"job {fj.name!r} spans nodes {', '.join(sorted(nodes))}, but rank {r}'s workspace on node {n} "
                           f"has no fabric handle that other nodes could import: {why or 'none was made'}")
                key = (tuple(sorted(fj.seqs.get(x, (b"", 0))[1] for x in nodes)), "handles")
                if fj.refused.get("*") != key:
                    fj.refused["*"] = key
                    log.warning("%s", message)
                    self._broadcast_refusal(fj.name, "backend", "fabric", None, None, n, None, message=message)
                return
        seqs = {n: [fj.seqs[n][0], fj.seqs[n][1]] for n in nodes}
        generation = max(views[n]["generation"] for n in nodes) + (1 if rearm else 0)
        count = max(views[n]["rendezvous_count"] for n in nodes) + (
            1 if any(rec["waiting"] == "join" for _, rec in recs.values()) else 0)
        table = [{"rank": r, "node": n, "device": rec["device"], "size": rec["size"], "handle_type": rec["handle_type"],
                  "handle": rec["handle"], "pid": rec["pid"]} for r, (n, rec) in sorted(recs.items())]
        fj.attempt = Attempt(id=int.from_bytes(self.reg.host.token(8), "little") >> 2, generation=generation, rearm=rearm, nodes=nodes, seqs=seqs, table=table,
                             rendezvous_count=count, started=now)
        prepare = {"t": "prepare", "job": fj.name, "attempt": fj.attempt.id, "generation": generation, "rearm": rearm,
                   "seqs": fj.attempt.seqs}
        self._send_many(nodes, prepare)

    # --------------------------------------------------------------- the loop's calls
    def flush(self, reports: bool = True) -> None:
        """Send what changed here, handle this daemon's messages to itself, coordinate
        (``reports=False``: not the reports yet, more requests of the same batch follow)."""
        for _ in range(16):
            if reports and (self.reg.dirty or self._force_sync):
                force, self._force_sync = self._force_sync, False
                self.sync_local(force)
            if not self._inbox and not self._coord_dirty:
                return
            inbox, self._inbox = self._inbox, []
            for msg in inbox:
                try:
                    self.on_message(self.node, dict(msg, boot=self.bus.boot))
                except (KeyError, TypeError, ValueError, IndexError, AttributeError, errors.A2ADError) as exc:
                    log.error("domain: this node's own %r message could not be used: %s", msg.get("t"), exc)
            dirty, self._coord_dirty = self._coord_dirty, {}
            now = self.reg.now
            for name in sorted(dirty):
                fj = self.jobs.get(name)
                if fj is not None:
                    self._coordinate(fj, now, dirty[name])

    def tick(self, now: float) -> None:
        for fj in self.jobs.values():
            if (fj.attempt is not None and now - fj.attempt.started >= PREPARE_TIMEOUT) or (
                    fj.retry_at and now >= fj.retry_at):
                if fj.retry_at and now >= fj.retry_at:
                    fj.retry_at = 0.0
                self._mark(fj.name)
        if now >= self._next_force:  # a full comparison now and then, whatever marked the registry
            self._next_force = now + self.bus.cfg.heartbeat_interval
            self._force_sync = True

    def next_deadline(self) -> float | None:
        times = [t for fj in self.jobs.values() for t in (
            fj.attempt.started + PREPARE_TIMEOUT if fj.attempt is not None else None, fj.retry_at or None) if t]
        return min(times) if times else None

    # ------------------------------------------------------------------- status
    def job_info(self, name: str) -> dict:
        fj = self.jobs.get(name)
        job = self.reg.job_facts(name)
        return {
            "coordinator": self.coordinator(name),
            "nodes": sorted((self.holders(name) - (fj.lost if fj is not None else set()))
                            | ({self.node} if fj is not None and self.node in fj.views else set())),
            "lost_nodes": sorted(fj.lost) if fj is not None else [],
            "tentative": fj is not None and job is not None and not job.confirmed,
            "rendezvous_count": job.rendezvous_count if job is not None else None,
            # this node's latest report of the job: its daemon instance and number
            "report": [self.bus.boot.hex(), self._seq[name]] if name in self._sent else None,
        }

    def status(self) -> dict:
        lat = sorted(self.coordinated)
        return {
            "jobs": len(self.jobs),
            "coordinating": sorted(n for n in self.jobs if self.coordinator(n) == self.node),
            "coordinated_rendezvous_ms": {
                "count": len(lat),
                "p50": round(lat[len(lat) // 2] * 1e3, 3) if lat else None,
                "max": round(lat[-1] * 1e3, 3) if lat else None,
                "last": round(self.coordinated[-1] * 1e3, 3) if lat else None,
            },
            "peer_reports": {n: {"jobs": len(h), "bytes": self._held_bytes.get(n, 0)} for n, h in self._held.items()},
            **self.counters,
        }


_HANDLERS = {
    "job": Federation._on_job,
    "sync": Federation._on_sync,
    "decide": Federation._on_decide,
    "refuse": Federation._on_refuse,
    "refuse_rank": Federation._on_refuse_rank,
    "prepare": Federation._on_prepare,
    "prepared": Federation._on_prepared,
    "release": Federation._on_release,
    "destroy": Federation._on_destroy,
}
