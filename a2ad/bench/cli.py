"""The launcher: options, the configuration the ranks get, the a2ad daemon, FlashInfer archives,
one process per rank, then the results gathered, reported and written."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from .common import (DEFAULT_HIDDEN, DRY_HIDDEN, DRY_TOKENS, FULL_TOKENS, IMPLS, NO_MULTICAST_ENV, QUICK_TOKENS,
                     SCHEMA, ensure_client_package, log)

# torch and the modules that import it are loaded in main(), after the options are parsed, so that
# `a2ad-bench --help` (and a usage error) answers at once


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return vals


def _impl_list(text: str) -> list[str]:
    vals = [x for x in text.replace(" ", "").split(",") if x]
    bad = [v for v in vals if v not in IMPLS]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"implementations are {', '.join(IMPLS)}; got {text!r}")
    return vals


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1G, 256M)") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="a2ad-bench",
        description="Benchmark a2ad dispatch/combine against NCCL baselines (one process per GPU).",
        epilog="benchmarks/README.md explains every figure. Example: a2ad-bench --quick --json bench.json --plot perf.png",
    )
    g = p.add_argument_group("grid")
    g.add_argument("--tokens", type=_int_list, help=f"tokens per rank (default {','.join(map(str, FULL_TOKENS))})")
    g.add_argument("--hidden", type=_int_list, help=f"hidden sizes (default {','.join(map(str, DEFAULT_HIDDEN))})")
    g.add_argument("--top-k", type=int, default=8, help="experts each token is routed to (default 8, at most 22)")
    g.add_argument("--num-experts", type=int, default=256,
                   help="experts in the model, split over the ranks in contiguous blocks (default 256)")
    g.add_argument("--ep", type=int, help="ranks, one per GPU (default: every visible GPU; 2 on CPU)")
    g.add_argument("--routing", choices=["uniform", "skewed"], default="uniform",
                   help="uniform random experts, or Zipf-skewed expert popularity (default uniform)")
    g.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent of --routing skewed (default 1.0)")
    g.add_argument("--impls", type=_impl_list, help=f"subset of {','.join(IMPLS)} (default all)")
    g.add_argument("--quick", action="store_true", help="T in {1,128,4096}, hidden 7168, 50 replays: a smoke run")
    m = p.add_argument_group("measurement")
    m.add_argument("--replays", type=int, help="timed replays per figure (default 100; 50 with --quick)")
    m.add_argument("--warmup", type=int, default=None, help="untimed replays before every chunk of replays (default 3)")
    m.add_argument("--input-sets", type=int, default=4, help="input sets rotated between replays (default 4)")
    m.add_argument("--no-l2-flush", action="store_true", help="do not overwrite 2 x L2 between replays")
    m.add_argument("--capture", choices=["api", "plane", "auto"], default="api",
                   help="how a2ad is put in CUDA graphs: its public dispatch/combine (api, the default; falls back "
                        "to the plane, with the reason in the report, when capturing raises) or its CUDA-plane "
                        "kernels (plane); auto is api")
    m.add_argument("--eager-pairs", type=int, default=None,
                   help="eager rows: dispatch+combine pairs issued back to back per sample, one synchronize "
                        "(default 50; 5 with --dry-run)")
    m.add_argument("--eager-batches", type=int, default=None,
                   help="eager rows: samples per figure (default 20; 3 with --dry-run)")
    m.add_argument("--no-ceilings", action="store_true", help="skip the NVLink ceiling measurements")
    m.add_argument("--ceiling-bytes", type=_size, default=None, help="bytes per direction of the ceilings (default 1G)")
    m.add_argument("--seed", type=int, default=1234, help="seed of the routing and the inputs (default 1234)")
    r = p.add_argument_group("run")
    r.add_argument("--budget", type=float, default=480.0,
                   help="wall-clock seconds for the whole run; grid points that would overrun are skipped (default 480)")
    r.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: gloo instead of NCCL and the host backend instead of CUDA (timings meaningless)")
    r.add_argument("--dry-run", action="store_true", help="--device cpu with a tiny grid: checks the whole pipeline")
    r.add_argument("--runtime-dir", help="use the a2ad daemon already serving this runtime folder")
    r.add_argument("--flashinfer-archive", metavar="PATH",
                   help="a FlashInfer archive (.tgz, or the folder it was extracted to) holding the flashinfer "
                        "package and the wheels it needs: extracted and installed in the scratch folder for the "
                        "ranks only (not needed after pip install flashinfer-python)")
    r.add_argument("--a2ad-timeout", type=float, default=30.0, help="MoeAlltoAll rendezvous/peer wait timeout, seconds (default 30)")
    r.add_argument("--keep-run-dir", action="store_true", help="keep the scratch folder (daemon log, raw points)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write every result to this JSON file")
    o.add_argument("--plot", metavar="PATH", help="write latency/bandwidth plots to this PNG")
    o.add_argument("--write-perf-doc", metavar="PATH",
                   help="write a markdown report (e.g. docs/PERF.md); the plot goes beside it as perf.png unless --plot")
    return p


def resolve_config(args, visible_gpus: int) -> dict:
    """Turn parsed options into the workers' config (raises ValueError on a bad combination)."""
    cpu = args.dry_run or args.device == "cpu"
    if args.dry_run:
        tokens = args.tokens or list(DRY_TOKENS)
        hidden = args.hidden or list(DRY_HIDDEN)
    elif args.quick:
        tokens = args.tokens or list(QUICK_TOKENS)
        hidden = args.hidden or [7168]
    else:
        tokens = args.tokens or list(FULL_TOKENS)
        hidden = args.hidden or list(DEFAULT_HIDDEN)
    replays = args.replays or (5 if args.dry_run else 50 if args.quick else 100)
    warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 3)
    ep = args.ep or (2 if cpu else visible_gpus)
    if not cpu:
        if visible_gpus < 1:
            raise ValueError("no CUDA GPU is visible: run on a GPU machine, or use --dry-run (CPU, gloo)")
        if ep > visible_gpus:
            raise ValueError(f"--ep {ep} needs {ep} GPUs (one rank per GPU); {visible_gpus} visible")
    if ep < 1:
        raise ValueError("--ep must be >= 1")
    if args.num_experts < ep:
        raise ValueError(f"--num-experts ({args.num_experts}) must be >= ep ({ep})")
    if not 1 <= args.top_k <= min(22, args.num_experts):
        raise ValueError(f"--top-k must be in [1, min(22, num_experts)], got {args.top_k}")
    if any(h % 2 for h in hidden):
        raise ValueError(f"hidden sizes must be even, got {hidden}")
    if replays < 1 or warmup < 0 or args.input_sets < 1:
        raise ValueError("--replays >= 1, --warmup >= 0 and --input-sets >= 1 please")
    if args.budget <= 0:
        raise ValueError("--budget must be > 0 seconds")
    eager_batches = args.eager_batches if args.eager_batches is not None else (3 if args.dry_run else 20)
    eager_pairs = args.eager_pairs if args.eager_pairs is not None else (5 if args.dry_run else 50)
    if eager_pairs < 1 or eager_batches < 1:
        raise ValueError("--eager-pairs >= 1 and --eager-batches >= 1 please")
    if args.flashinfer_archive and not Path(args.flashinfer_archive).exists():
        raise ValueError(f"--flashinfer-archive {args.flashinfer_archive}: no such file or folder")
    impls = args.impls or list(IMPLS)
    return {
        "mode": "cpu" if cpu else "gpu",
        "device": "cpu" if cpu else "cuda",
        "tokens": sorted(set(tokens)),
        "hidden": sorted(set(hidden), reverse=True),
        "top_k": args.top_k,
        "num_experts": args.num_experts,
        "ep": ep,
        "routing": args.routing,
        "zipf_s": args.zipf_s,
        "impls": [i for i in IMPLS if i in impls],
        "replays": replays,
        "warmup": warmup,
        "chunk": 25,
        "input_sets": args.input_sets,
        "l2_flush": not (cpu or args.no_l2_flush),
        "capture": "api" if args.capture == "auto" else args.capture,
        "eager_pairs": eager_pairs,
        "eager_batches": eager_batches,
        "flashinfer_archive": args.flashinfer_archive,
        "ceilings": not args.no_ceilings,
        "ceiling_bytes": args.ceiling_bytes or ((16 << 20) if cpu else (1 << 30)),
        "seed": args.seed,
        "budget_s": args.budget,
        "reserve_s": min(30.0, max(5.0, 0.08 * args.budget)),
        "a2ad_timeout": args.a2ad_timeout,
        "pg_timeout": max(60.0, min(600.0, args.budget)),
    }


class Daemon:
    """An a2ad daemon subprocess on a private runtime folder, through the shared launcher
    (the log goes to ``log_path``, in the run folder the bench removes itself)."""

    def __init__(self, runtime_dir: Path, backend: str, log_path: Path):
        from a2ad.tools.launcher import DaemonLauncher

        self.runtime_dir, self.backend, self.log_path = runtime_dir, backend, log_path
        self._launcher = DaemonLauncher(runtime_dir, "--backend", backend, "--grace", "1", "--log-level", "info",
                                        log_path=log_path)

    @property
    def proc(self):
        return self._launcher.proc

    def start(self, timeout: float = 30.0) -> None:
        self._launcher.start(timeout)  # LaunchError (a RuntimeError) with the log's tail

    def log_tail(self, n: int = 3000) -> str:
        return self._launcher.log()[-n:]

    def stop(self) -> None:
        self._launcher.stop(timeout=15.0)


def prepare_flashinfer_archive(archive, dest, python: str | None = None) -> tuple[list[str], dict]:
    """Make a FlashInfer archive importable by the ranks, as a user's ``pip install`` would:
    extract it (a ``.tgz``; a folder is used as it is) into ``dest``, install the wheels it
    carries (apache-tvm-ffi) with ``pip install --no-index --no-deps --target``, and return
    ``(paths for sys.path / PYTHONPATH, environment variables to set where unset)``.
    Raises ValueError with the reason when that cannot be done."""
    import tarfile

    archive, dest = Path(archive), Path(dest)
    if archive.is_dir():
        root = archive.resolve()
    else:
        root = dest / "flashinfer-archive"
        root.mkdir(parents=True, exist_ok=True)
        try:
            with tarfile.open(archive) as tf:
                try:
                    tf.extractall(root, filter="data")
                except TypeError:  # a Python without extraction filters
                    tf.extractall(root)
        except (OSError, tarfile.TarError) as exc:
            raise ValueError(f"cannot extract {archive}: {exc}") from None
    if not (root / "flashinfer" / "__init__.py").is_file():
        raise ValueError(f"{archive} holds no flashinfer package at its top")
    paths = [str(root)]
    wheels = sorted(str(w) for w in root.glob("*.whl"))
    if wheels:
        site = dest / "flashinfer-site"
        cmd = [python or sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
               "--disable-pip-version-check", "--target", str(site), *wheels]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            raise ValueError(f"installing {', '.join(Path(w).name for w in wheels)} failed: {exc}") from None
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()
            raise ValueError(f"pip could not install {', '.join(Path(w).name for w in wheels)}: "
                             f"{tail[-1] if tail else 'exit ' + str(r.returncode)}")
        paths.append(str(site))
    env = {"FLASHINFER_WORKSPACE_BASE": str(dest / "flashinfer-workspace")}
    return paths, env


def _command_line(argv: list[str]) -> str:
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    head = "a2ad-bench" if prog == "a2ad-bench" else "python -m a2ad.bench"
    return " ".join([head] + [shlex.quote(a) for a in argv])


def _collect(run_dir: Path) -> dict:
    """What the ranks left in the run folder."""
    out = {"hardware": {}, "ceilings": {}, "flashinfer": {}, "rows": [], "skipped": [], "errors": [], "notes": [],
           "complete": (run_dir / "done").exists()}
    meta = run_dir / "meta.json"
    if meta.exists():
        m = json.loads(meta.read_text())
        out["hardware"], out["ceilings"] = m.get("hardware") or {}, m.get("ceilings") or {}
        out["flashinfer"] = m.get("flashinfer") or {}
    pts = run_dir / "points.jsonl"
    if pts.exists():
        for line in pts.read_text().splitlines():
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            for key in ("rows", "skipped", "errors", "notes"):
                for v in obj.get(key, []):
                    if key != "notes" or v not in out["notes"]:
                        out[key].append(v)
    for f in sorted(run_dir.glob("error-rank*.txt")):
        text = f.read_text(errors="replace").strip().splitlines()
        out["errors"].append(f"{f.stem}: {text[-1] if text else '?'} (traceback on stderr)")
    return out


def _spawn_and_wait(cfg: dict, hard_deadline: float) -> list[str]:
    """Run one process per rank; returns launcher-side problems (never hangs past hard_deadline)."""
    import torch.multiprocessing as tmp

    from .worker import _worker  # spawn pickles the target by its module name, never __main__

    mp = tmp.get_context("spawn")
    procs = [mp.Process(target=_worker, args=(r, cfg), daemon=True, name=f"a2ad-bench-rank{r}")
             for r in range(cfg["ep"])]
    for p in procs:
        p.start()
    problems: list[str] = []
    failed_at = None
    try:
        while any(p.is_alive() for p in procs):
            bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if bad and failed_at is None:
                failed_at = time.monotonic()
                log(f"rank(s) {[i for i, _ in bad]} exited with {[c for _, c in bad]}; giving the others 20 s")
            if failed_at is not None and time.monotonic() > failed_at + 20:
                problems.append("ranks still running 20 s after another rank failed were stopped")
                break
            if time.time() > hard_deadline:
                problems.append("the time budget ran out with ranks still running: stopped them (raise --budget)")
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    for i, p in enumerate(procs):
        if p.exitcode not in (0, None) and not problems:
            problems.append(f"rank {i} exited with {p.exitcode}")
    return problems


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    import torch

    from .plotting import plot, plot_unavailable
    from .report import _finite, make_report, perf_doc, sort_rows, write_json
    from .results import add_comparisons, add_speedups, capture_summary, comparisons, evaluate_targets

    if args.plot:  # fail before the run, not after it
        why = plot_unavailable()
        if why:
            parser.exit(2, f"a2ad-bench: error: {why}\n")
    started = time.time()
    for k, v in NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)
    cpu = args.dry_run or args.device == "cpu"
    visible = 0
    if not cpu:
        try:
            visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception:
            visible = 0
    try:
        cfg = resolve_config(args, visible)
    except ValueError as exc:
        parser.error(str(exc))
    why = ensure_client_package()
    if why:
        log(why)
        return 2
    cfg["deadline"] = started + args.budget
    command = _command_line(argv)
    run_dir = Path(tempfile.mkdtemp(prefix="a2ad-bench-"))
    cfg["run_dir"] = str(run_dir)
    cfg["run_id"] = f"bench{os.getpid()}"
    errors_: list[str] = []
    notes: list[str] = []
    skipped: list[dict] = []
    fi_info: dict = {}
    daemon = None
    if cfg["flashinfer_archive"] and any(i.startswith("flashinfer") for i in cfg["impls"]):
        try:
            paths, env = prepare_flashinfer_archive(cfg["flashinfer_archive"], run_dir)
            cfg["flashinfer_paths"], cfg["flashinfer_env"] = paths, env
            os.environ["PYTHONPATH"] = os.pathsep.join(paths + [x for x in [os.environ.get("PYTHONPATH")] if x])
            log(f"flashinfer: {cfg['flashinfer_archive']} ready for the ranks")
        except ValueError as exc:
            reason = f"--flashinfer-archive: {exc}"
            log(f"flashinfer: skipped: {reason}")
            fi_info = {"available": False, "reason": reason}
            skipped += [{"impl": i, "reason": reason} for i in cfg["impls"] if i.startswith("flashinfer")]
            cfg["impls"] = [i for i in cfg["impls"] if not i.startswith("flashinfer")]
    log(f"{cfg['mode']} run: ep={cfg['ep']} tokens={cfg['tokens']} hidden={cfg['hidden']} impls={cfg['impls']} "
        f"replays={cfg['replays']} budget={args.budget:.0f} s; scratch {run_dir}")
    try:
        wants_a2ad = any(i.startswith("a2ad") for i in cfg["impls"]) or cfg["ceilings"]
        if wants_a2ad and not cpu:
            try:
                from a2ad.client import _ext

                _ext.load()  # build once here, not in every rank at once
            except Exception as exc:
                errors_.append(f"the a2ad CUDA extension is unavailable, a2ad rows skipped: {exc}")
                log(errors_[-1])
                cfg["impls"] = [i for i in cfg["impls"] if not i.startswith("a2ad")]
        if args.runtime_dir:
            from a2ad.connection import ping

            try:
                hello = ping(args.runtime_dir, timeout=5.0)
            except Exception as exc:
                parser.error(f"no a2ad daemon answers in --runtime-dir {args.runtime_dir}: {exc}")
            if hello.get("backend") != ("host" if cpu else "cuda"):
                parser.error(f"the daemon in {args.runtime_dir} runs the {hello.get('backend')} backend; "
                             f"this run needs {'host' if cpu else 'cuda'}")
            cfg["runtime_dir"] = str(args.runtime_dir)
        else:
            rt = run_dir / "rt"
            daemon = Daemon(rt, "host" if cpu else "cuda", run_dir / "daemon.log")
            daemon.start()
            cfg["runtime_dir"] = str(rt)
        problems = _spawn_and_wait(cfg, cfg["deadline"] - 5.0)
        errors_ += problems
    except KeyboardInterrupt:
        errors_.append("interrupted")
    except Exception as exc:
        errors_.append(f"{type(exc).__name__}: {exc}")
        log(traceback.format_exc())
    finally:
        if daemon is not None:
            daemon.stop()
    got = _collect(run_dir)
    rows = got["rows"]
    add_speedups(rows)
    add_comparisons(rows)
    public_cfg = {k: v for k, v in cfg.items()
                  if k not in ("run_dir", "deadline", "runtime_dir", "run_id", "flashinfer_paths", "flashinfer_env")}
    result = {
        "schema": SCHEMA,
        "command": command,
        "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "finished": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": public_cfg,
        "hardware": got["hardware"],
        "ceilings": got["ceilings"],
        "flashinfer": fi_info or got["flashinfer"],
        "capture": capture_summary(rows, cfg["capture"]),
        "comparisons": comparisons(rows),
        "rows": sort_rows(rows),
        "skipped": skipped + got["skipped"],
        "errors": errors_ + got["errors"],
        "notes": notes + got["notes"],
        "complete": got["complete"],
        "wall_s": round(time.time() - started, 1),
    }
    if cpu:
        result["notes"].insert(0, "CPU run: gloo stands in for NCCL and the host backend for CUDA; the figures "
                                  "check the pipeline, they are not performance")
    result["targets"] = [] if cpu else evaluate_targets(result["rows"], result["ceilings"])
    result = _finite(result)
    print(make_report(result), flush=True)
    plot_path = args.plot
    if args.write_perf_doc and not plot_path:
        plot_path = str(Path(args.write_perf_doc).parent / "perf.png")
    if plot_path:
        why = plot(result, plot_path)
        if why:
            log(why)
            plot_path = None
        else:
            log(f"plot: {plot_path}")
    if args.json:
        write_json(result, args.json)
        log(f"json: {args.json}")
    if args.write_perf_doc:
        doc = Path(args.write_perf_doc)
        doc.parent.mkdir(parents=True, exist_ok=True)
        rel = os.path.relpath(plot_path, doc.parent) if plot_path else None
        doc.write_text(perf_doc(result, rel))
        log(f"perf doc: {doc}")
    if daemon is not None and (errors_ or got["errors"]):
        tail = daemon.log_tail(1500)
        if tail:
            log(f"daemon log tail:\n{tail}")
    if args.keep_run_dir:
        log(f"scratch kept: {run_dir}")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    failed_checks = [r for r in result["rows"] if not (r.get("check") or {}).get("ok", True)]
    if failed_checks:
        log(f"{len(failed_checks)} row(s) failed their correctness check")
    return 1 if (result["errors"] or failed_checks) else 0
