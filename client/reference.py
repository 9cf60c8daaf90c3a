"""A single-process reference of MoE all-to-all dispatch and combine (pure torch, no workspace).

It computes, for a whole job at once, what every rank must receive in dispatch and
what every rank must get back from combine, following docs/PROTOCOL.md. It is
written for clarity, not speed (routing walks tokens one by one), and shares no
code with the data planes it checks: tests and ``a2ad demo`` hold the planes'
results against it.

Slot order within one (source, target) pair is unspecified by the protocol, so
received rows are compared per source as sets (:func:`same_rows`); the reference
itself assigns slots in token order, as the host plane does.

Degraded mode (docs/PROTOCOL.md, "Degraded mode"): :func:`dispatch` and :func:`combine`
take the ranks that count (``active``); :func:`lost_tokens` is the per-token indicator
that a combine with those ranks must return.

Also here: :func:`make_round`, the seeded inputs of one round for every rank, and
:func:`toy_expert`, a deterministic stand-in for the expert computation that uses
only what a rank received (so the end-to-end result is checkable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from a2ad import layout as L


@dataclass
class Routing:
    """Where one rank's tokens go (the TOPK_* scratch arrays of its workspace row).

    ``target``: ``[T, top_k]`` int32, the rank (t, k) is sent to, -1 for a repeat.
    ``slot``: ``[T, top_k]`` int32, the slot at that rank, -1 for a repeat.
    ``send_counts``: ``[ep_size]`` int32, tokens sent to each rank.
    """

    target: torch.Tensor
    slot: torch.Tensor
    send_counts: torch.Tensor


@dataclass
class Received:
    """What one rank holds after dispatch.

    ``payloads``: one ``[ep_size, rt, elements_per_token]`` tensor per input payload
    (source, slot); slots past a source's count are zero (the workspace leaves
    them undefined, so compare only ``[:recv_counts[s]]``).
    ``recv_counts``: ``[ep_size]`` int32, tokens each source sent here.
    ``source_token``: ``[ep_size, rt]`` int64, the token index at the source, -1 where empty.
    """

    payloads: list[torch.Tensor]
    recv_counts: torch.Tensor
    source_token: torch.Tensor


def route(experts: torch.Tensor, num_experts: int, ep_size: int) -> Routing:
    """Route one rank's ``[T, top_k]`` expert ids: a token goes at most once to each rank.

    Slots are given in token order, ``s = send_counts[target]++``.
    """
    rows = experts.tolist()
    top_k = experts.shape[1] if experts.dim() == 2 else 0
    target = [[-1] * top_k for _ in rows]
    slot = [[-1] * top_k for _ in rows]
    counts = [0] * ep_size
    for t, ids in enumerate(rows):
        seen = set()
        for k, e in enumerate(ids):
            if not 0 <= e < num_experts:
                raise ValueError(f"expert id {e} of token {t} is outside [0, {num_experts})")
            q = L.expert_owner(e, num_experts, ep_size)
            if q in seen:
                continue
            seen.add(q)
            target[t][k] = q
            slot[t][k] = counts[q]
            counts[q] += 1
    shape = (len(rows), top_k)
    return Routing(
        target=torch.tensor(target, dtype=torch.int32).reshape(shape),
        slot=torch.tensor(slot, dtype=torch.int32).reshape(shape),
        send_counts=torch.tensor(counts, dtype=torch.int32),
    )


def dispatch(
    experts_per_rank: list[torch.Tensor],
    payloads_per_rank: list[list[torch.Tensor]],
    num_experts: int,
    rt: int,
    invalid_token_expert_id: int | None = None,
    expert_id_payload_index: int | None = None,
    active=None,
) -> tuple[list[Routing], list[Received]]:
    """Dispatch of a whole job: ``(routing of each rank, what each rank receives)``.

    ``experts_per_rank[r]``: ``[T_r, top_k]`` integer expert ids of rank r.
    ``payloads_per_rank[r]``: rank r's payloads, each ``[T_r, ...]`` (any dtype).
    With ``invalid_token_expert_id``, every id of every empty slot of payload
    ``expert_id_payload_index`` is set to it (sanitize).
    ``active`` (degraded mode): the ranks of the round; nothing goes to or comes from the
    others (their slots at the active ranks are unchanged: slots are numbered per target).
    """
    ep_size = len(experts_per_rank)
    routings = [route(e, num_experts, ep_size) for e in experts_per_rank]
    shapes = [(p.dtype, math.prod(p.shape[1:])) for p in payloads_per_rank[0]]
    received = []
    for _ in range(ep_size):
        received.append(
            Received(
                payloads=[torch.zeros(ep_size, rt, n, dtype=dt) for dt, n in shapes],
                recv_counts=torch.zeros(ep_size, dtype=torch.int32),
                source_token=torch.full((ep_size, rt), -1, dtype=torch.int64),
            )
        )
    live = set(range(ep_size)) if active is None else set(active)
    for s, routing in enumerate(routings):
        if s not in live:
            continue
        for t, (targets, slots) in enumerate(zip(routing.target.tolist(), routing.slot.tolist())):
            for q, j in zip(targets, slots):
                if q < 0 or q not in live:
                    continue
                if j >= rt:
                    raise ValueError(f"rank {s} sends more than rt={rt} tokens to rank {q}")
                dest = received[q]
                for i, payload in enumerate(payloads_per_rank[s]):
                    dest.payloads[i][s, j] = payload[t].reshape(-1)
                dest.source_token[s, j] = t
        for q in live:
            received[q].recv_counts[s] = routing.send_counts[q]
    if invalid_token_expert_id is not None:
        for rcv in received:
            ids = rcv.payloads[expert_id_payload_index]
            for s, n in enumerate(rcv.recv_counts.tolist()):
                ids[s, n:] = invalid_token_expert_id
    return routings, received


def combine(routings: list[Routing], outputs_per_rank: list[torch.Tensor], active=None) -> list[torch.Tensor]:
    """Combine of a whole job: rank r's ``[T_r, hidden]`` results.

    ``outputs_per_rank[q]``: ``[ep_size, rt, hidden]`` expert outputs at rank q, row
    (s, j) for the token source s put in slot j. Token t of rank r gets the float32
    sum, over its sends in ascending k, of ``outputs_per_rank[target][r, slot]``,
    returned in the outputs' dtype (zeros for a token with no sends).
    ``active`` (degraded mode): the ranks whose contributions count (a combine's view);
    sends to the others contribute nothing.
    """
    dtype = outputs_per_rank[0].dtype
    hidden = outputs_per_rank[0].shape[2]
    results = []
    for r, routing in enumerate(routings):
        out = torch.zeros(routing.target.shape[0], hidden, dtype=torch.float32)
        for t, (targets, slots) in enumerate(zip(routing.target.tolist(), routing.slot.tolist())):
            for q, j in zip(targets, slots):  # ascending k
                if q >= 0 and (active is None or q in active):
                    out[t] += outputs_per_rank[q][r, j].float()
        results.append(out.to(dtype))
    return results


def lost_tokens(routing: Routing, active) -> torch.Tensor:
    """``[T]`` bool: the tokens of ``routing`` that have an expert on a rank outside ``active``
    (the degraded-mode indicator of a combine that counted ``active``)."""
    live = set(active)
    rows = routing.target.tolist()
    return torch.tensor([any(q >= 0 and q not in live for q in row) for row in rows], dtype=torch.bool)


# ---------------------------------------------------------------------------
# Inputs and a deterministic expert
# ---------------------------------------------------------------------------
@dataclass
class RankInputs:
    """One rank's inputs of one round.

    ``experts``: ``[T, top_k]`` int32 distinct expert ids per token.
    ``hidden``: ``[T, hidden]`` of the round's dtype. ``scales``: ``[T, top_k]`` float32.
    """

    experts: torch.Tensor
    hidden: torch.Tensor
    scales: torch.Tensor


def make_round(
    seed: int,
    tokens_per_rank: list[int],
    hidden: int,
    top_k: int,
    num_experts: int,
    dtype: torch.dtype = torch.bfloat16,
    experts_from: range | None = None,
) -> list[RankInputs]:
    """Seeded inputs of one round for every rank (identical in every process).

    Each token picks ``top_k`` distinct experts uniformly from ``experts_from``
    (default: all experts); when that range is smaller than ``top_k`` experts repeat.
    """
    g = torch.Generator().manual_seed(seed)
    pool = torch.arange(num_experts) if experts_from is None else torch.tensor(list(experts_from))
    out = []
    for n in tokens_per_rank:
        if len(pool) >= top_k:
            pick = torch.rand(n, len(pool), generator=g).argsort(dim=1)[:, :top_k]
        else:
            pick = torch.randint(0, len(pool), (n, top_k), generator=g)
        experts = pool[pick].to(torch.int32).reshape(n, top_k)
        h = (torch.randn(n, hidden, generator=g) * 2).to(dtype)
        scales = torch.rand(n, top_k, generator=g, dtype=torch.float32)
        out.append(RankInputs(experts=experts, hidden=h, scales=scales))
    return out


def toy_expert(
    recv_hidden: torch.Tensor,
    recv_ids: torch.Tensor,
    recv_scales: torch.Tensor,
    rank: int,
    num_experts: int,
    ep_size: int,
) -> torch.Tensor:
    """A deterministic expert computation from received data only (vectorized).

    ``recv_hidden``: ``[..., hidden]``; ``recv_ids``/``recv_scales``: ``[..., top_k]``
    (int32 / float32). For each row, ``hidden * sum over the k whose expert rank``
    ``owns of scale_k * (1 + expert_k / num_experts)``, computed in float32 and
    returned in ``recv_hidden``'s dtype. Ids this rank does not own (including
    sanitized invalid ids) contribute nothing.
    """
    owned = L.experts_of_rank(rank, num_experts, ep_size)
    ids = recv_ids.long()
    mine = (ids >= owned.start) & (ids < owned.stop)
    weight = torch.where(mine, recv_scales.float() * (1.0 + ids.float() / num_experts), 0.0).sum(-1)
    return (recv_hidden.float() * weight.unsqueeze(-1)).to(recv_hidden.dtype)


# ---------------------------------------------------------------------------
# Comparing received rows as sets
# ---------------------------------------------------------------------------
def slot_bytes(payloads: list[torch.Tensor]) -> torch.Tensor:
    """``[ep_size, rt, total_bytes]`` uint8: every slot's payloads side by side."""
    parts = [p.contiguous().reshape(p.shape[0], p.shape[1], -1).view(torch.uint8) for p in payloads]
    return torch.cat([p.cpu() for p in parts], dim=2)


def sorted_rows(rows: torch.Tensor) -> torch.Tensor:
    """Rows of a ``[n, B]`` uint8 tensor in a canonical order (by a weighted byte sum, then
    the first bytes), so that two tensors holding the same rows in any order compare equal."""
    if rows.shape[0] <= 1:
        return rows
    g = torch.Generator().manual_seed(0x5EED)
    weights = torch.randint(1, 1 << 20, (rows.shape[1],), generator=g, dtype=torch.int64)
    key = (rows.long() * weights).sum(1)
    order = torch.argsort(key, stable=True)
    return rows[order]


def same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two ``[n, B]`` uint8 tensors hold the same rows (as multisets)."""
    return a.shape == b.shape and torch.equal(sorted_rows(a), sorted_rows(b))


def dispatch_mismatches(
    received: list[torch.Tensor], recv_counts: torch.Tensor, expected: Received
) -> list[str]:
    """Differences between what a rank received and the reference, per source (empty: equal).

    ``received``: the rank's dispatch results (``[ep_size, rt, ...]`` each, any device);
    ``recv_counts``: its RECV_COUNTERS. Rows are compared per source as sets.
    """
    problems = []
    counts = recv_counts.cpu().to(torch.int32)
    if not torch.equal(counts, expected.recv_counts):
        problems.append(f"recv counts {counts.tolist()} != expected {expected.recv_counts.tolist()}")
        return problems
    got = slot_bytes(received)
    want = slot_bytes(expected.payloads)
    if got.shape != want.shape:
        return [f"received slots of shape {tuple(got.shape)}, expected {tuple(want.shape)}"]
    for s, n in enumerate(counts.tolist()):
        if not same_rows(got[s, :n], want[s, :n]):
            problems.append(f"the {n} rows from source {s} differ from the reference")
    return problems
