"""The single-process reference (client/reference.py): hand-checked examples, and the host
plane's vectorized routing held against it."""

from __future__ import annotations

import pytest
import torch

from a2ad import layout as L
from a2ad.client import reference as ref
from a2ad.client.host_plane import route as host_route


def test_contiguous_partition():
    owners = [L.expert_owner(e, 32, 4) for e in range(32)]
    assert owners == [e // 8 for e in range(32)]
    sizes = [len(L.experts_of_rank(r, 384, 5)) for r in range(5)]
    assert sizes == [77, 77, 77, 77, 76]
    # 6 experts on 4 ranks: 2, 2, 1, 1
    assert [L.expert_owner(e, 6, 4) for e in range(6)] == [0, 0, 1, 1, 2, 3]


def test_route_repeats_and_slots_by_hand():
    # ep 4, 8 experts: rank q owns 2q, 2q+1
    experts = torch.tensor([[0, 1, 2, 7], [3, 2, 6, 6], [5, 4, 0, 1]], dtype=torch.int32)
    r = ref.route(experts, 8, 4)
    assert r.target.tolist() == [[0, -1, 1, 3], [1, -1, 3, -1], [2, -1, 0, -1]]
    assert r.slot.tolist() == [[0, -1, 0, 0], [1, -1, 1, -1], [0, -1, 1, -1]]
    assert r.send_counts.tolist() == [2, 2, 1, 2]


def test_dispatch_by_hand():
    experts = [
        torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),  # rank 0: token 0 -> rank 0, token 1 -> rank 1
        torch.tensor([[3, 0]], dtype=torch.int32),  # rank 1: token 0 -> ranks 1 and 0
    ]
    payloads = [
        [torch.tensor([[10.0], [11.0]]), experts[0]],
        [torch.tensor([[20.0]]), experts[1]],
    ]
    routings, received = ref.dispatch(experts, payloads, 4, rt=3, invalid_token_expert_id=-7, expert_id_payload_index=1)
    assert [r.send_counts.tolist() for r in routings] == [[1, 1], [1, 1]]
    r0, r1 = received
    assert r0.recv_counts.tolist() == [1, 1] and r1.recv_counts.tolist() == [1, 1]
    assert r0.payloads[0][:, :, 0].tolist() == [[10.0, 0.0, 0.0], [20.0, 0.0, 0.0]]
    assert r1.payloads[0][:, :, 0].tolist() == [[11.0, 0.0, 0.0], [20.0, 0.0, 0.0]]
    assert r0.source_token.tolist() == [[0, -1, -1], [0, -1, -1]]
    # sanitize: every id of every empty slot
    assert r0.payloads[1][0].tolist() == [[0, 1], [-7, -7], [-7, -7]]
    assert r1.payloads[1][1].tolist() == [[3, 0], [-7, -7], [-7, -7]]


def test_dispatch_refuses_more_than_rt():
    experts = [torch.zeros(3, 1, dtype=torch.int32), torch.zeros(0, 1, dtype=torch.int32)]
    with pytest.raises(ValueError, match="more than rt"):
        ref.dispatch(experts, [[torch.zeros(3, 1)], [torch.zeros(0, 1)]], 2, rt=2)


def test_combine_of_toy_expert_is_the_closed_form():
    """Sending each token once per rank and summing the owners' partial sums gives
    sum over all k of hidden * scale_k * (1 + e_k / E), however the experts fall."""
    ep, E, k, hidden = 4, 16, 4, 8
    inputs = ref.make_round(3, [5, 0, 7, 2], hidden, k, E, dtype=torch.float32)
    rt = 7
    routings, received = ref.dispatch(
        [i.experts for i in inputs], [[i.hidden, i.experts, i.scales] for i in inputs], E, rt, -1, 1
    )
    outputs = [ref.toy_expert(r.payloads[0], r.payloads[1], r.payloads[2], q, E, ep) for q, r in enumerate(received)]
    results = ref.combine(routings, outputs)
    for inp, out in zip(inputs, results):
        weight = (inp.scales * (1 + inp.experts.float() / E)).sum(1, keepdim=True)
        torch.testing.assert_close(out, inp.hidden * weight, rtol=1e-5, atol=1e-5)
    assert results[1].shape == (0, hidden)


def test_make_round_is_seeded_and_distinct():
    a = ref.make_round(11, [4, 3], 16, 8, 32)
    b = ref.make_round(11, [4, 3], 16, 8, 32)
    for x, y in zip(a, b):
        assert torch.equal(x.experts, y.experts) and torch.equal(x.hidden, y.hidden)
        assert all(len(set(row)) == 8 for row in x.experts.tolist())
    one_rank = ref.make_round(1, [5], 4, 4, 32, experts_from=range(24, 32))
    assert bool(((one_rank[0].experts >= 24) & (one_rank[0].experts < 32)).all())


def test_same_rows_ignores_order_only():
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 256, (6, 5), generator=g, dtype=torch.uint8)
    assert ref.same_rows(rows, rows[torch.randperm(6, generator=g)])
    changed = rows.clone()
    changed[2, 4] ^= 1
    assert not ref.same_rows(rows, changed)
    assert not ref.same_rows(rows, rows[:5])


@pytest.mark.parametrize(
    "ep,num_experts,top_k,tokens",
    [(4, 32, 8, 40), (5, 384, 8, 33), (4, 6, 3, 25), (8, 256, 22, 17), (2, 8, 2, 0), (1, 4, 4, 9), (64, 64, 4, 50)],
)
def test_host_routing_matches_reference(ep, num_experts, top_k, tokens):
    g = torch.Generator().manual_seed(ep * 1000 + top_k)
    experts = torch.randint(0, num_experts, (tokens, top_k), generator=g, dtype=torch.int32)
    want = ref.route(experts, num_experts, ep)
    target, slot, sent = host_route(experts, num_experts, ep)
    assert torch.equal(target, want.target)
    assert torch.equal(slot, want.slot)
    assert torch.equal(sent.sum(0, dtype=torch.int32), want.send_counts)
