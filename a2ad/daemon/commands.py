"""Daemon commands: one function per request type, registered in COMMANDS.

Each handler takes (daemon, request fields, context) and returns the reply payload,
or None when the reply is deferred (join waits for its rendezvous; the registry queues the
reply for later). Raising an A2ADError answers with its code. Field validation happened in
protocol.parse_request; who may do what is decided in auth.py, job ownership in the
registry. Handlers call only the registry's public methods and the daemon's own.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

from a2ad import __version__, errors, protocol
from a2ad.daemon.auth import Peer

log = logging.getLogger("a2ad")


@dataclass
class Context:
    identity: bytes
    request_id: int
    peer: Peer  # who sent it, as the kernel says (uid, gid, pid of the ipc peer)


def cmd_hello(d, f, ctx) -> dict:
    """hello / ping. Reply: version, protocol, backend, pid, uptime_s, runtime_dir, draining,
    features (optional request fields this daemon takes: "watch", a join's or renew's watch
    threads; "lines", a join's word that its client combines through rows' lines tails)."""
    return {
        "version": __version__,
        "protocol": protocol.PROTOCOL_VERSION,
        "pid": os.getpid(),
        "uptime_s": round(time.monotonic() - d.started, 3),
        "runtime_dir": str(d.cfg.runtime_dir),
        "backend": d.backend.name,
        "draining": d.registry.draining,
        "features": ["watch", "lines"],
    }


def cmd_status(d, f, ctx) -> dict:
    """Everything: version, backend facts, jobs with their ranks, memory, counters. Other
    users' jobs are shown to admins only (``jobs_hidden`` counts the rest)."""
    return d.status(ctx.peer)


def cmd_jobs(d, f, ctx) -> dict:
    """Reply: {jobs: [job summary, ...]} (the jobs this peer may see)."""
    now = time.monotonic()
    admin = d.auth.is_admin(ctx.peer)
    return {"jobs": [j.summary(now, show_pids=admin or j.owner_uid == ctx.peer.uid) for j in d.registry.visible_jobs(ctx.peer)]}


def cmd_job_info(d, f, ctx) -> dict:
    """Request: job. Reply: that job's summary (ranks, states, spec, bytes; in a domain each
    rank's node and the job's coordinator under ``domain``). Its owner or an admin only
    (others get no_such_job)."""
    job = d.registry.job_for(ctx.peer, f["job"])
    out = job.summary(time.monotonic())
    if d.fed is not None and job.domain:
        out["domain"] = d.fed.job_info(job.name)
    return out


def cmd_domain(d, f, ctx) -> dict:
    """Reply: the domain this daemon is a node of: {domain, node, nodes: [{name, address,
    state, last_heartbeat_age_s, counters...}], federation: {...}}; {"domain": null}
    without one."""
    return d.domain_status() or {"domain": None}


def cmd_join(d, f, ctx):
    """Request: job, ep_rank, ep_size, spec, pid, device[, timeout]. The reply is held until
    all ep_size ranks are present; it carries the layout, a one-time ticket for fd.sock and
    the lease secret. Errors: spec_mismatch (also sent to the ranks already waiting),
    rank_taken, rendezvous_timeout, limit_exceeded, invalid_field, permission_denied (another
    user's job), draining, backend_error."""
    if f.get("job") not in d.registry.jobs:
        # a job the state file (or its reserve) could not record would be lost by a crash
        why = d.state.refusal(_record_bytes(f.get("ep_size")))
        if why is not None:
            raise errors.LimitExceeded(f"job {f.get('job')!r} not created: {why}; existing jobs go on serving")
    d.registry.join(ctx.peer, ctx.identity, ctx.request_id, f)
    return None


def _record_bytes(ep_size) -> int:
    """About how many bytes a job of ``ep_size`` ranks adds to the state (a generous bound)."""
    return 1024 + 256 * (ep_size if isinstance(ep_size, int) and ep_size > 0 else 1)


def cmd_leave(d, f, ctx) -> dict:
    """Request: job, ep_rank, lease. The rank leaves cleanly (its peers see it as left)."""
    return d.registry.leave(ctx.peer, f)


def cmd_recover(d, f, ctx):
    """Request: job, ep_rank, lease[, timeout]. This rank is quiesced (nothing in flight) and
    waits for a job-wide re-arm: the reply, {generation}, is held until every rank is present
    (a dead rank replaced by a new join) and every attached rank has asked to recover; then
    the daemon resets all rows' flags and counters, bumps the generation, clears the abort
    word and releases everyone together. Errors: rendezvous_timeout (missing_ranks),
    permission_denied (bad lease, rank not attached), job_destroyed."""
    d.registry.recover(ctx.peer, ctx.identity, ctx.request_id, f)
    return None


def cmd_renew(d, f, ctx) -> dict:
    """Request: job, ep_rank, lease, pid. Reply: {ticket, generation}; redeeming the ticket on
    fd.sock (no fds come back) makes that connection this rank's lease again, after a daemon
    restart or upgrade dropped the old one."""
    return d.registry.renew(ctx.peer, f)


def cmd_upgrade(d, f, ctx) -> dict:
    """Admin. Start a successor daemon (same arguments) and hand it every job; the reply,
    {successor_pid, jobs}, comes once the successor confirmed it holds every job. On failure
    the reply is an error and this daemon stays in charge."""
    d.auth.require_admin(ctx.peer, "upgrade")
    return d.upgrade()


def cmd_destroy(d, f, ctx) -> dict:
    """Request: job. Frees the job now; its ranks see the abort word ABORT_DESTROYED and raise
    JobDestroyed. Its owner or an admin only."""
    return d.registry.destroy(ctx.peer, f["job"])


def cmd_abort(d, f, ctx) -> dict:
    """Request: job. Sets the job's abort word (ABORT_OPERATOR): ranks in a wait leave it
    and raise PeerLost. Its owner or an admin only."""
    return d.registry.abort(ctx.peer, f["job"])


def cmd_drain(d, f, ctx) -> dict:
    """Admin. Request: [enable=true]. While draining, joins that would create a job are refused."""
    d.auth.require_admin(ctx.peer, "drain")
    d.registry.draining = f.get("enable", True)
    log.info("draining %s (uid %s)", "on" if d.registry.draining else "off", ctx.peer.uid)
    return {"draining": d.registry.draining}


def cmd_shutdown(d, f, ctx) -> dict:
    """Admin. Request: [free_jobs=false]. Stop the daemon after this reply. Jobs with attached
    ranks are kept for the next daemon (state file plus fd store) unless free_jobs is set."""
    d.auth.require_admin(ctx.peer, "shutdown")
    free = f.get("free_jobs", False)
    kept = 0 if free else sum(1 for j in d.registry.jobs.values() if j.attached())
    d.request_stop(free_jobs=free)
    log.info("shutdown requested by uid %s%s", ctx.peer.uid, " (freeing every job)" if free else "")
    return {"stopping": True, "free_jobs": free, "jobs_kept": kept}


def cmd_metrics(d, f, ctx) -> dict:
    """Reply: {text}: the daemon's metrics in Prometheus text format (series naming a job
    only for the jobs the asking uid may see, as in status)."""
    from a2ad.daemon.metrics import render

    return {"text": render(d, ctx.peer)}


COMMANDS: dict[str, Callable] = {
    "hello": cmd_hello,
    "status": cmd_status,
    "jobs": cmd_jobs,
    "job_info": cmd_job_info,
    "join": cmd_join,
    "leave": cmd_leave,
    "recover": cmd_recover,
    "renew": cmd_renew,
    "upgrade": cmd_upgrade,
    "destroy": cmd_destroy,
    "abort": cmd_abort,
    "drain": cmd_drain,
    "metrics": cmd_metrics,
    "shutdown": cmd_shutdown,
    "domain": cmd_domain,
}
assert set(COMMANDS) == set(protocol.REQUESTS), "every request type needs a handler"

def handle(d, identity: bytes, data: bytes, cred) -> bytes | None:
    """Decode, authorize and run one request; the encoded reply, or None if deferred."""
    rid = -1
    try:
        try:
            rid = protocol.request_id(protocol.unpack(data))
        except errors.A2ADError:
            pass
        req = protocol.parse_request(data)
        peer = Peer.from_cred(cred)
        d.auth.check_connect(peer)
        payload = COMMANDS[req.type](d, req.fields, Context(identity, req.id, peer))
        if payload is None:
            return None
        return protocol.encode_reply(req.id, payload)
    except errors.A2ADError as exc:
        if isinstance(exc, (errors.BadMessage, errors.UnknownType, errors.UnsupportedVersion, errors.InvalidField)):
            d.registry.counters["bad_requests"] += 1
        return protocol.encode_error(rid, exc)
    except Exception as exc:  # a bug must not take the daemon down for everyone
        log.exception("internal error handling a request")
        return protocol.encode_error(rid, errors.InternalError(f"internal error: {type(exc).__name__}: {exc}"))
