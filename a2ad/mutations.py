"""Known historical bugs that the code can re-introduce on demand, to prove that the simulator
(``python -m a2ad.sim``) and the tests catch them.

Each mutation is a name, the simulator world that catches it, the commit that fixed it and a
line saying what it does. The code checks :func:`active` at the exact place the bug was; every
mutation is off unless enabled, either for a block of code (:func:`enabled`, what the simulator
and the tests use) or for a whole process through the environment variable ``A2AD_MUTATION``
(one name, or several separated by commas), read once at import. :func:`active` costs one test
of an empty frozenset when nothing is enabled.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Mutation:
    name: str
    world: str  # the simulator world that catches it
    description: str  # one line
    fixed_in: str = ""  # the commit that fixed the bug


REGISTRY: dict[str, Mutation] = {}


def register(name: str, world: str, description: str, fixed_in: str = "") -> Mutation:
    """Add a mutation (idempotent for the same name and world)."""
    old = REGISTRY.get(name)
    if old is not None and old.world != world:
        raise ValueError(f"mutation {name!r} is already registered for world {old.world!r}")
    m = REGISTRY[name] = Mutation(name, world, description, fixed_in)
    return m


def _from_env() -> frozenset[str]:
    raw = os.environ.get("A2AD_MUTATION", "")
    return frozenset(n.strip() for n in raw.split(",") if n.strip())


_active: frozenset[str] = _from_env()


def active(name: str) -> bool:
    """Whether the historical bug ``name`` is to be re-introduced here (off by default)."""
    return bool(_active) and name in _active


def enabled_names() -> frozenset[str]:
    return _active


@contextlib.contextmanager
def enabled(name: str | None) -> Iterator[None]:
    """Re-introduce mutation ``name`` inside the block (``None``: none; the block still runs
    with no mutation enabled from outside it). Single-threaded use only: the simulator's."""
    global _active
    if name is not None and name not in REGISTRY:
        raise KeyError(f"unknown mutation {name!r} (known: {', '.join(sorted(REGISTRY)) or 'none'})")
    saved = _active
    _active = frozenset() if name is None else frozenset({name})
    try:
        yield
    finally:
        _active = saved


# --- the data plane's (a2ad.planerules; caught by the simulator's "plane" world) -------------
register(
    "void_flag_withheld", "plane",
    "a degrade combine withholds its flag from a source its dispatch let go of (instead of the void "
    "descriptor): that source, alive, waits for a flag that never comes", "626bfa6")
register(
    "publish_to_unreceived", "plane",
    "a degrade combine publishes its outputs to every source of its view, also to one whose tokens its "
    "dispatch never received: that source sums rows computed from nothing", "97187f3")
register(
    "left_behind_unchecked", "plane",
    "a degrade combine does not check after its pull that the ranks it pulled from did not go on without "
    "it: it returns rows restaged under it for the next round", "97187f3")
register(
    "wait_no_second_look", "plane",
    "a wait that finds the abort word set gives up without reading its flags once more: a peer that "
    "published, finished and left between the two reads is taken for lost", "3e051e8")
register(
    "wait_no_second_look_mask", "plane",
    "a degraded wait whose missing ranks all left the mask lets them go without reading their flags once "
    "more: a peer that published and left between the two reads counts for nothing", "995bb29")
register(
    "view_not_narrowed", "plane",
    "a degrade rank whose dispatch let a source go leaves the view read at the round's start in its row: "
    "that source, still pulling the round before, does not see that its region was restaged", "e4c1b84")
register(
    "void_flag_overruns_wait", "plane",
    "a degrade combine waits for exactly its round's flag: a target's void flag of the next round, written "
    "over the flag not yet read, leaves it waiting until its timeout", "e4c1b84")
register(
    "admitted_together_wait", "plane",
    "a replacement let in at round E waits for every other rank of E to finish E - 1, also for another "
    "replacement let in at E, which never ran E - 1: the two wait for each other until their timeout", "9dfdb18")


# --- the daemon's core (a2ad.daemon.core; caught by the simulator's "daemon" world) ---------
register(
    "own_rank_refused", "daemon",
    "a process whose redeem went unanswered (its daemon went after recording it, or an upgrade reset it) joins "
    "again and is refused rank_taken as held by its own pid; "
    "the daemon keeps the rank attached with no lease for as long as the process lives")
register(
    "leave_any_uid", "daemon",
    "a leave is obeyed whoever presents the lease token: another uid that got hold of it ends the rank")
register(
    "uid_fds_undercount", "daemon",
    "the per-uid fd cap counts one descriptor per control block while the daemon holds two (its memfd and "
    "the one its mapping keeps), so one user gets past the budget")
register(
    "generation_from_record", "daemon",
    "a daemon re-adopting a job takes its generation from the state record even when the control block shows "
    "a later re-arm (one the state file could not hold): the ranks ran that generation, and the next re-arm "
    "reuses it")
register(
    "handles_before_record", "daemon",
    "a redeemed join's rank is recorded attached only once its handles went out, and the state file is "
    "written at the end of the server's turn: a daemon killed in between comes back with the rank joining "
    "(so free) while its process holds the handles and runs")
register(
    "lines_word_unchecked", "daemon",
    "a join whose client says nothing of the lines tails (a client of a release before them) is let into a "
    "job whose rows have one: in its rounds the peers wait for lines it never writes, and it reads rows they "
    "never staged")
register(
    "held_failed_on_stop", "daemon",
    "a daemon stopped (SIGTERM) while a job without attached ranks holds joins frees the job and ends the "
    "held joins with JobDestroyed; their clients give up, where they could have joined the next daemon",
    "caa20de")


# --- the domain protocol (a2ad.daemon.core; caught by the simulator's "domain" world) -------
register(
    "rearm_lost_to_joining_report", "domain",
    "a node counted lost before it reported its ranks attached resyncs with the report that still says "
    "joining; applying it drops the mark 'lost with its node', so the next report (attached) never re-arms "
    "the job and its ranks wait until their timeout", "cf52f1a")
register(
    "loss_count_ignored", "domain",
    "a node counted lost by a peer whose link never dropped (it stalled) ignores the peer's growing loss "
    "count in its heartbeats and never sends its reports again: the peer keeps its ranks dead", "0e14210")
register(
    "domain_job_freed_on_stop", "domain",
    "a daemon stopped (SIGTERM) frees a job of the domain that has no rank attached on its node, though its "
    "joins there were reported: the coordinator releases the rendezvous with the freed rows, and the job the "
    "re-sent joins make on the next daemon is released at the same generation with other rows")
register(
    "decide_from_anyone", "domain",
    "a daemon takes a job's decide, prepare, release or refusal from any node of the domain, not only from "
    "the job's coordinator")
register(
    "lost_mark_not_kept", "domain",
    "a remote rank counted dead because its node was lost is written to the state file without that mark: a "
    "daemon restarted before the node is heard again takes the rank for dead for good, and the job's nodes "
    "keep different masks")
register(
    "readmit_unseen_by_rankless_node", "domain",
    "a replacement let back into a degrade job by its node while no other node has live ranks of the job is "
    "answered at once, so no report of it says readmit: a node whose ranks come back later never sets its "
    "bit, and the two nodes serve with different masks")
register(
    "rejoin_after_undelivered_unseen", "domain",
    "such a replacement whose first handles were not delivered joins again as the same process: the other "
    "nodes take it for the one they counted gone by mistake, never let it back in, and serve without it")
register(
    "gate_deafness_counted", "domain",
    "a daemon counts the time its own domain gate did not run (a fresh gate starved of CPU) as the silence of "
    "the nodes it has not heard yet: a restarted daemon counts live nodes lost and a degrade job re-arms")
