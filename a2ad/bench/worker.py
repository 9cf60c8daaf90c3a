"""One rank's process: process groups, the machine's facts, the ceilings, then every grid point
and implementation, the results appended to the run folder for the launcher."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

from .ceilings import measure_ceilings
from .common import IMPL_MODE, NO_MULTICAST_ENV, Skip, ensure_client_package, exception_text, log
from .impls import IMPL_FUNCS, A2adJob, FiJob, flashinfer_probe
from .report import _finite, _json_default, format_ceilings
from .results import build_row
from .timing import Ctx, _setup_device, percentile, step_latencies
from .workload import (
    combine_bytes_per_token,
    dispatch_bytes_per_token,
    expert_weights,
    make_inputs,
    make_routing_for,
    remote_pairs,
    target_mask,
)


def _init_dist(ctx: Ctx) -> None:
    import torch.distributed as dist

    cfg = ctx.cfg
    timeout = datetime.timedelta(seconds=cfg["pg_timeout"])
    init = f"file://{cfg['run_dir']}/pg-store"
    if ctx.cuda:
        torch.cuda.set_device(ctx.device)
        kw = dict(backend="nccl", init_method=init, rank=ctx.rank, world_size=ctx.ep, timeout=timeout)
        try:
            dist.init_process_group(**kw, device_id=ctx.device)
        except TypeError:  # torch without device_id
            dist.init_process_group(**kw)
        ctx.gloo = dist.new_group(backend="gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", init_method=init, rank=ctx.rank, world_size=ctx.ep, timeout=timeout)
        ctx.gloo = dist.group.WORLD


def hardware_info(ctx: Ctx) -> dict:
    import platform

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "host_cpu": platform.machine()}
    if not ctx.cuda:
        info.update(device_name="CPU (gloo stands in for NCCL, the host backend for CUDA)", device_count=ctx.ep,
                    nccl=None, driver=None)
        return info
    p = torch.cuda.get_device_properties(ctx.device)
    info.update(
        device_name=torch.cuda.get_device_name(ctx.device),
        device_count=torch.cuda.device_count(),
        capability=f"{p.major}.{p.minor}",
        sm_count=p.multi_processor_count,
        l2_bytes=int(getattr(p, "L2_cache_size", 0)),
        memory_bytes=int(p.total_memory),
    )
    try:
        v = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:
        info["nccl"] = None
    info["driver"] = None
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=15)
            info["driver"] = r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
            r = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=15)
            if r.returncode == 0:
                info["topology"] = r.stdout[:4000]
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    return info


def _remote_accounting(ctx: Ctx, T: int, H: int, weights) -> dict:
    """Per-GPU mean over ranks and timed input sets of the remote (token, target) pairs."""
    cfg = ctx.cfg
    k, E, ep = cfg["top_k"], cfg["num_experts"], ctx.ep
    pairs = []
    for s in range(ep):
        for i in range(cfg["input_sets"]):
            e = make_routing_for(cfg["seed"], s, T, i, k, E, weights, ctx.device)
            pairs.append(remote_pairs(target_mask(e, E, ep), s))
    mean_pairs = sum(pairs) / len(pairs)
    return {
        "dispatch_bytes": mean_pairs * dispatch_bytes_per_token(H, k),
        "combine_bytes": mean_pairs * combine_bytes_per_token(H),
        "pairs_per_token": mean_pairs / T,
    }


def _run_point(ctx: Ctx, job_box: dict, T: int, H: int, weights) -> dict:
    cfg = ctx.cfg
    K, k, E = cfg["input_sets"], cfg["top_k"], cfg["num_experts"]
    sets = [make_inputs(cfg["seed"], ctx.rank, T, H, i, k, E, weights, ctx.device) for i in range(K)]
    static = sets[0].clone()
    # the check set (index K) is never used in timing, so stale outputs of a timed replay cannot pass a check
    sources = [make_inputs(cfg["seed"], s, T, H, K, k, E, weights, ctx.device) for s in range(ctx.ep)]

    def prepare(i):
        static.copy_from(sets[i % K])
        ctx.flush_l2()

    pt = {"T": T, "H": H, "static": static, "prepare": prepare, "sources": sources, "own": sources[ctx.rank],
          "a2ad_out": None}
    out = {"rows": [], "skipped": [], "errors": [], "notes": []}
    remote = _remote_accounting(ctx, T, H, weights) if ctx.rank == 0 else None
    for impl in job_box.get("impls", cfg["impls"]):
        t0 = time.monotonic()
        job, missing = None, None
        if impl.startswith("a2ad"):
            job, missing = job_box.get("job"), job_box.get("why") or "a2ad is not available"
        elif impl.startswith("flashinfer"):
            job, missing = job_box.get("fi"), job_box.get("fi_why") or "FlashInfer is not available"
        res, err, skip, tb = None, None, None, None
        try:
            if missing and job is None:
                raise Skip(missing)
            res, comb_out = IMPL_FUNCS[impl](ctx, job, pt)
            if impl.startswith("a2ad") and pt["a2ad_out"] is None:
                pt["a2ad_out"] = comb_out
        except Skip as exc:
            skip = str(exc)
        except Exception as exc:
            err, tb = f"rank {ctx.rank}: {type(exc).__name__}: {exc}", traceback.format_exc()
        if err is None:
            ctx.sync()
        votes = ctx.gather((res, err, skip, tb))
        errs = [v[1] for v in votes if v[1]]
        if errs and impl.startswith("a2ad") and job is not None:
            # the job's rounds may now disagree between ranks: every rank reopens it under a new name
            job.close()
            job_box["gen"] = job_box.get("gen", 0) + 1
            try:
                job_box["job"] = A2adJob(ctx, H, job_box["gen"])
                reopen_err = None
            except Exception as exc:
                job_box["job"], reopen_err = None, f"{type(exc).__name__}: {exc}"
            reopen = ctx.gather(reopen_err)
            if any(reopen):
                if job_box["job"] is not None:
                    job_box["job"].close()
                job_box["job"], job_box["why"] = None, f"reopening the a2ad job failed: {[r for r in reopen if r]}"
        if errs and impl.startswith("flashinfer") and job is not None:
            # FlashInfer has no way to re-arm its ranks' rounds: no more FlashInfer at this hidden size
            job_box["fi"], job_box["fi_why"] = None, f"FlashInfer failed earlier at hidden={H} (T={T} {impl})"
        if ctx.rank != 0:
            continue
        dt = time.monotonic() - t0
        if errs:
            out["errors"].append(f"T={T} hidden={H} {impl}: " + " | ".join(errs))
            for v in votes:
                if v[3]:
                    log(f"T={T} hidden={H} {impl} traceback:\n{v[3]}")
            log(f"T={T} hidden={H} {impl}: ERROR {errs[0]}")
            continue
        if any(v[2] for v in votes):
            out["skipped"].append({"tokens": T, "hidden": H, "impl": impl, "reason": next(v[2] for v in votes if v[2])})
            continue
        per = [v[0] for v in votes]
        row = build_row(
            impl, T, H, ctx.ep, k, E,
            step_latencies([p["dispatch"] for p in per]),
            step_latencies([p["combine"] for p in per]),
            step_latencies([p["total"] for p in per]),
            remote,
            timing=per[0]["timing"],
            routing=cfg["routing"],
            replays=len(per[0]["total"]),
            check={"ok": all(p["check"]["ok"] for p in per),
                   "why": "; ".join(f"rank {r}: {p['check']['why']}" for r, p in enumerate(per) if p["check"]["why"]),
                   "ranks": [{kk: vv for kk, vv in p["check"].items() if kk != "why"} for p in per]},
            mode=IMPL_MODE.get(impl, "eager"),
            **{k: per[0][k] for k in ("capture", "capture_why", "capture_fallback") if k in per[0]},
            **({"eager_pairs": cfg["eager_pairs"]} if IMPL_MODE.get(impl) == "eager" else {}),
            per_rank_median_us={key: [percentile(p[key], 50) for p in per] for key in ("dispatch", "combine", "total")},
            samples_us={key: [round(x, 3) for x in step_latencies([p[key] for p in per])]
                        for key in ("dispatch", "combine", "total")},
            seconds=dt,
        )
        for p in per:
            for n in p["notes"]:
                if n not in out["notes"]:
                    out["notes"].append(n)
        out["rows"].append(_finite(row))
        t = row["total_us"]
        log(f"T={T} hidden={H} {impl:<16} dispatch {row['dispatch_us']['median']:9.2f} us  combine "
            f"{row['combine_us']['median']:9.2f} us  total {t['median']:9.2f} us  "
            f"check {'ok' if row['check']['ok'] else 'FAIL: ' + row['check']['why']}  ({dt:.1f} s)")
    return out


def _append_jsonl(path: Path, obj: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(_finite(obj), default=_json_default) + "\n")


def _run_rank(ctx: Ctx) -> None:
    cfg = ctx.cfg
    run_dir = Path(cfg["run_dir"])
    points = run_dir / "points.jsonl"
    _setup_device(ctx)
    meta: dict = {}
    impls = list(cfg["impls"])
    want_fi = any(i.startswith("flashinfer") for i in impls)
    if want_fi:
        if cfg.get("flashinfer_paths") and ctx.cuda:  # the archive's kernels are built for this GPU's arch
            major, minor = torch.cuda.get_device_capability(ctx.device)
            os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", f"{major}.{minor}")
        probe = flashinfer_probe(ctx.cuda)
        probes = ctx.gather(probe)
        bad = [(r, p) for r, p in enumerate(probes) if not p["available"]]
        meta["flashinfer"] = probe if not bad else {**probe, "available": False,
                                                    "reason": f"rank {bad[0][0]}: {bad[0][1]['reason']}"}
        if bad:
            impls = [i for i in impls if not i.startswith("flashinfer")]
            want_fi = False
            if ctx.rank == 0:
                log(f"flashinfer: skipped: {meta['flashinfer']['reason']}")
                _append_jsonl(points, {"skipped": [{"impl": i, "reason": meta["flashinfer"]["reason"]}
                                                   for i in cfg["impls"] if i.startswith("flashinfer")]})
        elif ctx.rank == 0:
            log(f"flashinfer: {probe.get('version')} from {probe.get('source')}")
    else:
        meta["flashinfer"] = {"available": False, "reason": "not requested (--impls)"}
    if ctx.rank == 0:
        meta["hardware"] = hardware_info(ctx)
    if cfg["ceilings"]:
        meta["ceilings"] = measure_ceilings(ctx)
    if ctx.rank == 0:
        (run_dir / "meta.json").write_text(json.dumps(_finite(meta), default=_json_default))
        if meta.get("ceilings"):
            log(format_ceilings(meta["ceilings"]))
    weights = expert_weights(cfg["num_experts"], cfg["routing"], cfg["zipf_s"], cfg["seed"])
    want_a2ad = any(i.startswith("a2ad") for i in impls)
    durations: dict[int, float] = {}
    last = None
    for H in cfg["hidden"]:
        job_box: dict = {"gen": 0, "impls": impls}
        if want_fi:
            try:
                job_box["fi"], err = FiJob(ctx, H), None
            except Exception as exc:
                job_box["fi"], err = None, f"rank {ctx.rank}: {exception_text(exc)}"
                log(f"hidden={H}: FlashInfer's MoeAlltoAll failed:\n{traceback.format_exc()}")
            errs = [e for e in ctx.gather(err) if e]
            if errs:
                job_box["fi"], job_box["fi_why"] = None, "constructing FlashInfer's MoeAlltoAll failed: " + " | ".join(errs)
                job_box["impls"] = [i for i in impls if not i.startswith("flashinfer")]
                if ctx.rank == 0:
                    _append_jsonl(points, {"errors": [f"hidden={H}: {job_box['fi_why']}"]})
        if want_a2ad:
            try:
                job_box["job"], err = A2adJob(ctx, H, 0), None
            except Exception as exc:
                job_box["job"], err = None, f"rank {ctx.rank}: {type(exc).__name__}: {exc}"
            errs = [e for e in ctx.gather(err) if e]
            if errs:
                if job_box["job"] is not None:
                    job_box["job"].close()
                job_box["job"], job_box["why"] = None, "opening the a2ad job failed: " + " | ".join(errs)
                if ctx.rank == 0:
                    _append_jsonl(points, {"errors": [f"hidden={H}: {job_box['why']}"]})
                    log(f"hidden={H}: {job_box['why']}")
        try:
            for T in cfg["tokens"]:
                decision = None
                if ctx.rank == 0:
                    remaining = cfg["deadline"] - time.time() - cfg["reserve_s"]
                    est = durations.get(T) or (2.0 * last if last else 10.0)
                    if remaining < est:
                        decision = f"time budget: {max(remaining, 0):.0f} s left, this point needs about {est:.0f} s"
                decision = ctx.bcast(decision)
                if decision:
                    if ctx.rank == 0:
                        _append_jsonl(points, {"skipped": [{"tokens": T, "hidden": H, "reason": decision}]})
                        log(f"T={T} hidden={H}: skipped ({decision})")
                    continue
                t0 = time.monotonic()
                res = _run_point(ctx, job_box, T, H, weights)
                if ctx.cuda:
                    torch.cuda.empty_cache()  # the point's inputs and graph pools are gone now
                last = durations[T] = time.monotonic() - t0
                if ctx.rank == 0:
                    _append_jsonl(points, res)
        finally:
            if job_box.get("job") is not None:
                ctx.sync()
                job_box["job"].close()
    ctx.barrier()
    if ctx.rank == 0:
        (run_dir / "done").write_text("ok\n")


def _worker(rank: int, cfg: dict) -> None:
    """Entry point of one rank's process (spawned)."""
    for k, v in NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)
    # --flashinfer-archive: spawn hands the children the launcher's sys.path, so add the paths here
    for path in reversed(cfg.get("flashinfer_paths") or []):
        if path not in sys.path:
            sys.path.insert(0, path)
    for k, v in (cfg.get("flashinfer_env") or {}).items():
        os.environ.setdefault(k, v)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    code = 0
    try:
        why = ensure_client_package()
        if why:
            raise RuntimeError(why)
        ctx = Ctx(cfg, rank)
        _init_dist(ctx)
        _run_rank(ctx)
    except BaseException:
        code = 1
        tb = traceback.format_exc()
        try:
            (Path(cfg["run_dir"]) / f"error-rank{rank}.txt").write_text(tb)
        except OSError:
            pass
        print(f"[a2ad-bench] rank {rank} failed:\n{tb}", file=sys.stderr, flush=True)
    if code == 0:
        try:
            import torch.distributed as dist

            dist.destroy_process_group()
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never hang in interpreter teardown (NCCL, CUDA, zmq)
