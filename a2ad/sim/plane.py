"""The data-plane world: M ranks (2-8) of one job over 1-3 nodes run rounds through a model of
the workspace (docs/PROTOCOL.md), every decision taken by ``a2ad.planerules``, while the
scheduler interleaves their steps and injects faults.

What is modelled:

- each rank's row: ``FLAG_VAL``, its dispatch flags and received data per source, its combine
  flags and descriptors (real or void) per target, the combine region it staged per source, its
  published view and view round (``SLOT_VIEW``, ``SLOT_VIEW_ROUND``). Data is a tag saying whose
  tokens of which round (and job generation) it is, so a rank's output can be traced to what it
  was computed from;
- one control block per node (mask, abort word); a rank reads its own node's;
- a rank step is one read or one write of the protocol (a flag, a mask, a staged region, a view
  word), now and then descheduled for a while; a pull of one target's rows spans time (read at
  its start and at its end); a wait polls with a doubling pause and is bounded by its timeout;
- faults: a rank killed, or several at once (its node's daemon clears its bit in every node's
  block, one hop each, in a degrade job, or sets the abort word in a raise job; a replacement
  joins later: in a degrade job it is let in at a round boundary while the others serve, its
  row's aux fields re-initialized, its bit set on every node before its join is answered, its
  admit round in its row, PROTOCOL.md "Jobs that span nodes"; else through the re-arm), a rank
  stalled (SIGSTOP-like), a node counted lost while its ranks run (its ranks' bits cleared, or
  the abort word set, in the other nodes' blocks only; once heard again the job re-arms), a
  node starved (some of its ranks stalled, then the node counted lost);
- the job-wide re-arm: every rank that raised calls recover(); once every rank is there, the
  rows are reset, the masks made full and the ranks released at round 1 of a new generation.

What is not: payload bytes and routing (every rank sends tokens to every rank of its view),
caller masks, the control block's own admit rounds (every admit round is in the rank's row, as
in a job that spans nodes), the daemons' own protocol (the daemon world's), memory ordering
finer than a step.

Invariants, each checked at the step that can break it:

- ``foreign_outputs``: no rank completes a round with outputs not computed for it (pulled rows
  staged from another source's tokens, another round's, or nothing);
- ``dispatch_data``: a source whose flag a dispatch counted delivered that round's tokens;
- ``hang``: no wait waits for a flag of a peer which finished that round with the waiter in its
  view that is not there (never published, or written over), and no replacement waits for
  another let in at the same round: such a wait can end only by its timeout;
- ``flag_discarded``: a wait never lets go of, or gives up on, a peer whose flag is there when it
  decides;
- ``wait_bound``: every wait ends with a typed outcome within its timeout plus one pause, not
  counting the time its rank was stalled or descheduled;
- ``views_converge``: after the last fault is resolved, every rank completes a round with the
  full view, every rank counted, within :func:`converge_bound`.
"""

from __future__ import annotations

from typing import Optional

from a2ad import layout as L, mutations, planerules as rules

from .sched import Scheduler
from .world import Outcome, Violation, register

WORLD = "plane"

TIMEOUT = 40.0  # a wait's timeout (fake time units)
FIRST_PAUSE = 0.5
MAX_PAUSE = 3.0
STEP_MAX = 1.0  # a step takes U(0.02, STEP_MAX)
PREEMPT, PREEMPT_MAX = 0.03, 10.0  # a step is descheduled with this chance, for up to this long
PULL_MAX = 4.0  # a pull of one target's rows spans U(0.1, PULL_MAX)
FAULTS_UNTIL = 60.0  # faults start in [1, FAULTS_UNTIL]


def round_bound(m: int) -> float:
    """A round of m ranks that waits for nobody takes at most about this long: its steps (a
    view, a publish per rank and phase, a few polls, the left-behind reads), its pulls."""
    return (4 * m + 16) * STEP_MAX + m * PULL_MAX


def converge_bound(m: int) -> float:
    """After the last fault is resolved, every rank completes a full round within this: a wait
    still running out its timeout, the re-arm it asks for, then rounds (one to reach the
    abort word, one to complete)."""
    return TIMEOUT + 3 * round_bound(m)

REAL, VOID = 1, 2


class Row:
    __slots__ = ("flag_val", "dflag", "data", "cflag", "cdesc", "comb", "view", "view_round", "admit")

    def __init__(self, m: int, admit: int = 0):
        self.admit = admit  # the rank's admit round (SLOT_ADMIT_ROUND): 0, or a replacement's
        self.flag_val = 1
        self.dflag = [0] * m  # [source]: the round of its dispatch flag
        self.data = [None] * m  # [source]: (source, round, generation) of the tokens in its region
        self.cflag = [0] * m  # [target]: the round of its combine flag
        self.cdesc = [0] * m  # [target]: REAL or VOID
        self.comb = [None] * m  # [source]: (round, generation, what it was computed from)
        self.view = 0
        self.view_round = 0


class Block:
    __slots__ = ("mask", "abort")

    def __init__(self, full: int):
        self.mask = full
        self.abort = False


def _ranks(mask: int):
    q = 0
    while mask:
        if mask & 1:
            yield q
        mask >>= 1
        q += 1


class Rank:
    """One process of rank ``r``: a generator whose every step is one access to shared state."""

    def __init__(self, w: "PlaneWorld", r: int, joins: bool):
        self.w, self.r = w, r
        self.dead = False
        self.parked = False
        self.wait: Optional[tuple] = None  # (phase, round, start)
        self.off = 0.0  # time spent stalled or descheduled during the current wait
        self.views: dict[tuple[int, int], int] = {}  # (generation, round) -> this process's view of it
        self.gen = self._body(joins)

    def dt(self) -> float:
        d = self.w.dt()
        if d > STEP_MAX:
            self.off += d - STEP_MAX
        return d

    def step(self) -> None:
        w = self.w
        if self.dead:
            return
        until = w.stalled_until[self.r]
        if until > w.s.now:
            self.off += until - w.s.now
            w.s.at(until, self.step)
            return
        try:
            d = next(self.gen)
        except StopIteration:
            return
        if d is None:
            self.parked = True
            w.try_release()
        else:
            w.s.after(d, self.step)

    # --- the rank's life ---------------------------------------------------------------
    def _body(self, joins: bool):
        if joins:
            yield from self._recover("joined")
        while True:
            err = yield from self._round()
            if err is not None:
                yield from self._recover(err)

    def _recover(self, why: str):
        w = self.w
        w.s.log(f"r{self.r}", f"recover ({why})")
        w.recovering.add(self.r)
        w.request_rearm(f"r{self.r} {why}")
        yield None  # parked until the re-arm releases every rank

    def _round(self):
        w, r, s = self.w, self.r, self.w.s
        dt = self.dt
        rows, row = w.rows, w.rows[r]
        blk = w.blocks[w.node_of[r]]
        gen = w.generation
        yield dt()
        if blk.abort:
            return "aborted (abort word at dispatch)"
        rnd = row.flag_val
        if w.degrade:
            yield dt()
            admit = row.admit
            if admit < 0 or admit > rnd:  # a replacement's first dispatch: its admission
                rnd = yield from self._admission(admit)
                if isinstance(rnd, str):
                    return rnd
        yield dt()
        view = w.effective(blk, rnd) if w.degrade else w.full
        if not (view >> r) & 1:
            return "not active"
        if w.degrade and rules.lets_in(r, view):
            for q in _ranks(blk.mask & ~view):
                yield dt()
                if rows[q].admit == L.ADMIT_READY:
                    rows[q].admit = rnd + 1
                    s.log(f"r{r}", f"lets r{q} in at round {rnd + 1}")
        if w.degrade:
            yield dt()
            row.view, row.view_round = view, rnd  # the view, then its round
        self.views[(gen, rnd)] = view
        s.log(f"r{r}", f"dispatch R={rnd} view={view:#x}")
        for q in w.shuffled(view):
            yield dt()
            rows[q].data[r] = (r, rnd, gen)
            rows[q].dflag[r] = rnd
        got = yield from self._wait("dispatch", row.dflag, rnd, view)
        if isinstance(got, str):
            return got
        if w.degrade and got != view:  # the sources let go of leave the published view
            yield dt()
            row.view = rules.published_view(row.view, view, got)
        recv = {}
        for q in _ranks(got):
            d = row.data[q]
            if d != (q, rnd, gen):
                w.violate("dispatch_data", f"r{r} counted r{q}'s dispatch flag of round {rnd} (generation {gen}) "
                          f"but its region holds {d}")
            recv[q] = d
        yield dt()  # stage: the expert outputs for every source, from what came (None: nothing)
        for q in range(w.m):
            row.comb[q] = (rnd, gen, recv.get(q))
        publish, void = rules.combine_publish(view, got)
        s.log(f"r{r}", f"combine R={rnd} got={got:#x} publish={publish:#x} void={void:#x}")
        for q in w.shuffled(publish | void):
            yield dt()
            rows[q].cdesc[r] = VOID if (void >> q) & 1 else REAL
            rows[q].cflag[r] = rnd
        seen = yield from self._wait("combine", row.cflag, rnd, view)
        if isinstance(seen, str):
            return seen
        yield dt()
        voided = ahead = 0
        for q in _ranks(seen):
            if row.cflag[q] > rnd:
                ahead |= 1 << q
            elif row.cdesc[q] == VOID:
                voided |= 1 << q
        got_c, counted = rules.combine_counted(seen, voided, 0, ahead)
        pulled = {}
        for q in w.shuffled(counted):  # a pull spans time: its rows are read from first to last
            yield dt()
            first = rows[q].comb[r]
            yield w.rng.uniform(0.1, PULL_MAX)
            last = rows[q].comb[r]
            pulled[q] = first if first == last else ("torn", first, last)
        yield dt()
        row.flag_val = rnd + 1
        if w.degrade:
            for q in _ranks(rules.left_behind_candidates(r, counted)):
                yield dt()
                vr = rows[q].view_round
                qview = None
                if rules.view_needed(rnd, vr):
                    yield dt()
                    qview = rows[q].view
                if rules.went_on_without(rnd, r, vr, qview):
                    s.log(f"r{r}", f"left behind by r{q} (its round {vr})")
                    return f"left behind by r{q}"
        want = (rnd, gen, (r, rnd, gen))
        for q, got_rows in sorted(pulled.items()):
            if got_rows != want:
                w.violate("foreign_outputs", f"r{r} completed round {rnd} (generation {gen}) with r{q}'s rows "
                          f"staged as {got_rows}, not computed from its own tokens of that round {want}")
        s.log(f"r{r}", f"done R={rnd} counted={counted:#x}")
        w.completed[r] = (s.now, gen, view, got_c)

    def _admission(self, admit: int):
        """Ask to be let in, wait for the round E the lowest rank picks, then for the others of
        E to finish E - 1 (PROTOCOL.md, dispatch step 0): returns E or a failure name."""
        w, r, s = self.w, self.r, self.w.s
        dt, row, blk = self.dt, w.rows[r], w.blocks[w.node_of[r]]
        if admit == L.ADMIT_JOINED:
            yield dt()
            row.admit = L.ADMIT_READY
            s.log(f"r{r}", "asks to be let in")
        self.wait = ("admission", admit, s.now)
        self.off = 0.0
        deadline = s.now + TIMEOUT
        pause = FIRST_PAUSE
        while True:
            yield dt()
            e = row.admit
            peer = -1
            if e >= 0:
                yield dt()
                admit_view = w.effective(blk, e)
                behind = same = 0
                for q in range(w.m):
                    if w.rows[q].flag_val < e:
                        behind |= 1 << q
                    if w.rows[q].admit == e:
                        same |= 1 << q
                lag = rules.lagging(r, admit_view, behind, same)
                if not lag:
                    yield dt()
                    row.flag_val = e
                    s.log(f"r{r}", f"let in at round {e}")
                    w.check_wait_bound(self)
                    self.wait = None
                    return e
                peer = rules.lowest(lag)
                w.check_admission_hang(r, e, lag)
            yield dt()
            code = "aborted" if blk.abort else "timeout" if s.now >= deadline else None
            if code is not None:
                s.log(f"r{r}", f"admission {code} (waiting for r{peer}, admit round {e})")
                w.check_wait_bound(self)
                self.wait = None
                return f"admission {code} (r{peer}, admit round {e})"
            yield pause
            pause = min(2 * pause, MAX_PAUSE)

    def _wait(self, phase: str, flags: list, rnd: int, view: int):
        """A bounded wait until flags[q] == rnd for every q of ``view`` (PROTOCOL.md, dispatch step 6,
        combine step 3): returns the ranks seen, or a failure name."""
        self.wait = (phase, rnd, self.w.s.now)
        self.off = 0.0
        out = yield from self._poll(phase, flags, rnd, view)
        self.w.check_wait_bound(self)
        self.wait = None
        return out

    def _poll(self, phase: str, flags: list, rnd: int, view: int):
        w, r, s = self.w, self.r, self.w.s
        dt = self.dt
        blk = w.blocks[w.node_of[r]]
        deadline = s.now + TIMEOUT
        pause = FIRST_PAUSE
        past_ok = rules.past_round_is_seen(w.degrade, phase == "combine")

        def unset() -> int:
            out = 0
            for q in _ranks(view):
                if flags[q] < rnd if past_ok else flags[q] != rnd:
                    out |= 1 << q
            return out

        while True:
            yield dt()
            waiting = rules.waiting_for(view, unset())
            if not waiting:
                return view
            if w.degrade:
                yield dt()
                peer = rules.lowest(waiting & w.effective(blk, rnd))  # the lowest still in M(rnd)
                if peer < 0:
                    yield dt()
                    got = rules.all_left(view, waiting, unset())
                    let_go = view & ~got & ~unset()
                    if let_go:
                        w.violate("flag_discarded", f"r{r}'s {phase} wait of round {rnd} let go of "
                                  f"{_names(let_go)}, whose flag was there")
                    s.log(f"r{r}", f"{phase} R={rnd} let go of {_names(view & ~got)}")
                    return got
            w.check_hang(r, phase, rnd, waiting, flags, past_ok)
            yield dt()
            code = "aborted" if blk.abort else "timeout" if s.now >= deadline else None
            if code is not None:
                if rules.completes_after_give_up(view, unset()):
                    return view
                if not unset():
                    w.violate("flag_discarded", f"r{r}'s {phase} wait of round {rnd} gave up ({code}) with "
                              "every flag of its view there")
                peer = rules.lowest(waiting)
                s.log(f"r{r}", f"{phase} R={rnd} {code} waiting for r{peer}")
                return f"{phase} {code} (r{peer}, round {rnd})"
            yield pause
            pause = min(2 * pause, MAX_PAUSE)


def _names(mask: int) -> str:
    return ",".join(f"r{q}" for q in _ranks(mask)) or "-"


class PlaneWorld:
    def __init__(self, seed: int):
        s = self.s = Scheduler(seed)
        rng = self.rng = s.rng
        self.m = m = rng.randint(2, 8)
        self.nodes = n = rng.randint(1, min(3, m))
        cuts = sorted(rng.sample(range(1, m), n - 1)) if n > 1 else []
        bounds = [0] + cuts + [m]
        self.node_of = [0] * m
        self.node_ranks = [0] * n
        for b in range(n):
            for q in range(bounds[b], bounds[b + 1]):
                self.node_of[q] = b
                self.node_ranks[b] |= 1 << q
        self.degrade = rng.random() < 0.8
        self.full = (1 << m) - 1
        self.generation = 1
        self.rows = [Row(m) for _ in range(m)]
        self.blocks = [Block(self.full) for _ in range(n)]
        self.stalled_until = [0.0] * m
        self.procs = [Rank(self, q, joins=False) for q in range(m)]
        self.recovering: set[int] = set()
        self.rearm_pending = False
        self.release_scheduled = False
        self.completed: list[Optional[tuple]] = [None] * m
        self.violations: list[Violation] = []
        self.faults = 0
        self.quiet_from = 0.0
        s.log("world", f"{m} ranks over {n} node(s) {[_names(x) for x in self.node_ranks]}, "
              f"{'degrade' if self.degrade else 'raise'} job")

    # --- helpers ---------------------------------------------------------------------
    def dt(self) -> float:
        rng = self.rng
        if rng.random() < PREEMPT:  # descheduled for a while (a loaded machine)
            return rng.uniform(STEP_MAX, PREEMPT_MAX)
        return rng.uniform(0.02, STEP_MAX)

    def shuffled(self, mask: int) -> list[int]:
        out = list(_ranks(mask))
        self.rng.shuffle(out)
        return out

    def effective(self, blk: Block, rnd: int) -> int:
        """M(rnd) as a rank of ``blk``'s node reads it: the bits set there whose admit round
        (in their rows, as in a job that spans nodes) is in [0, rnd]."""
        out = 0
        for q in _ranks(blk.mask):
            if 0 <= self.rows[q].admit <= rnd:
                out |= 1 << q
        return out

    def violate(self, invariant: str, detail: str) -> None:
        self.s.log("CHECK", f"VIOLATION {invariant}: {detail}")
        self.violations.append(Violation(invariant, detail, self.s.now))

    def resolved(self, when: float) -> None:
        self.quiet_from = max(self.quiet_from, when)

    # --- invariants checked from the ranks' steps ----------------------------------------
    def check_hang(self, r: int, phase: str, rnd: int, waiting: int, flags: list, past_ok: bool) -> None:
        for q in _ranks(waiting):
            missing = flags[q] < rnd if past_ok else flags[q] != rnd
            p = self.procs[q]  # (a replacement's rounds start past its predecessor's)
            if missing and self.rows[q].flag_val > rnd and (p.views.get((self.generation, rnd), 0) >> r) & 1:
                self.violate("hang", f"r{r}'s {phase} wait of round {rnd} waits for r{q}, which finished that "
                             f"round with r{r} in its view, and its {phase} flag of that round is not in r{r}'s "
                             f"row (never published, or written over: {flags[q]}): only the timeout can end it")

    def check_admission_hang(self, r: int, e: int, lag: int) -> None:
        for q in _ranks(lag):
            p = self.procs[q]
            if self.rows[q].admit == e and p.wait is not None and p.wait[0] == "admission" and not p.dead:
                self.violate("hang", f"r{r}, let in at round {e}, waits for r{q} to finish round {e - 1}, but r{q} "
                             f"was let in at {e} too and waits for its own admission: only the timeout can end it")

    def check_wait_bound(self, p: Rank) -> None:
        if p.wait is None:
            return
        phase, rnd, start = p.wait
        ran = self.s.now - start - p.off  # the time it was not stalled or descheduled
        if ran > TIMEOUT + MAX_PAUSE + 4 * STEP_MAX:
            self.violate("wait_bound", f"r{p.r}'s {phase} wait of round {rnd} ran {ran:.1f} (and was stopped "
                         f"{p.off:.1f}), past its timeout {TIMEOUT}")

    # --- the daemons: losses, re-arms -----------------------------------------------------
    def hop(self) -> float:
        return self.rng.uniform(0.05, 6.0)

    def request_rearm(self, why: str) -> None:
        if self.rearm_pending:
            return
        self.rearm_pending = True
        self.s.log("daemon", f"re-arm: {why}")
        for q, p in enumerate(self.procs):
            if p.parked and not p.dead and q not in self.recovering:  # a held join: the re-arm answers it
                self.recovering.add(q)
        for b in range(self.nodes):
            self.s.after(self.hop(), lambda b=b, g=self.generation: self._abort(b, g))

    def _abort(self, b: int, gen: int) -> None:
        if self.generation == gen and self.rearm_pending:
            self.blocks[b].abort = True
            self.s.log("daemon", f"node {b}: abort word set")

    def try_release(self) -> None:
        if not self.rearm_pending or self.release_scheduled:
            return
        if all(not p.dead and p.parked and q in self.recovering for q, p in enumerate(self.procs)):
            self.release_scheduled = True
            self.s.after(self.rng.uniform(0.2, 3.0), self._release)

    def _release(self) -> None:
        self.release_scheduled = False
        if not all(not p.dead and p.parked for p in self.procs):
            return
        self.generation += 1
        self.rows = [Row(self.m) for _ in range(self.m)]
        for blk in self.blocks:
            blk.mask, blk.abort = self.full, False
        self.rearm_pending = False
        self.recovering.clear()
        self.s.log("daemon", f"re-armed: generation {self.generation}, every rank released")
        for p in self.procs:
            p.parked = False
            self.s.after(self.rng.uniform(0.0, 1.0), p.step)

    # --- faults ------------------------------------------------------------------------
    def plan_faults(self) -> None:
        rng = self.rng
        kinds = ["kill", "stall", "kill_some"] + (["node_loss", "node_loss", "starved", "starved"]
                                                   if self.nodes > 1 else [])
        for _ in range(rng.choice((0, 1, 1, 2, 2, 3))):
            kind = rng.choice(kinds)
            t = rng.uniform(1.0, FAULTS_UNTIL)
            self.faults += 1
            if kind == "kill":
                q = rng.randrange(self.m)
                back = rng.uniform(10.0, 40.0)  # its replacement joins (its bit cleared everywhere by then)
                self.s.at(t, lambda q=q, back=back: self._kill(q, back))
                self.resolved(t + back + 10.0)
            elif kind == "kill_some":  # several ranks at once (a node's, or a machine's), replaced together
                b = rng.randrange(self.nodes)
                ranks = list(_ranks(self.node_ranks[b] if self.nodes > 1 else self.full))
                back = rng.uniform(10.0, 40.0)
                for q in rng.sample(ranks, rng.randint(1, len(ranks))):
                    d = back + rng.uniform(0.0, 3.0)
                    self.s.at(t, lambda q=q, d=d: self._kill(q, d))
                    self.resolved(t + d + 10.0)
            elif kind == "stall":
                q = rng.randrange(self.m)
                d = rng.uniform(0.5, 1.5 * TIMEOUT)
                self.s.at(t, lambda q=q, d=d: self._stall(q, d))
                self.resolved(t + d)
            elif kind == "starved":  # some of its ranks stop for a while, and the others count the node lost
                b = rng.randrange(self.nodes)
                ranks = list(_ranks(self.node_ranks[b]))
                for q in rng.sample(ranks, rng.randint(1, len(ranks))):
                    d = rng.uniform(0.5, 1.5 * TIMEOUT)
                    self.s.at(t, lambda q=q, d=d: self._stall(q, d))
                    self.resolved(t + d)
                t += rng.uniform(0.0, 30.0)
                d = rng.uniform(1.0, 1.5 * TIMEOUT)
                rearm = rng.uniform(0.1, 20.0)
                self.s.at(t, lambda b=b, d=d, rearm=rearm: self._node_loss(b, d, rearm))
                self.resolved(t + d + rearm + 10.0)
            else:
                b = rng.randrange(self.nodes)
                d = rng.uniform(1.0, 1.5 * TIMEOUT)
                rearm = rng.uniform(0.1, 20.0)  # heard again, then the job re-arms
                self.s.at(t, lambda b=b, d=d, rearm=rearm: self._node_loss(b, d, rearm))
                self.resolved(t + d + rearm + 10.0)

    def _kill(self, q: int, back: float) -> None:
        p = self.procs[q]
        if p.dead:
            return
        p.dead = True
        self.s.log("fault", f"r{q} killed")
        gen = self.generation
        seen = self.rng.uniform(0.05, 2.0)  # its daemon sees the lease end
        for b in range(self.nodes):
            d = seen + (0 if b == self.node_of[q] else self.hop())
            self.s.after(d, lambda b=b: self._dead_rank_applied(b, q, gen))
        self.s.after(back, lambda: self._replace(q))

    def _dead_rank_applied(self, b: int, q: int, gen: int) -> None:
        if self.generation != gen:
            return
        if self.degrade:
            self.blocks[b].mask &= ~(1 << q)
            self.s.log("daemon", f"node {b}: r{q}'s bit cleared")
        else:
            self.blocks[b].abort = True
            self.s.log("daemon", f"node {b}: abort word set (r{q} died)")
            self.request_rearm(f"r{q} died")

    def _replace(self, q: int) -> None:
        if not self.degrade or self.rearm_pending:  # back through a job-wide re-arm
            self.s.log("fault", f"r{q}'s replacement joins (re-arm)")
            p = self.procs[q] = Rank(self, q, joins=True)
            self.s.after(0.0, p.step)
            return
        # let in while the others serve: its row re-initialized, its bit set on every node,
        # its join answered once every node has set it
        self.s.log("fault", f"r{q}'s replacement joins (let in while the others serve)")
        new = Row(self.m, admit=L.ADMIT_JOINED)  # its aux region zeroed, its payload regions kept
        new.data, new.comb = self.rows[q].data, self.rows[q].comb
        self.rows[q] = new
        gen, left = self.generation, [self.nodes]
        p = self.procs[q] = Rank(self, q, joins=False)
        p.parked = True  # its join is held

        def bit_set(b: int) -> None:
            if self.generation != gen:
                return
            self.blocks[b].mask |= 1 << q
            self.s.log("daemon", f"node {b}: r{q}'s bit set")
            left[0] -= 1
            if left[0] == 0 and p.parked and not p.dead and q not in self.recovering:
                p.parked = False
                self.s.after(self.rng.uniform(0.0, 1.0), p.step)

        for b in range(self.nodes):
            self.s.after(self.hop(), lambda b=b: bit_set(b))

    def _stall(self, q: int, d: float) -> None:
        self.stalled_until[q] = max(self.stalled_until[q], self.s.now + d)
        self.s.log("fault", f"r{q} stalled for {d:.1f}")

    def _node_loss(self, b: int, d: float, rearm: float) -> None:
        gen = self.generation
        lost = self.node_ranks[b]
        self.s.log("fault", f"node {b} ({_names(lost)}) counted lost by the others while it runs, for {d:.1f}")
        for o in range(self.nodes):
            if o != b:
                self.s.after(self.hop(), lambda o=o: self._lost_applied(o, lost, gen))
        self.s.after(d + rearm, lambda: self.request_rearm(f"node {b} heard again"))

    def _lost_applied(self, o: int, lost: int, gen: int) -> None:
        if self.generation != gen:
            return
        if self.degrade:
            self.blocks[o].mask &= ~lost
            self.s.log("daemon", f"node {o}: bits of {_names(lost)} cleared")
        else:
            self.blocks[o].abort = True
            self.s.log("daemon", f"node {o}: abort word set ({_names(lost)} lost)")

    # --- one schedule ----------------------------------------------------------------------
    def run(self) -> Outcome:
        self.plan_faults()
        for p in self.procs:
            self.s.after(self.dt(), p.step)
        horizon = max(self.quiet_from, FAULTS_UNTIL) + converge_bound(self.m)
        self.s.run(horizon, lambda: not self.violations)
        if not self.violations:
            for p in self.procs:
                if p.wait is not None and not p.dead:
                    self.check_wait_bound(p)
            for q in range(self.m):
                c = self.completed[q]
                if c is None or c[0] < self.quiet_from or c[2] != self.full or c[3] != self.full:
                    self.violate("views_converge", f"r{q}'s last completed round {c} is not a full one after the "
                                 f"last fault was resolved ({self.quiet_from:.1f}); by {horizon:.1f}")
                    break
        return Outcome(WORLD, self.s.seed, self.s.steps, self.faults, self.violations, self.s.trace_lines())


@register(WORLD)
def run(seed: int, mutation: Optional[str] = None) -> Outcome:
    with mutations.enabled(mutation):
        return PlaneWorld(seed).run()
