"""The data plane's decisions as pure functions (docs/PROTOCOL.md, "A round in a degrade job"
and "Failure reporting").

A plane reads the workspace and the control block (flags, mask words, view words, rounds)
and asks these functions what to do with what it read: whom a wait lets go, what a combine
publishes to whom, whether a rank it pulled from went on without it. Masks are Python ints
(rank q: bit q). Nothing here reads memory, a clock or a tensor, so the host plane
(``a2ad.client.host_plane``) and the simulator's data-plane world (``a2ad.sim.plane``) run the
very same decisions; the CUDA kernels (``csrc/``) implement the same rules in device code and
must be kept in step with this module by hand (docs/PROTOCOL.md says where they differ today:
they do not narrow their published view, and their combine waits for exactly its round).

Each place where a historical bug was carries an :func:`a2ad.mutations.active` check that
re-introduces it when the simulator or a test asks (``a2ad.mutations``); off by default.
"""

from __future__ import annotations

from a2ad import mutations as _mut


def lowest(mask: int) -> int:
    """The lowest rank of ``mask``, or -1."""
    return (mask & -mask).bit_length() - 1 if mask else -1


# --- waits (dispatch step 6, combine step 3) ---------------------------------------------
def waiting_for(view: int, unset: int) -> int:
    """The ranks of the round (``view``) whose flag has not come: ``unset`` is the set of ranks
    whose flag (one per rank, in this rank's row) is not the round's."""
    return view & unset


def past_round_is_seen(degrade: bool, combine: bool) -> bool:
    """Whether a wait counts a flag past its round as seen (else it waits for exactly the round).

    Only a degrade combine does: a target that let this rank go in its next dispatch (this
    rank's bit was cleared there while this rank was still in this round's combine) sends it
    the next round's flag with the void descriptor, over the flag of this round that this
    rank has not read yet. That target finished this round and restaged its region: this rank
    counts nothing from it (:func:`combine_counted`) instead of waiting for a flag that is gone.
    No other flag can run ahead of its reader: a dispatch flag of R + 1 goes only to the ranks
    of the sender's view of R + 1, which finished R with it, and a real combine flag of R + 1
    only to a source whose tokens of R + 1 came."""
    if _mut.active("void_flag_overruns_wait"):
        return False
    return degrade and combine


def all_left(view: int, waiting: int, second_look: int) -> int:
    """A degraded wait whose ranks still waited for (``waiting``, from the first read of the
    flags) have all left the mask (read after those flags): the sources counted as seen.

    ``second_look``: the ranks of ``view`` whose flag is still not the round's when read once
    more after the mask. A rank that published its flag, finished the round and left between
    the two reads counts (what it published is complete); the others are let go."""
    if _mut.active("wait_no_second_look_mask"):
        return view & ~waiting
    return view & ~(waiting & second_look)


def completes_after_give_up(view: int, second_look: int) -> bool:
    """A wait that found the abort word set or its timeout passed (read after its flags): True
    when the flags read once more (``second_look``: the ranks of ``view`` whose flag is still
    not the round's) show every rank of the round there, so the wait completes with all of
    ``view`` instead of giving up (a peer may have published, finished and left, setting the
    abort word, between the two reads)."""
    if _mut.active("wait_no_second_look"):
        return False
    return not (view & second_look)


# --- combine (steps 2 and 3) ------------------------------------------------------------
def combine_publish(view: int, received: int) -> tuple[int, int]:
    """(the targets that get this combine's flag with its outputs, those that get it with the
    void descriptor). ``view``: the round's ranks (this rank's dispatch view, ANDed with a
    caller's mask); ``received``: the sources whose tokens the dispatch received (``S_d``).

    Outputs go only to the sources whose tokens came: the rows staged for another one were
    computed from whatever its slots held. In a degrade job such a source (let go of because
    it left the mask, yet maybe alive: its node counted lost while it ran, or its bit back by
    the next round) gets its flag with the void descriptor, so that its combine counts nothing
    from this rank and ends, rather than waiting for a flag that never comes. In a raise job
    the dispatch never lets a source go (its wait completes or raises), so nothing is void
    there."""
    if _mut.active("publish_to_unreceived"):
        return view, 0
    publish = view & received
    void = view & ~publish
    if _mut.active("void_flag_withheld"):
        void = 0
    return publish, void


def combine_counted(seen: int, voided: int, disagree: int, ahead: int = 0) -> tuple[int, int]:
    """(the combine's view ``S_c``, the targets whose rows are summed). ``seen``: the targets
    whose flag the wait saw; ``voided``: those of them whose descriptor is void (they let this
    rank go in their dispatch); ``ahead``: those whose flag was past the round (they let this
    rank go in their next dispatch, :func:`past_round_is_seen`); ``disagree``: those whose
    descriptor is neither void nor this rank's (their rows lie elsewhere: nothing is read from
    them, the round raises InputError)."""
    got = seen & ~voided & ~ahead
    return got, got & ~disagree


def published_view(published: int, view: int, received: int) -> int:
    """The view a degrade rank leaves in its row (``SLOT_VIEW``) once its dispatch wait ended,
    before it restages its combine region: the view it published at the start of the round
    (``published``) less the ranks of the round (``view``) that the wait let go of (not in
    ``received``). A rank let go of while alive may still be pulling this rank's region of the
    round before; its left-behind check must then find itself outside this round's view,
    though the view read at the round's start held it."""
    if _mut.active("view_not_narrowed"):
        return published
    return published & ~(view & ~received)


# --- a replacement's admission (dispatch step 0, and step 1's lowest rank) ----------------
def lets_in(me: int, view: int) -> bool:
    """Whether this rank lets in, at its round's start, the replacements that asked: it is
    the lowest rank of its round's view. (It writes their admit round, R + 1, before anything
    else of round R: nobody can start R + 1 before its combine flag of R.)"""
    return lowest(view) == me


def lagging(me: int, admit_view: int, behind: int, same_round: int) -> int:
    """The ranks a replacement let in at round E still waits for before its first round: those
    of ``admit_view`` (the effective mask of E) other than itself that have not finished round
    E - 1 (``behind``: their ``FLAG_VAL`` is below E), except the ranks let in at E themselves
    (``same_round``: they took no part in E - 1; two replacements let in together would
    otherwise wait for each other)."""
    if _mut.active("admitted_together_wait"):
        return admit_view & behind & ~(1 << me)
    return admit_view & behind & ~(1 << me) & ~same_round


# --- the left-behind check (combine step 4; on CUDA, the next round's prologue) -----------
def left_behind_candidates(me: int, counted: int) -> int:
    """The ranks whose round and view the check reads: every rank pulled from but this one."""
    return counted & ~(1 << me)


def view_needed(rnd: int, view_round: int) -> bool:
    """Whether the check must read the view word of a rank that published ``view_round``
    (only at ``rnd + 1``: a later round decides by itself, an earlier one is no news)."""
    return view_round == rnd + 1


def went_on_without(rnd: int, me: int, view_round: int, view: int | None) -> bool:
    """Whether a rank this combine of round ``rnd`` pulled from went on without this rank: its
    round read after the pull, ``view_round``, is past ``rnd + 1``, or ``rnd + 1`` with this rank
    outside its view of that round (``view``, read after the round; it is that round's, since
    the rank cannot finish ``rnd + 1`` with this rank in its view before this rank's next
    dispatch). It may then have restaged its combine region while this rank pulled it: this
    round's output is void (``STATUS_LEFT_BEHIND``)."""
    if _mut.active("left_behind_unchecked"):
        return False
    if view_round >= rnd + 2:
        return True
    if view_round == rnd + 1:
        if view is None:
            raise ValueError("the view word is needed at rnd + 1 (view_needed)")
        return not (view >> me) & 1
    return False
