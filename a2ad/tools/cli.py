"""`a2ad`: serve (the daemon, in the foreground), build-ext and demo."""

from __future__ import annotations

import argparse
import logging
import sys

from a2ad import __version__, errors, runtime


def _parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 64G)") from None


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"not a positive whole number: {text!r}")
    return n


def _port(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text!r} (0-65535; 0 picks a free one)")
    return n


def _seconds(text: str) -> float:
    from a2ad.daemon.keeper import parse_linger

    try:
        return parse_linger(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runtime-dir", help="folder for sockets, lock and state (default: $A2AD_RUNTIME_DIR, "
                   "/run/a2ad where writable, $XDG_RUNTIME_DIR/a2ad, else a per-user temp folder)")
    p.add_argument("--backend", choices=["auto", "host", "cuda"], default="auto",
                   help="where workspaces live: cuda when a GPU is present with auto (default auto)")
    p.add_argument("--group", help="let members of this group connect (folder 0750, sockets 0660)")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds a job with no attached ranks is kept for re-attach (default 30)")
    p.add_argument("--max-rendezvous-timeout", type=float, default=600.0,
                   help="cap on a client's rendezvous timeout, seconds (default 600)")
    p.add_argument("--max-job-bytes", type=_parse_size, default=None,
                   help="per-job memory limit (default: the per-daemon limit)")
    p.add_argument("--max-total-bytes", type=_parse_size, default=None,
                   help="per-daemon memory limit (default: derived from the machine: half the physical memory "
                        "for host, 90%% of the GPUs' memory for cuda)")
    p.add_argument("--allow-uid", type=int, action="append", default=[],
                   help="also allow this uid (the daemon's uid and root always are); needs --group, whose folder "
                        "and socket modes let other users reach the daemon at all; repeatable")
    p.add_argument("--allow-gid", type=int, action="append", default=[], help="also allow this gid; repeatable")
    p.add_argument("--admin-group", help="members of this group administer the daemon: drain, upgrade, shutdown, "
                   "and every user's jobs (root and the daemon's uid always do)")
    p.add_argument("--max-held-joins-per-uid", type=int, default=256,
                   help="joins one uid may hold waiting for their rendezvous at once (default 256)")
    p.add_argument("--max-jobs-per-uid", type=_positive, default=256,
                   help="jobs one uid's processes may hold on this daemon at once (default 256; admins are not capped)")
    p.add_argument("--max-fds-per-uid", type=_positive, default=None,
                   help="file descriptors the daemon may hold for one uid's jobs: control blocks, rows, lease "
                        "connections and pidfds (default: half the open-file limit; admins are not capped)")
    p.add_argument("--max-bytes-per-uid", type=_parse_size, default=None,
                   help="workspace memory one uid's jobs may hold (default: half the per-daemon limit; admins are "
                        "not capped)")
    p.add_argument("--max-fd-handshakes-per-uid", type=int, default=320,  # fdsock.DEFAULT_HANDSHAKES_PER_UID
                   help="fd.sock connections one uid may hold open before presenting a ticket (default 320: "
                        "every rank of an ep_size 256 job redeems its ticket at once)")
    p.add_argument("--max-ctl-connections-per-uid", type=int, default=320,
                   help="ctl.sock connections one uid may hold open (default 320: every attached rank keeps one, "
                        "an ep_size 256 job and room; admins are not capped)")
    p.add_argument("--fd-store", choices=["auto", "systemd", "keeper", "none"], default="auto",
                   help="where workspace fds survive a daemon restart: systemd's fd store under systemd, "
                        "else a small keeper process (auto, the default); none loses jobs on restart")
    p.add_argument("--keeper-linger", type=_seconds, default=None, metavar="SECONDS",
                   help="with the fd keeper: seconds it keeps a job once no daemon is connected and no rank is "
                        "attached, then frees it (default 600)")
    p.add_argument("--takeover", action="store_true",
                   help="wait for the previous daemon to hand over the runtime folder (used by upgrade)")
    p.add_argument("--metrics-port", type=_port, metavar="PORT",
                   help="also serve Prometheus metrics at http://127.0.0.1:PORT/metrics (loopback only; default off)")
    p.add_argument("--metrics-job-names", action="store_true",
                   help="name every user's jobs in the series of the metrics port (any local user can read it); "
                        "by default only a2ad-ctl metrics names jobs, those the asking user may see")
    p.add_argument("--domain", metavar="FILE",
                   help="the config file (TOML) of the multi-node NVLink domain this node belongs to: its nodes, "
                        "their addresses and the shared key (docs/DOMAIN.md); jobs may then span nodes")
    p.add_argument("--node", metavar="NAME",
                   help="this node's name in the --domain file (default: the short host name)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="least severe log lines written to stderr: debug adds diagnostic detail (default info: one "
                        "line per lifecycle event)")


def serve(args) -> int:
    from a2ad.daemon.server import Config, Daemon

    from a2ad.daemon.sdnotify import log_handler

    # timestamped lines on a terminal; under systemd (JOURNAL_STREAM names our stderr)
    # '<priority>message' lines, since journald adds the time, unit and pid itself
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), handlers=[log_handler(sys.stderr)])
    log = logging.getLogger("a2ad")
    if args.node is not None and args.domain is None:
        log.error("cannot start: --node names this node in a --domain file; pass --domain FILE too")
        return 1
    cfg = Config(
        runtime_dir=runtime.resolve(args.runtime_dir),
        backend=args.backend,
        group=args.group,
        grace=args.grace,
        max_rendezvous_timeout=args.max_rendezvous_timeout,
        max_job_bytes=args.max_job_bytes,
        max_total_bytes=args.max_total_bytes,
        allow_uids=set(args.allow_uid),
        allow_gids=set(args.allow_gid),
        admin_group=args.admin_group,
        max_held_joins_per_uid=args.max_held_joins_per_uid,
        max_jobs_per_uid=args.max_jobs_per_uid,
        max_fds_per_uid=args.max_fds_per_uid,
        max_bytes_per_uid=args.max_bytes_per_uid,
        max_handshakes_per_uid=args.max_fd_handshakes_per_uid,
        max_zmq_peers_per_uid=args.max_ctl_connections_per_uid,
        metrics_port=args.metrics_port,
        metrics_job_names=args.metrics_job_names,
        fd_store=args.fd_store,
        keeper_linger=args.keeper_linger,
        takeover=args.takeover,
        argv=list(getattr(args, "serve_argv", [])),
        domain=args.domain,
        node=args.node,
    )
    try:
        daemon = Daemon(cfg)
        daemon.bind()
    except (runtime.RuntimeDirError, errors.A2ADError, OSError) as exc:
        log.error("cannot start: %s", getattr(exc, "message", None) or exc)
        return 1
    daemon.install_signal_handlers()
    try:
        daemon.serve_forever()
    except Exception:
        # never frees a job: they stay in the state file and the fd store for the next daemon
        log.exception("fatal error in the daemon loop")
        daemon.shutdown(fatal=True)
        return 1
    daemon.shutdown()
    return 0


def build_ext(args) -> int:
    """Build the CUDA extension ahead of time into the cache (what first use would do)."""
    import os

    def say(msg: str) -> None:
        print(f"a2ad build-ext: {msg}", flush=True)

    try:
        from a2ad.client import _ext
    except ImportError as exc:
        print(f"a2ad build-ext: cannot import the client library: {exc}", file=sys.stderr)
        return 1
    try:
        archs = _ext.cuda_archs(args.arch)
    except ValueError as exc:
        print(f"a2ad build-ext: {exc}", file=sys.stderr)
        return 2
    how = "from --arch" if args.arch else ("from A2AD_CUDA_ARCH" if os.environ.get("A2AD_CUDA_ARCH", "").strip()
                                           else ("the visible GPUs'" if _ext.visible_archs() else
                                                 f"no GPU visible, default {_ext.DEFAULT_ARCH}"))
    root = args.dir or _ext.cache_root()
    say(f"targets {','.join(archs)} ({how}); sources {_ext.csrc_dir()}; cache {root}")
    try:
        path = _ext.build(archs, args.dir, log=say)
    except errors.BuildError as exc:
        print(f"a2ad build-ext: {exc.message}", file=sys.stderr)
        return 1
    say(f"ok: {path}")
    if args.dir:
        say(f"use it with A2AD_EXT_DIR={args.dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="a2ad", description="MoE all-to-all workspace daemon")
    parser.add_argument("--version", action="version", version=f"a2ad {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser(
        "serve", help="run the daemon in the foreground",
        description="Run the a2ad daemon in the foreground: it owns every job's shared workspaces, runs the rank "
                    "rendezvous and reports dead ranks at once. One daemon per node (a lock guards its runtime "
                    "folder). Logs go to stderr.",
        epilog="a2ad-ctl talks to it (status, jobs, drain, upgrade, shutdown); README.md and docs/OPERATIONS.md "
               "describe running it.")
    add_serve_args(p_serve)
    p_build = sub.add_parser("build-ext", help="build the CUDA extension ahead of time into the cache "
                             "(needs nvcc and a CUDA build of torch, not a GPU)")
    p_build.add_argument("--arch", metavar="LIST",
                         help="comma-separated targets, e.g. sm_90,sm_100 (default: $A2AD_CUDA_ARCH, else the "
                              "visible GPUs', else sm_90)")
    p_build.add_argument("--dir", metavar="DIR",
                         help="cache root to build into (default: $A2AD_EXT_DIR, else ~/.cache/a2ad/ext)")
    p_demo = sub.add_parser("demo", help="daemon + a group of client processes doing real dispatch/combine")
    raw = list(sys.argv[1:] if argv is None else argv)
    wants_demo = next((a for a in raw if not a.startswith("-")), None) == "demo"
    if wants_demo:  # the daemon itself never loads the demo (nor what it imports)
        from a2ad.tools import demo

        demo.add_arguments(p_demo)
    args = parser.parse_args(argv)
    args.serve_argv = raw[raw.index("serve") + 1 :] if "serve" in raw else []
    if args.command == "serve":
        return serve(args)
    if args.command == "build-ext":
        return build_ext(args)
    return demo.run(args)


if __name__ == "__main__":
    sys.exit(main())
