"""Daemon commands: one function per request type, registered in COMMANDS.

Each handler takes (daemon, request fields, context) and returns the reply payload,
or None when the reply is deferred (join waits for its rendezvous). Raising an
A2ADError answers with its code. Field validation happened in protocol.parse_request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from a2ad import errors, layout as L, protocol

log = logging.getLogger("a2ad")


@dataclass
class Context:
    identity: bytes
    request_id: int
    cred: tuple[int, int, int] | None  # (uid, gid, pid) from the ipc socket, when known


def cmd_hello(d, f, ctx) -> dict:
    """hello / ping. Reply: version, protocol, backend, pid, uptime_s."""
    st = d.status()
    return {k: st[k] for k in ("version", "protocol", "pid", "uptime_s", "runtime_dir")} | {
        "backend": d.backend.name,
        "draining": d.draining,
    }


def cmd_status(d, f, ctx) -> dict:
    """Everything: version, backend facts, jobs with their ranks, memory, counters."""
    return d.status()


def cmd_jobs(d, f, ctx) -> dict:
    """Reply: {jobs: [job summary, ...]}."""
    return {"jobs": d.status()["jobs"]}


def cmd_job_info(d, f, ctx) -> dict:
    """Request: job. Reply: that job's summary (ranks, states, spec, bytes)."""
    import time

    job = d.jobs.get(f["job"])
    if job is None:
        raise errors.NoSuchJob(f"no job named {f['job']!r}")
    return job.summary(time.monotonic())


def cmd_join(d, f, ctx):
    """Request: job, ep_rank, ep_size, spec, pid, device[, timeout]. The reply is held until
    all ep_size ranks are present; it carries the layout, a one-time ticket for fd.sock and
    the lease secret. Errors: spec_mismatch, rank_taken, rendezvous_timeout, limit_exceeded,
    invalid_field, permission_denied, draining, backend_error."""
    return d.join(ctx.identity, ctx.request_id, f, ctx.cred)


def cmd_leave(d, f, ctx) -> dict:
    """Request: job, ep_rank, lease. Marks the rank as leaving cleanly; closing the
    fd-socket connection afterwards completes the detach."""
    return d.leave(f)


def cmd_recover(d, f, ctx):
    """Request: job, ep_rank, lease[, timeout]. This rank is quiesced (nothing in flight) and
    waits for a job-wide re-arm: the reply, {generation}, is held until every rank is present
    (a dead rank replaced by a new join) and every attached rank has asked to recover; then
    the daemon resets all rows' flags and counters, bumps the generation, clears the abort
    word and releases everyone together. Errors: rendezvous_timeout (missing_ranks),
    permission_denied (bad lease, rank not attached), job_destroyed."""
    return d.recover(ctx.identity, ctx.request_id, f)


def cmd_renew(d, f, ctx) -> dict:
    """Request: job, ep_rank, lease, pid. Reply: {ticket, generation}; redeeming the ticket on
    fd.sock (no fds come back) makes that connection this rank's lease again, after a daemon
    restart or upgrade dropped the old one."""
    return d.renew(f, ctx.cred)


def cmd_upgrade(d, f, ctx) -> dict:
    """Start a successor daemon (same arguments) and hand it every job: the successor re-adopts
    them from the state file and the fd store; clients keep running. Reply: {successor_pid, jobs}."""
    return d.upgrade()


def cmd_destroy(d, f, ctx) -> dict:
    """Request: job. Frees the job now; its ranks see the abort word ABORT_DESTROYED."""
    job = d.jobs.get(f["job"])
    if job is None:
        raise errors.NoSuchJob(f"no job named {f['job']!r}")
    d.free(job, "destroyed by request")
    return {"destroyed": f["job"]}


def cmd_abort(d, f, ctx) -> dict:
    """Request: job. Sets the job's abort word (ABORT_OPERATOR): ranks in a wait leave it
    and raise PeerLost."""
    job = d.jobs.get(f["job"])
    if job is None:
        raise errors.NoSuchJob(f"no job named {f['job']!r}")
    job.control.set_abort(L.ABORT_OPERATOR, -1)
    job.needs_rearm = True
    d._dirty = True
    log.warning("job %s: aborted by operator", job.name)
    return {"aborted": job.name, "generation": job.generation}


def cmd_drain(d, f, ctx) -> dict:
    """Request: [enable=true]. While draining, joins that would create a job are refused."""
    d.draining = f.get("enable", True)
    log.info("draining %s", "on" if d.draining else "off")
    return {"draining": d.draining}


def cmd_shutdown(d, f, ctx) -> dict:
    """Request: [free_jobs=false]. Stop the daemon after this reply. Jobs are kept for the next
    daemon (state file plus fd store) unless free_jobs is set."""
    d.request_stop(free_jobs=f.get("free_jobs", False))
    return {"stopping": True, "free_jobs": f.get("free_jobs", False), "jobs": len(d.jobs)}


def cmd_metrics(d, f, ctx) -> dict:
    """Reply: {text}: the daemon's metrics in Prometheus text format."""
    from a2ad.daemon.metrics import render

    return {"text": render(d)}


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
}
assert set(COMMANDS) == set(protocol.REQUESTS), "every request type needs a handler"

#: Types a uid that fails the allow-list may still ask (nothing).
_PUBLIC: set[str] = set()


def handle(d, identity: bytes, data: bytes, cred) -> bytes | None:
    """Decode, authorize and run one request; the encoded reply, or None if deferred."""
    rid = -1
    try:
        try:
            rid = protocol.request_id(protocol.unpack(data))
        except errors.A2ADError:
            pass
        req = protocol.parse_request(data)
        if cred is not None and req.type not in _PUBLIC:
            d.check_uid(cred[0], cred[1], cred[2])
        payload = COMMANDS[req.type](d, req.fields, Context(identity, req.id, cred))
        if payload is None:
            return None
        return protocol.encode_reply(req.id, payload)
    except errors.A2ADError as exc:
        if isinstance(exc, (errors.BadMessage, errors.UnknownType, errors.UnsupportedVersion, errors.InvalidField)):
            d.counters["bad_requests"] += 1
        return protocol.encode_error(rid, exc)
    except Exception as exc:  # a bug must not take the daemon down for everyone
        log.exception("internal error handling a request")
        return protocol.encode_error(rid, errors.InternalError(f"internal error: {type(exc).__name__}: {exc}"))
