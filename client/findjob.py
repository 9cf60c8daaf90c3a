"""``find_job``: the name of the job a replacement rank should join, asked of the daemon.

When the ranks agreed on a job name among themselves (``MoeAlltoAll(..., job=None)``, see
``client/jobname.py``), a process started later to replace a dead rank cannot take part in
that agreement: the survivors are not constructing anything, and its communicator is new.
It asks the daemon instead. The daemon's job listing (the ``jobs`` request, what
``a2ad-ctl jobs`` shows) names each job this user may see with its ``ep_size``, its spec and
its owner; ``find_job`` picks the one job that

* belongs to this process's uid,
* has this ``ep_size`` and the spec ``MoeAlltoAll`` would ask for with these arguments
  (``max_num_tokens``, ``top_k``, ``num_experts``, the workspace size from
  ``workspace_size_per_rank`` or ``hidden_size``, ``on_peer_loss``),
* has ``ep_rank`` vacant: that rank died or left, and no process holds it now,

and, when ``prefix`` is given, whose name starts with it (``"fi-"`` for names
``MoeAlltoAll`` generated). It waits, at most ``timeout`` seconds, for such a job to appear
(the daemon marks a rank dead as soon as its process is gone); none: NoSuchJob naming what
was looked for; several (two groups of one geometry lost that rank at once): InputError
listing them, pass ``job=``.
"""

from __future__ import annotations

import os
import time

from a2ad import errors, layout as L, protocol

__all__ = ["find_job", "matching_jobs"]

#: rank states in which a replacement may take the rank over
VACANT = ("dead", "left")


def _spec(ep_size, max_num_tokens, top_k, num_experts, workspace_size_per_rank, hidden_size, eplb_stats_num_experts,
          on_peer_loss) -> dict:
    from .frontend import int_arg

    ep_size = int_arg("moe_ep_size", ep_size, 1, L.MAX_EP_SIZE)
    max_num_tokens = int_arg("max_num_tokens", max_num_tokens, 1)
    top_k = int_arg("top_k", top_k, 1, L.MAX_TOP_K)
    num_experts = int_arg("num_experts", num_experts, ep_size)
    protocol.check_peer_loss("on_peer_loss", on_peer_loss)
    if workspace_size_per_rank is None:
        if hidden_size is None:
            raise errors.InputError("give workspace_size_per_rank or hidden_size", argument="hidden_size")
        workspace_size_per_rank = L.moe_workspace_size_per_rank(
            ep_size, top_k, max_num_tokens, int_arg("hidden_size", hidden_size, 1),
            eplb_stats_num_experts=int_arg("eplb_stats_num_experts", eplb_stats_num_experts, 0))
    return protocol.normalize_spec({
        "max_num_tokens": max_num_tokens, "top_k": top_k, "num_experts": num_experts,
        "workspace_size_per_rank": int_arg("workspace_size_per_rank", workspace_size_per_rank, 1),
        "on_peer_loss": on_peer_loss,
    }, ep_size)


def matching_jobs(jobs: list[dict], ep_rank: int, ep_size: int, spec: dict, uid: int | None,
                  prefix: str | None = None) -> list[str]:
    """The names, among ``jobs`` (the daemon's ``jobs`` reply), of the jobs a replacement for
    ``ep_rank`` of this geometry may join (see the module doc)."""
    names = []
    for job in jobs:
        if prefix is not None and not str(job.get("name", "")).startswith(prefix):
            continue
        if uid is not None and job.get("owner_uid") not in (None, uid):
            continue
        if job.get("ep_size") != ep_size or job.get("state") == "freed":
            continue
        theirs = job.get("spec") or {}
        if any(theirs.get(k, protocol.DEFAULT_PEER_LOSS if k == "on_peer_loss" else None) != v
               for k, v in spec.items()):
            continue
        ranks = job.get("ranks") or []
        if ep_rank >= len(ranks) or ranks[ep_rank].get("state") not in VACANT:
            continue
        names.append(job["name"])
    return sorted(names)


def find_job(
    mapping,
    max_num_tokens: int,
    top_k: int,
    num_experts: int,
    workspace_size_per_rank: int | None = None,
    hidden_size: int | None = None,
    eplb_stats_num_experts: int = 0,
    *,
    on_peer_loss: str = protocol.DEFAULT_PEER_LOSS,
    runtime_dir=None,
    prefix: str | None = None,
    timeout: float = 10.0,
) -> str:
    """The name of the job whose rank ``mapping.moe_ep_rank`` this process should replace.

    Takes ``MoeAlltoAll``'s arguments (those that make the job's spec), so a replacement
    passes what the rank it replaces passed, then ``MoeAlltoAll(..., job=find_job(...))``.
    Waits at most ``timeout`` seconds; see the module doc for what matches and what is raised.
    """
    try:
        ep_rank, ep_size = int(mapping.moe_ep_rank), int(mapping.moe_ep_size)
    except AttributeError:
        raise errors.InputError("mapping must have moe_ep_rank and moe_ep_size", argument="mapping") from None
    spec = _spec(ep_size, max_num_tokens, top_k, num_experts, workspace_size_per_rank, hidden_size,
                 eplb_stats_num_experts, on_peer_loss)
    if not 0 <= ep_rank < ep_size:
        raise errors.InputError(f"moe_ep_rank must be in [0, {ep_size - 1}], got {ep_rank}", argument="mapping")
    if not (isinstance(timeout, (int, float)) and timeout >= 0):
        raise errors.InputError(f"timeout must be a number of seconds >= 0, got {timeout!r}", argument="timeout")
    from .connection import DaemonClient

    uid = os.getuid()
    end = time.monotonic() + timeout
    with DaemonClient(runtime_dir) as client:
        while True:
            jobs = client.request("jobs", wait=max(1.0, min(10.0, end - time.monotonic())))["jobs"]
            names = matching_jobs(jobs, ep_rank, ep_size, spec, uid, prefix)
            if len(names) == 1:
                return names[0]
            if len(names) > 1:
                raise errors.InputError(
                    f"{len(names)} jobs could take a replacement for rank {ep_rank} of this geometry: "
                    f"{', '.join(names)}; pass job=... to say which", argument="job")
            if time.monotonic() >= end:
                raise errors.NoSuchJob(
                    f"no job of this user with ep_size={ep_size}, spec {spec}"
                    + (f", a name starting {prefix!r}" if prefix is not None else "")
                    + f" and rank {ep_rank} dead or left appeared within {timeout:g} s "
                    f"(the daemon at {client.runtime_dir} lists {len(jobs)} job(s) for this user)",
                    ep_rank=ep_rank, ep_size=ep_size)
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))
