"""FlashInfer 0.7.2 parity of the front end: calls written as a FlashInfer user writes them (only
the import changed), ``job=`` omitted with a real gloo torch.distributed group, two engines of
one geometry side by side, instances sharing one attachment, caller-owned workspaces (several
ranks of one CPU tensor in one process, in threads), the caller's active-rank mask,
checkpoint_prepare / checkpoint_restore keeping the addresses, ``MoeAlltoAll`` under
``torch.compile(fullgraph=True)``, and every refusal of the new arguments.

Multi-process scenarios run in the shared pool of real client processes against a real
host-backend daemon; each rank checks its results against ``a2ad.client.reference``.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from _helpers_dataplane import dataplane_daemons, job_name, make_job, rank_pool, run_job  # noqa: F401  (fixtures)
from a2ad import errors, layout as L
from dataplane_cases import _assert_combined
from helpers import Mapping

HIDDEN = 32
TOP_K = 4
NUM_EXPERTS = 8
MAX_TOKENS = 6
INVALID = -1


def _round(seed, ep, tokens=None, active=None):
    """Every rank's inputs, what every rank receives, and every rank's combine (reference)."""
    from a2ad.client import reference as ref

    g = torch.Generator().manual_seed(seed)
    if tokens is None:
        tokens = torch.randint(0, MAX_TOKENS + 1, (ep,), generator=g).tolist()
    rt = max(1, max(tokens))
    inputs = ref.make_round(seed, tokens, HIDDEN, TOP_K, NUM_EXPERTS, torch.bfloat16)
    payloads = [[i.hidden, i.experts, i.scales] for i in inputs]
    routings, received = ref.dispatch([i.experts for i in inputs], payloads, NUM_EXPERTS, rt, INVALID, 1)
    outputs = [ref.toy_expert(r.payloads[0], r.payloads[1], r.payloads[2], q, NUM_EXPERTS, ep)
               for q, r in enumerate(received)]
    return rt, inputs, received, ref.combine(routings, outputs, active)


def _expert(got, rank, ep):
    from a2ad.client import reference as ref

    return ref.toy_expert(got[0], got[1], got[2], rank, NUM_EXPERTS, ep)


def _check_received(rank, got, expected):
    from a2ad.client import reference as ref

    problems = ref.dispatch_mismatches(got, expected.recv_counts, expected)
    assert not problems, f"rank {rank}: " + "; ".join(problems)


class _Env:
    """A runtime folder through the environment (a FlashInfer caller passes none) and a gloo group."""

    def __init__(self, runtime_dir, store=None, rank=0, size=1):
        self.runtime_dir, self.store, self.rank, self.size = runtime_dir, store, rank, size

    def __enter__(self):
        self._old = os.environ.get("A2AD_RUNTIME_DIR")
        os.environ["A2AD_RUNTIME_DIR"] = self.runtime_dir
        if self.store is not None:
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"file://{self.store}", rank=self.rank, world_size=self.size,
                                    timeout=__import__("datetime").timedelta(seconds=60))
        return self

    def __exit__(self, *exc):
        if self.store is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
        if self._old is None:
            os.environ.pop("A2AD_RUNTIME_DIR", None)
        else:
            os.environ["A2AD_RUNTIME_DIR"] = self._old


# ---------------------------------------------------------------------------
# Scenarios (run in every rank's process)
# ---------------------------------------------------------------------------
def flashinfer_user(rank, ep, runtime_dir, store, rounds, seed0):
    """A FlashInfer user's MoE layer; the only change is the import. No job name anywhere: the
    ranks agree on one through the default torch.distributed group. Returns the job name."""
    with _Env(runtime_dir, store, rank, ep):
        # from flashinfer.comm.trtllm_moe_alltoall import MoeAlltoAll, moe_a2a_active_rank_mask
        from a2ad.client import MoeAlltoAll, moe_a2a_active_rank_mask

        moe_a2a = MoeAlltoAll(Mapping(rank, ep), max_num_tokens=MAX_TOKENS, top_k=TOP_K, num_experts=NUM_EXPERTS,
                              hidden_size=HIDDEN, mnnvl_config=None, eplb_stats_num_experts=0, enable_rank_mask=False,
                              backend="trtllm")
        try:
            assert moe_a2a.ep_rank == rank and moe_a2a.ep_size == ep and moe_a2a.enable_eplb is False
            assert moe_a2a.metainfo.dtype == torch.int64
            for rnd in range(rounds):
                rt, inputs, received, combined = _round(seed0 + rnd, ep)
                mine = inputs[rank]
                # FlashInfer's moe_ep wrapper passes these two even when they are None
                recv = moe_a2a.dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], rt,
                                        invalid_token_expert_id=INVALID, expert_id_payload_index=1,
                                        eplb_local_stats=None, active_rank_mask=None)
                assert moe_a2a.eplb_gathered_stats is None
                saved = [t.clone() for t in recv]
                y = _expert(recv, rank, ep)
                if rnd % 3 == 0:
                    out = moe_a2a.combine(y, rt)
                elif rnd % 3 == 1:  # vLLM: into its own buffer
                    buf = torch.empty(mine.experts.shape[0], HIDDEN, dtype=torch.bfloat16)
                    out = moe_a2a.combine(y, rt, output=buf)
                    assert out is buf
                else:
                    out = moe_a2a.combine(y, runtime_max_tokens_per_rank=rt, payload_in_workspace=False,
                                          output_dtype=torch.bfloat16, use_low_precision=False, active_rank_mask=None)
                _check_received(rank, saved, received[rank])
                assert torch.equal(out, combined[rank]), f"rank {rank} round {rnd}: combine differs"
            mask = moe_a2a_active_rank_mask(range(ep), ep)
            assert mask.dtype == torch.uint64 and mask.shape == (L.MASK_WORDS,)  # FlashInfer's is [1]: up to 64 ranks
            assert L.mask_from_words(mask.view(torch.int64).tolist()) == (1 << ep) - 1
            return moe_a2a.attachment.job
        finally:
            moe_a2a.close()


def two_engines(rank, runtime_dir, stores, rounds):
    """Ranks 0-1 are one engine, ranks 2-3 another: same geometry, same node, own groups."""
    engine, erank = divmod(rank, 2)
    return flashinfer_user(erank, 2, runtime_dir, stores[engine], rounds, 100 * (engine + 1))


class _Comm:
    """A FlashInfer CommBackend (Get_rank, Get_size, allgather, bcast, barrier) over the
    default torch.distributed group, as FlashInfer's TorchDistBackend is."""

    def Get_rank(self):  # noqa: N802
        return torch.distributed.get_rank()

    def Get_size(self):  # noqa: N802
        return torch.distributed.get_world_size()

    def allgather(self, data):
        out = [None] * self.Get_size()
        torch.distributed.all_gather_object(out, data)
        return out

    def bcast(self, data, root):
        box = [data]
        torch.distributed.broadcast_object_list(box, src=root)
        return box[0]

    def barrier(self):
        torch.distributed.barrier()


class _MnnvlConfig:
    def __init__(self, comm_backend):
        self.comm_backend = comm_backend


def world_of_two_groups(rank, runtime_dir, store, via_config):
    """Four ranks, one communicator, two EP groups of two (moe_ep_rank = rank % 2): each group
    agrees on its own job. ``via_config``: the communicator comes as mnnvl_config.comm_backend
    (else the default torch.distributed group). Returns the job name."""
    from a2ad.client import MoeAlltoAll

    ep, erank = 2, rank % 2
    with _Env(runtime_dir, store, rank, 4):
        cfg = _MnnvlConfig(_Comm()) if via_config else None
        a2a = MoeAlltoAll(Mapping(erank, ep), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN, mnnvl_config=cfg)
        try:
            rt, inputs, _, combined = _round(350 + rank // 2, ep)
            mine = inputs[erank]
            got = a2a.dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], rt, INVALID, 1)
            assert torch.equal(a2a.combine(_expert(got, erank, ep), rt), combined[erank])
            a2a.checkpoint_prepare()
            a2a.checkpoint_restore(cfg.comm_backend if via_config else None)  # FlashInfer passes its comm
            return a2a.attachment.job
        finally:
            a2a.close()


def shared_instances(rank, ep, runtime_dir, store):
    """Instances of one geometry share one attachment; another geometry is another job;
    releasing the last instance releases it (the next instance makes a new job)."""
    from a2ad.client import MoeAlltoAll

    with _Env(runtime_dir, store, rank, ep):
        a = MoeAlltoAll(Mapping(rank, ep), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN)
        b = MoeAlltoAll(Mapping(rank, ep), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN)
        other = MoeAlltoAll(Mapping(rank, ep), MAX_TOKENS + 2, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN)
        try:
            first = a.attachment.job
            assert b.attachment.job == first and a.attachment.handles == 2
            assert a.workspace.data_ptr() == b.workspace.data_ptr()
            assert other.attachment.job != first and other.attachment.handles == 1
            for obj in (a, b, other):
                rt, inputs, received, combined = _round(300, ep)
                mine = inputs[rank]
                got = obj.dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], rt, INVALID, 1)
                assert torch.equal(obj.combine(_expert(got, rank, ep), rt), combined[rank])
        finally:
            a.close()
            b.close()
            other.close()
        again = MoeAlltoAll(Mapping(rank, ep), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN)
        try:
            assert again.attachment.job != first, "a released geometry's job was joined again"
            rt, inputs, _, combined = _round(301, ep)
            mine = inputs[rank]
            got = again.dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], rt, INVALID, 1)
            assert torch.equal(again.combine(_expert(got, rank, ep), rt), combined[rank])
        finally:
            again.close()
        return True


def checkpoint_round_trip(rank, ep, runtime_dir, job):
    """checkpoint_prepare unmaps (dispatch refused meanwhile), checkpoint_restore maps the rows again
    at the same addresses: views taken before stay valid and rounds go on."""
    from a2ad.client import MoeAlltoAll

    a2a = MoeAlltoAll(Mapping(rank, ep), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN, job=job,
                      runtime_dir=runtime_dir, timeout=20.0)
    layer2 = MoeAlltoAll(Mapping(rank, ep), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN, job=job,
                         runtime_dir=runtime_dir, timeout=20.0)
    try:
        ptr = a2a.workspace.data_ptr()
        view = a2a.workspace[rank, -64:]  # a view taken before the checkpoint (the combine region's end)
        rt, inputs, _, combined = _round(400, ep)
        mine = inputs[rank]
        got = a2a.dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], rt, INVALID, 1)
        with pytest.raises(errors.StateError, match="active"):
            a2a.checkpoint_prepare()  # a round is open
        assert torch.equal(a2a.combine(_expert(got, rank, ep), rt), combined[rank])
        # the end of this rank's combine region: peers may still read it, only this rank's next
        # combine writes it, so its bytes must come back unchanged
        before = view.clone()
        a2a.checkpoint_prepare()
        a2a.checkpoint_prepare()  # repeated: a no-op
        for obj in (a2a, layer2):  # the attachment is shared: every instance is unmapped
            with pytest.raises(errors.StateError, match="checkpoint_restore"):
                obj.dispatch(mine.experts, [mine.hidden], rt)
        assert a2a.attachment.lease_alive()
        layer2.checkpoint_restore()
        a2a.checkpoint_restore()  # repeated: a no-op
        assert a2a.workspace.data_ptr() == ptr and layer2.workspace.data_ptr() == ptr
        assert torch.equal(view, before), "the row's bytes did not survive the checkpoint"
        for seed in (401, 402):
            rt, inputs, received, combined = _round(seed, ep)
            mine = inputs[rank]
            got = layer2.dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], rt, INVALID, 1)
            _check_received(rank, [t.clone() for t in got], received[rank])
            assert torch.equal(layer2.combine(_expert(got, rank, ep), rt), combined[rank])
        return True
    finally:
        a2a.close()
        layer2.close()


def _layer(a2a, experts, hidden, scales, rt):
    got = a2a.dispatch(experts, [hidden, experts, scales], rt, INVALID, 1)
    from a2ad.client import reference as ref

    y = ref.toy_expert(got[0], got[1], got[2], a2a.ep_rank, NUM_EXPERTS, a2a.ep_size)
    return a2a.combine(y, rt)


def compiled_methods(rank, ep, runtime_dir, job, backend, rounds, cuda=False):
    """MoeAlltoAll.dispatch / combine inside torch.compile(fullgraph=True), every round checked,
    then the same object eagerly."""
    from a2ad.client import MoeAlltoAll

    dev = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    a2a = MoeAlltoAll(Mapping(rank, ep), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN, job=job,
                      runtime_dir=runtime_dir, timeout=20.0)
    torch._dynamo.reset()
    kind = "cuda" if cuda else "host"
    try:
        step = torch.compile(_layer, backend=backend, fullgraph=True)
        for rnd in range(rounds):
            rt, inputs, _, combined = _round(500 + rnd, ep, tokens=[5, 3, 4, 2][:ep])
            mine = inputs[rank]
            out = step(a2a, mine.experts.to(dev), mine.hidden.to(dev), mine.scales.to(dev), rt)
            assert a2a.phase == "idle"
            _assert_combined(out, combined[rank], kind, f"rank {rank} round {rnd} compiled")
            rt, inputs, _, combined = _round(600 + rnd, ep)
            mine = inputs[rank]
            out = _layer(a2a, mine.experts.to(dev), mine.hidden.to(dev), mine.scales.to(dev), rt)
            _assert_combined(out, combined[rank], kind, f"rank {rank} round {rnd} eager")
        return rounds
    finally:
        a2a.close()


# ---------------------------------------------------------------------------
# Tests: daemon jobs
# ---------------------------------------------------------------------------
def test_flashinfer_user_without_job_agrees_through_torch_distributed(rank_pool, daemon, tmp_path):
    names = rank_pool.run(2, flashinfer_user, 2, str(daemon.runtime_dir), str(tmp_path / "store"), 4, 10,
                          timeout=180.0)
    assert names[0] == names[1] and names[0].startswith("fi-2x6-"), names


@pytest.mark.full
def test_two_engines_of_one_geometry_never_share_a_job(rank_pool, daemon, tmp_path):
    stores = [str(tmp_path / "engine0"), str(tmp_path / "engine1")]
    names = rank_pool.run(4, two_engines, str(daemon.runtime_dir), stores, 3, timeout=240.0)
    assert names[0] == names[1] and names[2] == names[3], names
    assert names[0] != names[2], f"two engines joined one job: {names}"


@pytest.mark.parametrize("via_config", [False, True], ids=["default-group", "mnnvl-config"])
def test_a_communicator_of_several_ep_groups_gives_each_its_job(rank_pool, daemon, tmp_path, via_config):
    names = rank_pool.run(4, world_of_two_groups, str(daemon.runtime_dir), str(tmp_path / "store"), via_config,
                          timeout=240.0)
    assert names[0] == names[1] and names[2] == names[3] and names[0] != names[2], names


def test_instances_of_one_geometry_share_an_attachment(rank_pool, daemon, tmp_path):
    assert rank_pool.run(2, shared_instances, 2, str(daemon.runtime_dir), str(tmp_path / "store"),
                         timeout=180.0) == [True, True]


def test_checkpoint_round_trip_keeps_the_addresses(rank_pool, daemon):
    assert rank_pool.run(2, checkpoint_round_trip, 2, str(daemon.runtime_dir), job_name("ckpt"),
                         timeout=120.0) == [True, True]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_moe_alltoall_methods_under_torch_compile_fullgraph(rank_pool, daemon, backend):
    res = rank_pool.run(2, compiled_methods, 2, str(daemon.runtime_dir), job_name("fic"), backend, 2, timeout=300.0)
    assert res == [2, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_moe_alltoall_methods_under_torch_compile_fullgraph_cuda(rank_pool, dataplane_daemons, backend):
    runtime_dir = str(dataplane_daemons("cuda").runtime_dir)
    res = rank_pool.run(2, compiled_methods, 2, runtime_dir, job_name("ficg"), backend, 2, True, timeout=300.0)
    assert res == [2, 2]


def test_without_job_or_communicator_is_a_clear_error():
    from a2ad.client import MoeAlltoAll

    assert not torch.distributed.is_initialized()
    with pytest.raises(errors.InputError, match="pass job=") as exc:
        MoeAlltoAll(Mapping(0, 2), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN)
    assert exc.value.details["argument"] == "job"
    # an mnnvl_config without a comm_backend names no communicator either
    with pytest.raises(errors.InputError, match="pass job="):
        MoeAlltoAll(Mapping(1, 2), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN, mnnvl_config=object())


def test_backend_values_a2ad_cannot_honour_are_refused():
    import a2ad.client as c

    for call in (
        lambda: c.MoeAlltoAll(Mapping(0, 1), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN, backend="cake",
                              job="x"),
        lambda: c.moe_a2a_get_workspace_size_per_rank(2, 4, 64, 64, backend="cake"),
        lambda: c.MoeAlltoAll.get_moe_workspace_size_per_rank(2, 2, 4, 64, backend="cake"),
        lambda: c.moe_a2a_initialize(torch.zeros(1, 1 << 16, dtype=torch.uint8), 0, 1, 4, backend="cake"),
    ):
        with pytest.raises(errors.InputError, match="cake.*trtllm") as exc:
            call()
        assert exc.value.details["argument"] == "backend"
    assert c.moe_a2a_get_workspace_size_per_rank(2, 4, 64, 64, 0, backend="trtllm") == \
        c.moe_a2a_get_workspace_size_per_rank(2, 4, 64, 64)


def test_new_arguments_are_refused_clearly_on_a_daemon_job(daemon):
    """One rank of a daemon job in this process: each wrong use of the new arguments is an
    InputError naming the argument, and leaves the rank usable."""
    from a2ad.client import MoeAlltoAll, moe_a2a_active_rank_mask

    a2a = MoeAlltoAll(Mapping(0, 1), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN, job=job_name("firef"),
                      runtime_dir=str(daemon.runtime_dir), timeout=20.0)
    try:
        rt, inputs, _, combined = _round(700, 1, tokens=[4])
        mine = inputs[0]
        pl = [mine.hidden, mine.experts, mine.scales]
        with pytest.raises(errors.InputError) as exc:  # FlashInfer: ValueError (InputError is one)
            a2a.dispatch(mine.experts, pl, rt, active_rank_mask=moe_a2a_active_rank_mask([0], 1))
        assert exc.value.details["argument"] == "active_rank_mask" and isinstance(exc.value, ValueError)
        with pytest.raises(errors.InputError) as exc:
            a2a.dispatch(mine.experts, pl, rt, eplb_local_stats=torch.zeros(NUM_EXPERTS, dtype=torch.int32))
        assert exc.value.details["argument"] == "eplb_local_stats"
        assert a2a.phase == "idle"
        got = a2a.dispatch(mine.experts, pl, rt, INVALID, 1)
        y = _expert(got, 0, 1)
        stray = y.clone()
        with pytest.raises(errors.InputError) as exc:  # flagged in the workspace, but it is not
            a2a.combine(stray, rt, payload_in_workspace=True)
        assert exc.value.details["argument"] == "payload_in_workspace"
        with pytest.raises(errors.InputError) as exc:
            a2a.combine(y, rt, output=torch.empty(3, HIDDEN, dtype=torch.bfloat16))
        assert exc.value.details["argument"] == "output"
        with pytest.raises(errors.InputError) as exc:
            a2a.combine(y, rt, output=torch.empty(4, HIDDEN, dtype=torch.float32))
        assert exc.value.details["argument"] == "output"
        assert a2a.phase == "dispatched"
        assert torch.equal(a2a.combine(y, rt), combined[0])
    finally:
        a2a.close()


def test_eplb_and_rank_mask_on_a_daemon_job(daemon):
    """MoeAlltoAll(eplb_stats_num_experts=..., enable_rank_mask=True): eplb_gathered_stats between
    dispatch and combine, a mask naming this rank accepted (host and int64 forms)."""
    from a2ad.client import MoeAlltoAll, moe_a2a_active_rank_mask

    a2a = MoeAlltoAll(Mapping(0, 1), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN, eplb_stats_num_experts=12,
                      enable_rank_mask=True, job=job_name("fieplb"), runtime_dir=str(daemon.runtime_dir), timeout=20.0)
    try:
        assert a2a.enable_eplb and a2a.eplb_stats_num_experts == 12 and a2a.enable_rank_mask
        for seed, mask in ((720, moe_a2a_active_rank_mask([0], 1)), (721, torch.tensor([1], dtype=torch.int64))):
            rt, inputs, _, combined = _round(seed, 1, tokens=[4])
            mine = inputs[0]
            stats = torch.arange(12, dtype=torch.int32) + seed
            got = a2a.dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], rt, INVALID, 1,
                               eplb_local_stats=stats, active_rank_mask=mask)
            assert torch.equal(a2a.eplb_gathered_stats, stats.unsqueeze(0))
            out = a2a.combine(_expert(got, 0, 1), rt, active_rank_mask=mask)
            assert a2a.eplb_gathered_stats is None
            assert torch.equal(out, combined[0])
    finally:
        a2a.close()


def test_functional_payload_flagged_in_workspace_wrongly_is_refused(daemon):
    """The functional ops refuse what MoeAlltoAll.combine refuses (one validation boundary)."""
    import a2ad.client as c

    a2a = c.MoeAlltoAll(Mapping(0, 1), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN, job=job_name("fipiw"),
                        runtime_dir=str(daemon.runtime_dir), timeout=20.0)
    try:
        ws, meta = a2a.workspace, a2a.metainfo
        rt, inputs, _, combined = _round(710, 1, tokens=[3])
        mine = inputs[0]
        got, cpo, stats = c.moe_a2a_dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], ws, meta, rt, 0,
                                             1, TOP_K, NUM_EXPERTS)
        assert stats is None
        y = _expert(got, 0, 1)
        with pytest.raises(errors.InputError) as exc:
            c.moe_a2a_combine(y, 3, ws, meta, rt, 0, 1, TOP_K, cpo, payload_in_workspace=True)
        assert exc.value.details["argument"] == "payload_in_workspace"
        out = c.moe_a2a_combine(y, 3, ws, meta, rt, 0, 1, TOP_K, cpo, payload_in_workspace=False)
        assert torch.equal(out, combined[0])
    finally:
        a2a.close()


# ---------------------------------------------------------------------------
# Tests: caller-owned workspaces (no daemon)
# ---------------------------------------------------------------------------
def _run_ranks(fn, ep):
    """fn(rank) in one thread per rank; returns the results, re-raising the first failure."""
    results, failures = {}, {}

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as exc:  # reported below
            failures[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(ep)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank thread did not finish"
    if failures:
        raise next(iter(failures.values()))
    return [results[r] for r in range(ep)]


def _workspace(ep):
    import a2ad.client as c

    size = c.moe_a2a_get_workspace_size_per_rank(ep, MAX_TOKENS, 2 * HIDDEN + 8 * TOP_K, 2 * HIDDEN)
    return torch.zeros(ep, size, dtype=torch.uint8)


def test_caller_owned_cpu_workspace_runs_several_ranks_in_one_process():
    """moe_a2a_initialize on a plain CPU tensor, then FlashInfer's functional calls from one
    thread per rank: every round matches the reference."""
    import a2ad.client as c

    ep = 4
    ws = _workspace(ep)
    metas = [c.moe_a2a_initialize(ws, r, ep, MAX_TOKENS, timeout=20.0) for r in range(ep)]
    try:
        for rnd in range(3):
            rt, inputs, received, combined = _round(800 + rnd, ep)

            def rank_round(r):
                mine = inputs[r]
                recv, cpo, stats = c.moe_a2a_dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], ws,
                                                      metas[r], rt, r, ep, TOP_K, NUM_EXPERTS)
                assert stats is None
                c.moe_a2a_sanitize_expert_ids(recv[1], ws, metas[r], r, INVALID)
                saved = [t.clone() for t in recv]
                out = c.moe_a2a_combine(_expert(recv, r, ep), mine.experts.shape[0], ws, metas[r], rt, r, ep, TOP_K,
                                        cpo)
                return saved, out

            for r, (saved, out) in enumerate(_run_ranks(rank_round, ep)):
                _check_received(r, saved, received[r])
                assert torch.equal(out, combined[r]), f"rank {r} round {rnd}: combine differs"
    finally:
        c.moe_a2a_release(ws)
    with pytest.raises(errors.StateError, match="moe_a2a_initialize"):  # released: no longer found
        c.moe_a2a_dispatch(inputs[0].experts, [inputs[0].hidden], ws, metas[0], rt, 0, ep, TOP_K, NUM_EXPERTS)


def test_caller_owned_workspace_wait_is_bounded():
    """A rank that never dispatches: the other's wait ends in PeerTimeout after the timeout."""
    import a2ad.client as c

    ws = _workspace(2)
    meta = c.moe_a2a_initialize(ws, 0, 2, MAX_TOKENS, timeout=0.5)
    c.moe_a2a_initialize(ws, 1, 2, MAX_TOKENS, timeout=0.5)
    try:
        _, inputs, _, _ = _round(900, 2, tokens=[3, 3])
        t0 = time.monotonic()
        with pytest.raises(errors.PeerTimeout) as exc:
            c.moe_a2a_dispatch(inputs[0].experts, [inputs[0].hidden], ws, meta, 3, 0, 2, TOP_K, NUM_EXPERTS)
        assert time.monotonic() - t0 < 10
        assert exc.value.details["peer"] == 1
    finally:
        c.moe_a2a_release(ws)


def test_moe_a2a_initialize_refuses_bad_workspaces():
    import a2ad.client as c

    for ws, args, arg in (
        (torch.zeros(2, 1 << 16, dtype=torch.int32), (0, 2, 4), "workspace"),
        (torch.zeros(3, 1 << 16, dtype=torch.uint8), (0, 2, 4), "workspace"),
        (torch.zeros(2, 64, dtype=torch.uint8), (0, 2, 4), "workspace"),
        (torch.zeros(2, 1 << 16, dtype=torch.uint8), (2, 2, 4), "ep_rank"),
        (torch.zeros(2, 1 << 16, dtype=torch.uint8), (0, 2, 0), "max_num_tokens"),
        ("not a tensor", (0, 2, 4), "workspace"),
    ):
        with pytest.raises(errors.InputError) as exc:
            c.moe_a2a_initialize(ws, *args)
        assert exc.value.details["argument"] == arg, (args, exc.value)


def test_active_rank_mask_checks():
    """The mask's form is checked at the call: FlashInfer's CPU uint64 tensor or an int64 one,
    this rank's bit set, no rank outside the job; only with enable_rank_mask=True."""
    import a2ad.client as c

    ws = _workspace(2)
    meta = c.moe_a2a_initialize(ws, 0, 2, MAX_TOKENS, timeout=5.0)
    try:
        _, inputs, _, _ = _round(950, 2, tokens=[2, 2])
        e, h = inputs[0].experts, inputs[0].hidden
        for mask, kw, match in (
            (c.moe_a2a_active_rank_mask([0], 2), {}, "enable_rank_mask"),
            (c.moe_a2a_active_rank_mask([1], 2), {"enable_rank_mask": True}, "own bit"),
            (torch.tensor([0b101], dtype=torch.int64), {"enable_rank_mask": True}, "outside"),
            (torch.tensor([1, 0, 0, 0, 0], dtype=torch.int64), {"enable_rank_mask": True}, r"\[1\] to \[4\]"),
            (torch.tensor([[1]], dtype=torch.int64), {"enable_rank_mask": True}, r"\[1\] to \[4\]"),
            (torch.tensor([0b101, 0], dtype=torch.int64), {"enable_rank_mask": True}, "outside"),
            (torch.tensor([1, 1 << 3], dtype=torch.int64), {"enable_rank_mask": True}, "outside"),
            (torch.tensor([1.0]), {"enable_rank_mask": True}, "uint64"),
            ([0], {"enable_rank_mask": True}, "torch.Tensor"),
        ):
            with pytest.raises(errors.InputError, match=match) as exc:
                c.moe_a2a_dispatch(e, [h], ws, meta, 2, 0, 2, TOP_K, NUM_EXPERTS, active_rank_mask=mask, **kw)
            assert exc.value.details["argument"] == "active_rank_mask"
        with pytest.raises(errors.InputError):
            c.moe_a2a_active_rank_mask([2], 2)
        m = c.moe_a2a_active_rank_mask(torch.tensor([0, 2]), 3)
        assert m.dtype == torch.uint64 and m.shape == (L.MASK_WORDS,) == (c.MOE_A2A_RANK_MASK_WORDS,)
        assert m.view(torch.int64).tolist() == [0b101, 0, 0, 0]
        m = c.moe_a2a_active_rank_mask([0, 63, 64, 200, 255], 256)
        assert L.mask_from_words(m.view(torch.int64).tolist()) == 1 | 1 << 63 | 1 << 64 | 1 << 200 | 1 << 255
    finally:
        c.moe_a2a_release(ws)


def test_active_rank_mask_drops_the_masked_rank():
    """Three ranks of a caller-owned workspace; ranks 0 and 1 run a round with rank 2 masked off:
    nothing is sent to rank 2, and the combine sums only ranks 0 and 1's experts."""
    import a2ad.client as c

    ep = 3
    ws = _workspace(ep)
    metas = [c.moe_a2a_initialize(ws, r, ep, MAX_TOKENS, timeout=20.0) for r in range(ep)]
    try:
        rt, inputs, _, combined = _round(960, ep, tokens=[5, 4, 0], active={0, 1})
        mask = c.moe_a2a_active_rank_mask([0, 1], ep)

        def rank_round(r):
            mine = inputs[r]
            recv, cpo, _ = c.moe_a2a_dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], ws, metas[r],
                                              rt, r, ep, TOP_K, NUM_EXPERTS, enable_rank_mask=True,
                                              active_rank_mask=mask)
            return c.moe_a2a_combine(_expert(recv, r, ep), mine.experts.shape[0], ws, metas[r], rt, r, ep, TOP_K,
                                     cpo, enable_rank_mask=True, active_rank_mask=mask)

        outs = _run_ranks(rank_round, 2)
        for r in range(2):
            assert torch.equal(outs[r], combined[r]), f"rank {r}: masked combine differs"
    finally:
        c.moe_a2a_release(ws)


def test_eplb_stats_are_gathered_in_the_dispatch_round():
    """eplb_local_stats of every rank come back as eplb_gathered_stats [ep_size, E] (row r: rank r's)."""
    import a2ad.client as c

    ep, n_stats = 2, 16
    size = c.moe_a2a_get_workspace_size_per_rank(ep, MAX_TOKENS, 2 * HIDDEN + 8 * TOP_K, 2 * HIDDEN, n_stats)
    assert size > c.moe_a2a_get_workspace_size_per_rank(ep, MAX_TOKENS, 2 * HIDDEN + 8 * TOP_K, 2 * HIDDEN)
    ws = torch.zeros(ep, size, dtype=torch.uint8)
    metas = [c.moe_a2a_initialize(ws, r, ep, MAX_TOKENS, n_stats, timeout=20.0) for r in range(ep)]
    try:
        stats = [torch.arange(n_stats, dtype=torch.int32) * (r + 1) + 100 * r for r in range(ep)]
        for rnd in range(2):
            rt, inputs, _, combined = _round(970 + rnd, ep)

            def rank_round(r):
                mine = inputs[r]
                recv, cpo, gathered = c.moe_a2a_dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], ws,
                                                         metas[r], rt, r, ep, TOP_K, NUM_EXPERTS,
                                                         eplb_local_stats=stats[r] + rnd)
                got = gathered.clone()
                out = c.moe_a2a_combine(_expert(recv, r, ep), mine.experts.shape[0], ws, metas[r], rt, r, ep, TOP_K,
                                        cpo)
                return got, out

            for r, (got, out) in enumerate(_run_ranks(rank_round, ep)):
                assert got.shape == (ep, n_stats) and got.dtype == torch.int32
                assert torch.equal(got, torch.stack(stats) + rnd), f"rank {r}: gathered stats differ"
                assert torch.equal(out, combined[r])
        with pytest.raises(errors.InputError) as exc:  # the length must be eplb_stats_num_experts
            c.moe_a2a_dispatch(inputs[0].experts, [inputs[0].hidden], ws, metas[0], rt, 0, ep, TOP_K, NUM_EXPERTS,
                               eplb_local_stats=torch.zeros(n_stats + 1, dtype=torch.int32))
        assert exc.value.details["argument"] == "eplb_local_stats"
    finally:
        c.moe_a2a_release(ws)


def _one_rank(hidden):
    import a2ad.client as c

    size = c.moe_a2a_get_workspace_size_per_rank(1, MAX_TOKENS, 2 * hidden + 8 * TOP_K, 2 * hidden)
    ws = torch.zeros(1, size, dtype=torch.uint8)
    return ws, c.moe_a2a_initialize(ws, 0, 1, MAX_TOKENS, timeout=5.0)


def _one_rank_round(ws, meta, hidden, seed, **combine_kw):
    """One round of a one-rank caller-owned workspace; returns (plain combine input, result)."""
    import a2ad.client as c

    g = torch.Generator().manual_seed(seed)
    experts = torch.randint(0, NUM_EXPERTS, (5, TOP_K), generator=g, dtype=torch.int32)
    hid = torch.randn(5, hidden, generator=g).to(torch.bfloat16)
    recv, cpo, _ = c.moe_a2a_dispatch(experts, [hid, experts], ws, meta, 5, 0, 1, TOP_K, NUM_EXPERTS)
    y = recv[0] * 0.5
    return c.moe_a2a_combine(y, 5, ws, meta, 5, 0, 1, TOP_K, cpo, **combine_kw)


def test_quantized_combine_outputs_match_the_quantizer():
    """output_dtype / output_scales / sf_layout: the combine's result quantized by client.quant."""
    import a2ad.client as c
    from a2ad.client import quant

    hidden = 64
    ws, meta = _one_rank(hidden)
    try:
        plain = _one_rank_round(ws, meta, hidden, 1)
        for dtype, sdtype, layout in ((torch.float8_e4m3fn, torch.uint8, quant.SfLayout.layout_linear),
                                      (torch.uint8, torch.float8_e4m3fn, quant.SfLayout.layout_128x4),
                                      (torch.uint8, torch.uint8, quant.SfLayout.layout_8x4)):
            (dshape, ddtype), (sshape, sd) = quant.output_shapes(5, hidden, dtype, layout, scales_dtype=sdtype)
            scales = torch.empty(sshape, dtype=sd)
            out = _one_rank_round(ws, meta, hidden, 1, output_dtype=dtype, output_scales=scales, sf_layout=layout,
                                  output_scalar_scale=1.0)
            want, want_scales = quant.quantize(plain, dtype, layout, scalar_scale=1.0,
                                               out_scales=torch.empty(sshape, dtype=sd))
            assert out.dtype == ddtype and tuple(out.shape) == tuple(dshape)
            assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), (dtype, layout)
            assert torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8)), (dtype, layout)
        with pytest.raises(errors.InputError) as exc:
            _one_rank_round(ws, meta, hidden, 1, output_scales=torch.empty(5, 2, dtype=torch.uint8))
        assert exc.value.details["argument"] == "output_scales"
    finally:
        c.moe_a2a_release(ws)


def test_low_precision_combine_takes_bfloat16_payloads():
    import a2ad.client as c

    hidden = 64
    ws, meta = _one_rank(hidden)
    try:
        experts = torch.zeros(3, TOP_K, dtype=torch.int32)
        recv, cpo, _ = c.moe_a2a_dispatch(experts, [torch.ones(3, hidden, dtype=torch.bfloat16)], ws, meta, 3, 0, 1,
                                          TOP_K, NUM_EXPERTS)
        with pytest.raises(errors.InputError) as exc:
            c.moe_a2a_combine(recv[0].to(torch.float16), 3, ws, meta, 3, 0, 1, TOP_K, cpo, use_low_precision=True)
        assert exc.value.details["argument"] == "use_low_precision"
        out = c.moe_a2a_combine(recv[0], 3, ws, meta, 3, 0, 1, TOP_K, cpo, use_low_precision=True)
        assert out.dtype == torch.bfloat16 and torch.equal(out, torch.ones(3, hidden, dtype=torch.bfloat16))
    finally:
        c.moe_a2a_release(ws)


def test_low_precision_combine_returns_bfloat16_close_to_the_bf16_combine():
    """use_low_precision=True between two ranks of a caller-owned workspace: FP8 rows on the wire,
    bfloat16 out, close to the bf16 combine (and not equal: the rows from the peer were FP8)."""
    import a2ad.client as c

    ep, hidden = 2, 64
    size = c.moe_a2a_get_workspace_size_per_rank(ep, MAX_TOKENS, 2 * hidden + 4 * TOP_K, 2 * hidden)
    ws = torch.zeros(ep, size, dtype=torch.uint8)
    metas = [c.moe_a2a_initialize(ws, r, ep, MAX_TOKENS, timeout=20.0) for r in range(ep)]
    g = torch.Generator().manual_seed(3)
    experts = [torch.randint(0, NUM_EXPERTS, (5, TOP_K), generator=g, dtype=torch.int32) for _ in range(ep)]
    hid = [torch.randn(5, hidden, generator=g).to(torch.bfloat16) for _ in range(ep)]

    def rank_round(r, **kw):
        recv, cpo, _ = c.moe_a2a_dispatch(experts[r], [hid[r], experts[r]], ws, metas[r], 5, r, ep, TOP_K, NUM_EXPERTS)
        return c.moe_a2a_combine(recv[0] * 0.5, 5, ws, metas[r], 5, r, ep, TOP_K, cpo, **kw)

    try:
        plain = _run_ranks(rank_round, ep)
        low = _run_ranks(lambda r: rank_round(r, use_low_precision=True), ep)
        bufs = [torch.empty(5, hidden, dtype=torch.bfloat16) for _ in range(ep)]
        into = _run_ranks(lambda r: rank_round(r, use_low_precision=True, output=bufs[r]), ep)
        errs = []
        for r in range(ep):
            assert low[r].dtype == torch.bfloat16 and low[r].shape == plain[r].shape
            errs.append(float((low[r].float() - plain[r].float()).abs().max() / plain[r].float().abs().max()))
            assert into[r] is bufs[r] and torch.equal(bufs[r], low[r])
        assert max(errs) < 0.07, f"FP8 combine relative error {errs}"  # e4m3: 3 mantissa bits
        assert max(errs) > 0, "use_low_precision=True gave the bf16 combine's bits: no FP8 on the wire"
    finally:
        c.moe_a2a_release(ws)


# ---------------------------------------------------------------------------
# GPU: several ranks on one GPU in one process, on a caller-owned workspace
# ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ep", [2, 4])
def test_caller_owned_cuda_workspace_runs_several_ranks_on_one_gpu(ep):
    """FlashInfer's own test setup: one [ep_size, size_per_rank] CUDA tensor, every rank in this
    process on its own stream (the kernels wait for each other across streams)."""
    import a2ad.client as c

    dev = torch.device("cuda", torch.cuda.current_device())
    ws = _workspace(ep).to(dev)
    metas = [c.moe_a2a_initialize(ws, r, ep, MAX_TOKENS, timeout=20.0) for r in range(ep)]
    streams = [torch.cuda.Stream(dev) for _ in range(ep)]
    try:
        for rnd in range(3):
            rt, inputs, received, combined = _round(1000 + rnd, ep)
            main = torch.cuda.current_stream(dev)
            recv, cpos = {}, {}
            for r in range(ep):
                streams[r].wait_stream(main)
                with torch.cuda.stream(streams[r]):
                    mine = inputs[r]
                    pl = [mine.hidden.to(dev), mine.experts.to(dev), mine.scales.to(dev)]
                    recv[r], cpos[r], _ = c.moe_a2a_dispatch(pl[1], pl, ws, metas[r], rt, r, ep, TOP_K, NUM_EXPERTS)
                    c.moe_a2a_sanitize_expert_ids(recv[r][1], ws, metas[r], r, INVALID)
            outs, saved = {}, {}
            for r in range(ep):
                with torch.cuda.stream(streams[r]):
                    saved[r] = [t.clone() for t in recv[r]]
                    y = _expert([t for t in saved[r]], r, ep)
                    outs[r] = c.moe_a2a_combine(y, inputs[r].experts.shape[0], ws, metas[r], rt, r, ep, TOP_K, cpos[r])
            for r in range(ep):
                main.wait_stream(streams[r])
            torch.cuda.synchronize(dev)
            for r in range(ep):
                _check_received(r, [t.cpu() for t in saved[r]], received[r])
                _assert_combined(outs[r], combined[r], "cuda", f"rank {r} round {rnd}")
    finally:
        torch.cuda.synchronize(dev)
        c.moe_a2a_release(ws)


def graph_across_checkpoint(rank, job, replays):
    """dispatch + combine with a device active_rank_mask captured in one CUDA graph; replayed,
    then checkpoint_prepare / checkpoint_restore, then replayed again: the graph stays valid
    because the rows come back at the same addresses."""
    import dataplane_cases as cases
    from a2ad.client import MoeAlltoAll
    from a2ad.client import reference as ref

    dev = job.device(rank)
    torch.cuda.set_device(dev)
    a2a = MoeAlltoAll(Mapping(rank, job.ep_size), job.max_num_tokens, job.top_k, job.num_experts,
                      hidden_size=job.hidden, enable_rank_mask=True, job=job.name, runtime_dir=job.runtime_dir,
                      timeout=job.timeout)
    cases._OPEN[job.name] = a2a  # closed by run_job
    rt, ep = job.max_num_tokens, job.ep_size

    def inputs(seed):
        ins = ref.make_round(seed, [rt] * ep, job.hidden, job.top_k, job.num_experts, torch.bfloat16)
        payloads = [[i.hidden, i.experts, i.scales] for i in ins]
        routings, received = ref.dispatch([i.experts for i in ins], payloads, job.num_experts, rt, INVALID, 1)
        outputs = [ref.toy_expert(r.payloads[0], r.payloads[1], r.payloads[2], q, job.num_experts, ep)
                   for q, r in enumerate(received)]
        return payloads[rank], ref.combine(routings, outputs)[rank]

    payloads0, _ = inputs(0)
    s_payloads = [p.to(dev) for p in payloads0]
    s_mask = torch.tensor([(1 << ep) - 1], dtype=torch.int64, device=dev)
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            got = a2a.dispatch(s_payloads[1], s_payloads, rt, INVALID, 1, active_rank_mask=s_mask)
            y = ref.toy_expert(got[0], got[1], got[2], rank, job.num_experts, ep)
            s_out = a2a.combine(y, rt, active_rank_mask=s_mask)
    torch.cuda.current_stream(dev).wait_stream(stream)
    ptr = a2a.workspace.data_ptr()
    for i in range(2 * replays):
        if i == replays:
            a2a.checkpoint_prepare()
            a2a.checkpoint_restore()
            assert a2a.workspace.data_ptr() == ptr
        payloads, want = inputs(i + 1)
        for sp, p in zip(s_payloads, payloads):
            sp.copy_(p)
        graph.replay()
        _assert_combined(s_out, want, "cuda", f"rank {rank} replay {i}")
    a2a.check()
    return 2 * replays


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_with_device_rank_mask_survives_a_checkpoint(rank_pool, dataplane_daemons):
    job = make_job(dataplane_daemons, "cuda", "figraph", 2)
    assert run_job(rank_pool, job, graph_across_checkpoint, 3, timeout=300.0) == [6, 6]
