"""`a2ad-ctl`: inspect and steer a running daemon. Human tables by default, --json for scripts.

Global options (--runtime-dir, --json, --timeout) go anywhere on the line, before or after
the subcommand: ``a2ad-ctl status --json``.

Exit codes: 0 success, 1 the daemon answered with an error (or the client refused to talk
to it, e.g. an untrusted runtime folder), 2 usage, 3 the daemon cannot be reached.

Output: the result on stdout. Errors go to stderr as ``a2ad-ctl: CODE: MESSAGE``; with
--json, stdout carries exactly one JSON document whatever happens: the daemon's reply on
success, else ``{"ok": false, "code": ..., "message": ..., "details": {...}, "exit_code": N}``
(usage errors included, with code ``usage``), and nothing is written to stderr.

This module imports no torch (nor anything heavy): a ping is one Python start-up, one
socket probe and one request.
"""

from __future__ import annotations

import argparse
import sys

from a2ad import __version__, errors, layout as L

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(rows: list[list[str]], header: list[str]) -> str:
    cols = [header] + rows
    widths = [max(len(str(r[i])) for r in cols) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in cols]
    return "\n".join(lines)


def _job_rows(jobs: list[dict]) -> list[list[str]]:
    rows = []
    for j in jobs:
        rows.append(
            [
                j["name"],
                j["state"],
                f"{j['ranks_attached']}/{j['ep_size']}",
                str(j["ranks_dead"]),
                str(j["generation"]),
                _fmt_bytes(j["bytes"]),
                "-" if j["grace_remaining_s"] is None else f"{j['grace_remaining_s']:.1f}s",
            ]
        )
    return rows


JOB_HEADER = ["JOB", "STATE", "ATTACHED", "DEAD", "GEN", "MEMORY", "GRACE"]


def show_status(st: dict) -> str:
    be = st["backend"]
    lines = [
        f"a2ad {st['version']} (protocol {st['protocol']}), pid {st['pid']}, up {st['uptime_s']:.1f} s",
        f"runtime dir   {st['runtime_dir']}",
        f"backend       {be.get('backend')}" + (f" ({be['handle_type']} handles)" if be.get("handle_type") else ""),
    ]
    for dev in be.get("devices", []) or []:
        lines.append(
            f"  gpu {dev.get('ordinal')} {dev.get('uuid')}: workspaces {_fmt_bytes(dev.get('workspace_bytes'))}, "
            f"daemon context {_fmt_bytes(dev.get('context_overhead_bytes'))}"
        )
    mem = st["memory"]
    lines.append(
        f"memory        {_fmt_bytes(mem['job_bytes'])} in jobs (limits: {_fmt_bytes(mem['max_job_bytes'])} per job, "
        f"{_fmt_bytes(mem['max_total_bytes'])} total)"
    )
    if mem.get("released_mapped_bytes"):  # said only when some freed memory is still mapped
        lines.append(f"              {_fmt_bytes(mem['released_mapped_bytes'])} released but still mapped by clients")
    lines.append(f"draining      {'yes' if st['draining'] else 'no'}")
    dom = st.get("domain")
    if dom:
        peers = ", ".join(f"{n} {state}" for n, state in dom["nodes"].items() if state != "self")
        lines.append(f"domain        {dom['domain']}, this is node {dom['node']}; peers: {peers or 'none'}")
        for n in dom.get("name_collisions") or []:
            lines.append(f"              two daemons run as node {n}: only one is listened to (see the log)")
    lat = st.get("rendezvous_latency_ms", {})
    if lat.get("count"):
        lines.append(f"rendezvous    {lat['count']} done, p50 {lat['p50']} ms, max {lat['max']} ms")
    lines.append(f"jobs          {len(st['jobs'])}")
    if st["jobs"]:
        lines.append("")
        lines.append(_table(_job_rows(st["jobs"]), JOB_HEADER))
    return "\n".join(lines)


def _ranks_text(ranks: list[int]) -> str:
    """Ranks as ascending ranges (``0-63,65,70-255``; ``none`` for no rank)."""
    return L.format_ranks(sum(1 << r for r in set(ranks)))


def _mask_value(v) -> int | None:
    """A mask from a reply: ``layout.mask_to_bytes`` bytes (an int from an older daemon)."""
    if isinstance(v, (bytes, bytearray)):
        return L.mask_from_bytes(v)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _masks_for_json(obj):
    """The reply with every job's ``active_mask`` bytes as a JSON integer of any width, and
    ``active_mask_hex`` beside it (``0x...``: exact in tools whose numbers are doubles)."""
    if isinstance(obj, list):
        return [_masks_for_json(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    out = {k: _masks_for_json(v) for k, v in obj.items()}
    if isinstance(obj.get("active_mask"), (bytes, bytearray)):
        m = L.mask_from_bytes(obj["active_mask"])
        out["active_mask"], out["active_mask_hex"] = m, f"{m:#x}"
    return out


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def show_mask(j: dict) -> list[str]:
    """The peer-loss policy and, for a degrade job, its active-rank mask."""
    policy = j.get("on_peer_loss", "raise")
    if policy != "degrade" or j.get("active_mask") is None:
        return [f"policy  {policy}"]
    lines = ["policy  degrade (a lost rank leaves the mask; the others serve on)"]
    active = j.get("active_ranks") or []
    bits = _mask_value(j["active_mask"])
    shown = f"{bits:#x}" if bits is not None else "?"
    mask = f"active  ranks {_ranks_text(active)} of {j['ep_size']} (mask {shown}, generation {j['mask_generation']})"
    if j.get("admitting_ranks"):
        mask += f"; let in at their first dispatch: {_ranks_text(j['admitting_ranks'])}"
    lines.append(mask)
    if j.get("degraded_s") is not None:
        lines.append(f"        degraded for {_duration(j['degraded_s'])}; {j.get('readmits', 0)} replacement(s) let back in so far")
    elif j.get("readmits"):
        lines.append(f"        {j['readmits']} replacement(s) let back in so far")
    if j.get("mask_restores"):
        lines.append(f"        the published mask was changed by a client and put back {j['mask_restores']} time(s)")
    return lines


def show_job(j: dict) -> str:
    spec = ", ".join(f"{k}={v}" for k, v in j["spec"].items())
    dom = j.get("domain")
    lines = [
        f"job {j['name']}: {j['state']}, ep_size {j['ep_size']}, generation {j['generation']}",
        f"spec    {spec}",
        f"memory  {_fmt_bytes(j['size_per_rank'])} per rank (row stride {_fmt_bytes(j['row_stride'])}), {_fmt_bytes(j['bytes'])} in all",
        *show_mask(j),
    ]
    if dom:
        by_node: dict = {}
        for r in j["ranks"]:
            by_node.setdefault(r.get("node") or "-", []).append(r["rank"])
        spread = "; ".join(f"{n}: {_ranks_text(rs)}" for n, rs in sorted(by_node.items()))
        lines.append(f"domain  coordinator {dom['coordinator']}; ranks by node: {spread}"
                     + (f"; lost: {', '.join(dom['lost_nodes'])}" if dom.get("lost_nodes") else "")
                     + ("; tentative (the coordinator's decision has not arrived)" if dom.get("tentative") else ""))
    rows, header = [], ["RANK", "STATE", "PID", "DEVICE", "ATTACHES", "DEATHS"]
    for r in j["ranks"]:
        row = [str(r["rank"]), r["state"], str(r["pid"] or "-"), str(r["device"] or "-"), str(r["attaches"]), str(r["deaths"])]
        if dom:
            row.insert(1, r.get("node") or "-")
        rows.append(row)
    if dom:
        header.insert(1, "NODE")
    lines += ["", _table(rows, header)]
    return "\n".join(lines)


def show_domain(d: dict) -> str:
    """The nodes of the daemon's domain, their state and last heartbeat."""
    if not d.get("domain"):
        return "this daemon is not a node of a domain (a2ad serve --domain FILE)"
    fed = d.get("federation") or {}
    lat = fed.get("coordinated_rendezvous_ms") or {}
    lines = [
        f"domain {d['domain']} ({d['config']}): this is node {d['node']} at {d['address']}",
        f"heartbeat every {d['heartbeat_interval_s']:g} s; a node is lost after {d['loss_bound_s']:g} s of silence",
        f"refused connections {d['refused_connections']}, bad messages {d['bad_messages']}; "
        f"jobs known {fed.get('jobs', 0)}, coordinating {len(fed.get('coordinating', []))}"
        + (f", {lat['count']} rendezvous coordinated (p50 {lat['p50']} ms, max {lat['max']} ms)" if lat.get("count") else ""),
        "",
    ]

    def age(v):
        return "-" if v is None else f"{v:.2f}s ago"

    rows = []
    for n in d["nodes"]:
        if n["state"] == "self":
            rows.append([n["name"], n["address"], "self", "-", "-", "-", "-", "-"])
            continue
        rows.append([n["name"], n["address"], n["state"], _duration(n["state_for_s"]), age(n["last_heartbeat_age_s"]),
                     f"{n['messages_received']}/{n['messages_sent']}", str(n["losses"]),
                     str(n["bad_messages"] + n["handshake_failures"])])
    lines.append(_table(rows, ["NODE", "ADDRESS", "STATE", "FOR", "LAST HEARTBEAT", "MSGS IN/OUT", "LOSSES", "REFUSED"]))
    for n in d.get("name_collisions") or []:
        lines.append(f"two daemons run as node {n}: only one is listened to (see the log)")
    return "\n".join(lines)


class _Usage(Exception):
    def __init__(self, message: str, usage: str):
        super().__init__(message)
        self.message, self.usage = message, usage


class _Parser(argparse.ArgumentParser):
    """Raises _Usage instead of printing and exiting, so that --json can report it as JSON."""

    def error(self, message):
        raise _Usage(message, self.format_usage())


def _global_options() -> argparse.ArgumentParser:
    # SUPPRESS: an option given before the subcommand survives the subparser's own defaults
    g = argparse.ArgumentParser(add_help=False)
    g.add_argument("--runtime-dir", default=argparse.SUPPRESS,
                   help="the daemon's runtime folder (same default as `a2ad serve`)")
    g.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                   help="print the reply (or the error) as one JSON document on stdout")
    g.add_argument("--timeout", type=float, default=argparse.SUPPRESS,
                   help="seconds to wait for the daemon (default 5)")
    return g


def build_parser() -> argparse.ArgumentParser:
    g = _global_options()
    parser = _Parser(prog="a2ad-ctl", description="inspect and steer a running a2ad daemon", parents=[g])
    parser.add_argument("--version", action="version", version=f"a2ad-ctl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def add(name, helptext):
        return sub.add_parser(name, help=helptext, description=helptext, parents=[g])

    add("ping", "is the daemon there? (version, backend, pid, uptime)")
    add("status", "daemon, memory and every job")
    add("jobs", "one line per job")
    for name, helptext in (
        ("job", "one job and its ranks"),
        ("destroy", "free a job now"),
        ("abort", "set a job's abort word: its ranks leave their waits and raise PeerLost"),
    ):
        add(name, helptext).add_argument("name")
    p = add("drain", "refuse new jobs (existing ones run on); --off to accept again")
    p.add_argument("--off", action="store_true", help="stop draining: accept new jobs again (default: start draining)")
    add("metrics", "metrics in Prometheus text format")
    add("domain", "the nodes of this daemon's domain: their state, last heartbeat, link counters")
    p = add("upgrade", "start a successor daemon (the installed version) and hand it every job; clients keep "
                       "running. If the hand-over fails the old daemon keeps serving, and this says so")
    p.add_argument("--wait", type=float, default=30.0,
                   help="seconds to wait for the hand-over and the successor's answer (default 30)")
    p = add("shutdown", "stop the daemon; its jobs are kept for the next daemon unless --free-jobs")
    p.add_argument("--free-jobs", action="store_true", help="free every job (their ranks lose their workspaces)")
    p.add_argument("--wait", type=float, default=10.0,
                   help="seconds to wait until the daemon has stopped serving (default 10; 0: do not wait)")
    return parser


def _wants_json(argv: list[str]) -> bool:
    return "--json" in (argv[: argv.index("--")] if "--" in argv else argv)


def _json_text(obj) -> str:
    import json

    return json.dumps(_masks_for_json(obj), indent=2, default=lambda b: b.hex() if isinstance(b, bytes) else str(b))


def _fail(as_json: bool, exit_code: int, code: str, message: str, details: dict | None = None,
          text: str | None = None) -> int:
    if as_json:
        print(_json_text({"ok": False, "code": code, "message": message, "details": details or {},
                          "exit_code": exit_code}))
    else:
        print(text if text is not None else f"a2ad-ctl: {code}: {message}", file=sys.stderr)
    return exit_code


class _Failed(Exception):
    """A failure with its own wording (not a plain daemon error)."""

    def __init__(self, exit_code: int, code: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.exit_code, self.code, self.message, self.details = exit_code, code, message, details or {}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = _wants_json(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _Usage as exc:
        if as_json:
            return _fail(True, EXIT_USAGE, "usage", exc.message)
        sys.stderr.write(exc.usage)
        print(f"a2ad-ctl: error: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    as_json = getattr(args, "json", False)
    timeout = getattr(args, "timeout", 5.0)
    if not timeout > 0:
        return _fail(as_json, EXIT_USAGE, "usage", "--timeout must be > 0")

    from a2ad.connection import DaemonClient

    try:
        client = DaemonClient(getattr(args, "runtime_dir", None), timeout=timeout)
    except errors.A2ADError as exc:  # e.g. a bad $A2AD_DAEMON_UID
        return _fail(as_json, EXIT_ERROR, exc.code, exc.message, exc.details)
    try:
        reply, text = _run(args, client)
    except _Failed as exc:
        return _fail(as_json, exc.exit_code, exc.code, exc.message, exc.details)
    except errors.DaemonUnavailable as exc:
        return _fail(as_json, EXIT_UNREACHABLE, exc.code, exc.message, exc.details, text=f"a2ad-ctl: {exc.message}")
    except errors.A2ADError as exc:
        return _fail(as_json, EXIT_ERROR, exc.code, exc.message, exc.details)
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()
    print(_json_text(reply) if as_json else text)
    return 0


def _run(args, client) -> tuple[dict, str]:
    """(the reply for --json, the text for humans) of one subcommand."""
    if args.command == "ping":
        reply = client.request("hello")
        return reply, f"a2ad {reply['version']} pid {reply['pid']} backend {reply['backend']} up {reply['uptime_s']:.1f} s"
    if args.command == "status":
        reply = client.request("status")
        return reply, show_status(reply)
    if args.command == "jobs":
        reply = client.request("jobs")
        return reply, (_table(_job_rows(reply["jobs"]), JOB_HEADER) if reply["jobs"] else "no jobs")
    if args.command == "job":
        reply = client.request("job_info", job=args.name)
        return reply, show_job(reply)
    if args.command == "destroy":
        return client.request("destroy", job=args.name), f"job {args.name} destroyed"
    if args.command == "abort":
        reply = client.request("abort", job=args.name)
        return reply, f"job {args.name} aborted (generation {reply['generation']})"
    if args.command == "drain":
        reply = client.request("drain", enable=not args.off)
        return reply, ("draining: new jobs are refused" if reply["draining"] else "not draining: new jobs are accepted")
    if args.command == "metrics":
        reply = client.request("metrics")
        return reply, reply["text"].rstrip("\n")
    if args.command == "domain":
        reply = client.request("domain")
        return reply, show_domain(reply)
    if args.command == "upgrade":
        return _upgrade(args, client)
    if args.command == "shutdown":
        return _shutdown(args, client)
    raise _Failed(EXIT_USAGE, "usage", f"unknown command {args.command}")  # pragma: no cover


def _upgrade(args, client) -> tuple[dict, str]:
    """The daemon answers ``upgrade`` once the successor confirmed it holds every job
    ({successor_pid, jobs}), or with an error when the upgrade failed and the old daemon kept
    serving. Then the successor must be the one answering ``hello``."""
    import time

    before = client.request("hello")
    old = f"pid {before['pid']}, a2ad {before['version']}"
    try:
        reply = client.request("upgrade", wait=max(args.wait, client.timeout))
    except errors.DaemonUnavailable as exc:
        raise _Failed(EXIT_UNREACHABLE, exc.code,
                      f"no answer to the upgrade: {exc.message}; whether the old daemon ({old}) or a successor now "
                      "serves is unknown: check with `a2ad-ctl ping`",
                      {"old_pid": before["pid"]}) from None
    except errors.A2ADError as exc:
        raise _Failed(EXIT_ERROR, exc.code,
                      f"upgrade failed: {exc.message}; the old daemon ({old}) stayed in charge and keeps serving "
                      "every job",
                      dict(exc.details, old_pid=before["pid"], old_daemon_kept=True)) from None
    successor = reply.get("successor_pid")
    client.close()
    end = time.monotonic() + args.wait
    after = None
    while True:
        try:
            after = client.request("hello", wait=1.0)
            if after["pid"] == successor:
                break
        except errors.DaemonUnavailable:
            pass
        if time.monotonic() >= end:
            break
        time.sleep(0.1)
    if after is None or after["pid"] != successor:
        now = "nothing answers" if after is None else f"pid {after['pid']} answers"
        raise _Failed(EXIT_UNREACHABLE, "daemon_unavailable",
                      f"the successor (pid {successor}) did not answer within {args.wait:g} s ({now}); "
                      f"the old daemon was {old}", {"old_pid": before["pid"], "successor_pid": successor})
    jobs = reply.get("jobs")
    if jobs is None:
        jobs = [j["name"] for j in client.request("jobs")["jobs"]]
    jobs = [j if isinstance(j, str) else j.get("name", str(j)) for j in jobs]
    out = {"old_pid": before["pid"], "new_pid": after["pid"], "version": after["version"], "jobs": jobs}
    return out, (f"upgraded: pid {before['pid']} (a2ad {before['version']}) -> pid {after['pid']} "
                 f"(a2ad {after['version']}); {len(jobs)} job(s) kept: {', '.join(jobs) or '-'}")


def _shutdown(args, client) -> tuple[dict, str]:
    """Ask the daemon to stop, then wait (``--wait``) until it no longer serves."""
    import time

    from a2ad.connection import DaemonClient

    before = client.request("hello")
    reply = client.request("shutdown", free_jobs=bool(args.free_jobs))
    client.close()
    jobs = "its jobs freed" if args.free_jobs else "its jobs kept for the next daemon"
    out = dict(reply or {}, pid=before["pid"], free_jobs=bool(args.free_jobs), stopped=False)
    if args.wait <= 0:
        return out, f"daemon pid {before['pid']} asked to stop ({jobs})"
    end = time.monotonic() + args.wait
    while True:
        try:
            with DaemonClient(client.runtime_dir, timeout=0.5) as probe:
                probe.check_daemon()  # a stale or missing socket: the daemon is gone
        except errors.DaemonUnavailable:
            out["stopped"] = True
            return out, f"daemon pid {before['pid']} stopped ({jobs})"
        if time.monotonic() >= end:
            raise _Failed(EXIT_ERROR, "timeout",
                          f"daemon pid {before['pid']} accepted the shutdown but still listens after {args.wait:g} s",
                          {"pid": before["pid"]})
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
