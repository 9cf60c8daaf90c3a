"""`a2ad-ctl`: inspect and steer a running daemon. Human tables by default, --json for scripts.

Exit codes: 0 success, 1 the daemon answered with an error, 2 usage, 3 the daemon
cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import sys

from a2ad import errors

EXIT_ERROR = 1
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
    if "released_mapped_bytes" in mem:
        lines.append(f"              {_fmt_bytes(mem['released_mapped_bytes'])} released but still mapped by clients")
    lines.append(f"draining      {'yes' if st['draining'] else 'no'}")
    lat = st.get("rendezvous_latency_ms", {})
    if lat.get("count"):
        lines.append(f"rendezvous    {lat['count']} done, p50 {lat['p50']} ms, max {lat['max']} ms")
    lines.append(f"jobs          {len(st['jobs'])}")
    if st["jobs"]:
        lines.append("")
        lines.append(_table(_job_rows(st["jobs"]), JOB_HEADER))
    return "\n".join(lines)


def show_job(j: dict) -> str:
    spec = ", ".join(f"{k}={v}" for k, v in j["spec"].items())
    lines = [
        f"job {j['name']}: {j['state']}, ep_size {j['ep_size']}, generation {j['generation']}",
        f"spec    {spec}",
        f"memory  {_fmt_bytes(j['size_per_rank'])} per rank (row stride {_fmt_bytes(j['row_stride'])}), {_fmt_bytes(j['bytes'])} in all",
        "",
        _table(
            [[str(r["rank"]), r["state"], str(r["pid"] or "-"), str(r["device"] or "-"), str(r["attaches"]), str(r["deaths"])] for r in j["ranks"]],
            ["RANK", "STATE", "PID", "DEVICE", "ATTACHES", "DEATHS"],
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from a2ad.connection import DaemonClient

    parser = argparse.ArgumentParser(prog="a2ad-ctl", description="inspect and steer a running a2ad daemon")
    parser.add_argument("--runtime-dir", help="the daemon's runtime folder (same default as `a2ad serve`)")
    parser.add_argument("--json", action="store_true", help="print the daemon's reply as JSON")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon (default 5)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ping", help="is the daemon there? (version, backend, pid, uptime)")
    sub.add_parser("status", help="daemon, memory and every job")
    sub.add_parser("jobs", help="one line per job")
    for name, helptext in (
        ("job", "one job and its ranks"),
        ("destroy", "free a job now"),
        ("abort", "set a job's abort word: its ranks leave their waits and raise PeerLost"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("name")
    p = sub.add_parser("drain", help="refuse new jobs (existing ones run on); --off to accept again")
    p.add_argument("--off", action="store_true")
    sub.add_parser("metrics", help="metrics in Prometheus text format")
    p = sub.add_parser("upgrade", help="start a successor daemon (the installed version) and hand it every job; "
                                      "clients keep running")
    p.add_argument("--wait", type=float, default=30.0, help="seconds to wait for the successor to answer (default 30)")
    args = parser.parse_args(argv)

    client = DaemonClient(args.runtime_dir, timeout=args.timeout)
    try:
        if args.command == "ping":
            reply = client.request("hello")
            text = f"a2ad {reply['version']} pid {reply['pid']} backend {reply['backend']} up {reply['uptime_s']:.1f} s"
        elif args.command == "status":
            reply = client.request("status")
            text = show_status(reply)
        elif args.command == "jobs":
            reply = client.request("jobs")
            text = _table(_job_rows(reply["jobs"]), JOB_HEADER) if reply["jobs"] else "no jobs"
        elif args.command == "job":
            reply = client.request("job_info", job=args.name)
            text = show_job(reply)
        elif args.command == "destroy":
            reply = client.request("destroy", job=args.name)
            text = f"job {args.name} destroyed"
        elif args.command == "abort":
            reply = client.request("abort", job=args.name)
            text = f"job {args.name} aborted (generation {reply['generation']})"
        elif args.command == "drain":
            reply = client.request("drain", enable=not args.off)
            text = "draining: new jobs are refused" if reply["draining"] else "not draining: new jobs are accepted"
        elif args.command == "upgrade":
            import time

            before = client.request("hello")
            reply = client.request("upgrade")
            client.close()
            end = time.monotonic() + args.wait
            after = None
            while time.monotonic() < end:
                try:
                    after = client.request("hello", wait=1.0)
                    if after["pid"] == reply["successor_pid"]:
                        break
                except errors.DaemonUnavailable:
                    pass
                time.sleep(0.1)
            if after is None or after["pid"] != reply["successor_pid"]:
                print(f"a2ad-ctl: the successor (pid {reply['successor_pid']}) did not answer in {args.wait:g} s",
                      file=sys.stderr)
                return EXIT_UNREACHABLE
            jobs = client.request("jobs")["jobs"]
            reply = {"old_pid": before["pid"], "new_pid": after["pid"], "version": after["version"],
                     "jobs": [j["name"] for j in jobs]}
            text = (f"upgraded: pid {before['pid']} (a2ad {before['version']}) -> pid {after['pid']} "
                    f"(a2ad {after['version']}); {len(jobs)} job(s) kept: {', '.join(reply['jobs']) or '-'}")
        elif args.command == "metrics":
            reply = client.request("metrics")
            text = reply["text"].rstrip("\n")
        else:  # pragma: no cover
            parser.error(f"unknown command {args.command}")
    except errors.DaemonUnavailable as exc:
        print(f"a2ad-ctl: {exc.message}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except errors.A2ADError as exc:
        print(f"a2ad-ctl: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        client.close()
    if args.json:
        print(json.dumps(reply, indent=2, default=lambda b: b.hex() if isinstance(b, bytes) else str(b)))
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
