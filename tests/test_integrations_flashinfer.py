"""The ``flashinfer.moe_ep`` communication backed by a2ad (a2ad.integrations.flashinfer),
driven as FlashInfer's callers drive it, in 2 and 4 real rank processes (gloo group)
against a real host-backend daemon, every round checked against the reference."""

from __future__ import annotations

import pytest

from integration_cases import fi_kill9, fi_rounds_and_rebuild, run_group


def test_imports_without_flashinfer_and_has_its_interface():
    from a2ad.integrations import flashinfer as fi

    for name in ("dispatch", "combine", "destroy", "checkpoint_prepare", "checkpoint_restore",
                 "is_platform_supported", "get_combine_input_buffer", "is_workload_feasible"):
        assert callable(getattr(fi.A2adAlltoAll, name)), name
    assert fi.A2adAlltoAll.backend_name == "a2ad" and fi.A2adAlltoAll.is_platform_supported()
    cfg = fi.A2adConfig()
    assert cfg.backend_name == "a2ad" and cfg.on_peer_loss == "raise"

    class OneSided:  # FlashInfer's NVLinkOneSidedConfig fields
        backend_name = "nvlink_one_sided"
        extra_payload_bytes_per_token = 12
        eplb_stats_num_experts = 0
        enable_rank_mask = False
        use_low_precision_combine = False
        comm_backend = None

    c2 = fi.A2adConfig.from_config(OneSided(), on_peer_loss="degrade")
    assert c2.extra_payload_bytes_per_token == 12 and c2.on_peer_loss == "degrade" and c2.backend_name == "a2ad"
    with pytest.raises(ValueError, match="invalid_expert_id"):
        fi.MoEEpCommParams(num_experts=8, top_k=2, max_tokens_per_rank=4, hidden_size=8, invalid_expert_id=3)
    names = {fi.job_name("fi", "abc", 4, (16, 2, 8, 1 << 20, 0, "raise")),
             fi.job_name("fi", "abc", 4, (32, 2, 8, 1 << 21, 0, "raise")),
             fi.job_name("fi", "abd", 4, (16, 2, 8, 1 << 20, 0, "raise"))}
    assert len(names) == 3 and all(len(n) <= 64 for n in names)


def test_no_communicator_is_a_clear_error(daemon):
    from a2ad import errors
    from a2ad.integrations import flashinfer as fi

    with pytest.raises(errors.InputError, match="job"):
        fi.A2adAlltoAll(fi.BootstrapConfig(world_size=2, rank=0),
                        fi.MoEEpCommParams(num_experts=4, top_k=2, max_tokens_per_rank=4, hidden_size=8),
                        fi.A2adConfig(runtime_dir=str(daemon.runtime_dir)))


@pytest.mark.parametrize("ep", [2, pytest.param(4, marks=pytest.mark.full)])
def test_rounds_and_rebuild_with_larger_capacity(daemon, tmp_path, ep):
    res = run_group(fi_rounds_and_rebuild, ep, (ep, str(daemon.runtime_dir), str(tmp_path / "pg"), 2 * ep, 3))
    firsts = {v[0] for v in res.values()}
    seconds = {v[1] for v in res.values()}
    assert len(firsts) == 1 and len(seconds) == 1 and firsts != seconds, res  # every rank agreed, per build


def test_two_engines_on_one_node_get_their_own_jobs(daemon, tmp_path):
    import threading

    out = {}

    def engine(i):
        out[i] = run_group(fi_rounds_and_rebuild, 2, (2, str(daemon.runtime_dir), str(tmp_path / f"pg{i}"), 4, 1))

    threads = [threading.Thread(target=engine, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert set(out) == {0, 1}, "an engine did not finish"
    jobs = [{v[0] for v in out[i].values()} | {v[1] for v in out[i].values()} for i in range(2)]
    assert not jobs[0] & jobs[1], jobs


@pytest.mark.parametrize("ep,policy", [pytest.param(2, "degrade", marks=pytest.mark.full), (4, "degrade"), (2, "raise"),
                                       pytest.param(4, "raise", marks=pytest.mark.full)])
def test_kill9_seen_within_1s(daemon, tmp_path, ep, policy):
    victim = ep - 1
    res = run_group(fi_kill9, ep, (ep, str(daemon.runtime_dir), str(tmp_path / "pg"), 2 * ep, policy,
                                   str(tmp_path / "killed")), may_die={victim})
    assert sorted(res) == [r for r in range(ep) if r != victim]
    slowest = max(res.values())
    print(f"\nfigure: kill -9 of rank {victim} ({policy}, {ep} ranks) in rank_mask() of every survivor after "
          + ", ".join(f"{res[r] * 1e3:.1f}" for r in sorted(res)) + " ms")
    assert slowest < 1.0, f"a survivor saw the kill after {slowest:.3f} s"


@pytest.mark.gpu
def test_cuda_mask_and_fault_reads_do_not_sync(daemon_factory, tmp_path):
    """On the cuda backend the hooks read the registered control block with stream-ordered
    copies: no host sync (torch's sync-debug mode "error" passes), and a round still works."""
    import torch
    import torch.distributed as dist

    from a2ad.integrations import flashinfer as fi

    d = daemon_factory("--grace", "1", backend="cuda")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    comm = None
    try:
        comm = fi.A2adAlltoAll(
            fi.BootstrapConfig(world_size=1, rank=0, device=torch.cuda.current_device()),
            fi.MoEEpCommParams(num_experts=4, top_k=2, max_tokens_per_rank=4, hidden_size=16),
            fi.A2adConfig(runtime_dir=str(d.runtime_dir), timeout=20.0, on_peer_loss="degrade"),
        )
        assert comm.device.type == "cuda"
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            mask, fault = comm.rank_mask(), comm.fault()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert mask.device.type == "cuda" and mask.dtype == torch.int32 and fault.device.type == "cuda"
        assert mask.tolist() == [0] and not bool(fault)
        x = torch.randn(3, 16, device="cuda").to(torch.bfloat16)
        ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32, device="cuda")
        w = torch.rand(3, 2, device="cuda")
        res = comm.dispatch(x, ids, w, max_tokens_per_rank=3)
        out = comm.combine(res.hidden_states)
        assert torch.equal(out, x)  # one rank, one copy of each token
    finally:
        if comm is not None:
            comm.destroy()
        dist.destroy_process_group()
