"""The eager host cost of two trees side by side: one eager MoeAlltoAll.dispatch + combine pair
(scripts/_eager_pair.py: a one-rank job on a daemon of its own), in two worker processes, A and
B, each importing a2ad from its own environment (e.g. another tree's installed package through
PYTHONPATH), timed in turn.

A host's CPU can change speed from one minute to the next (shared or throttled machines), so
two runs of scripts/profile-eager.py, one per tree, can differ by more than the trees do. Here
the workers' main threads share one CPU (``--cpu``) and take turns: each round times a batch of
pairs in A, then in B (B first every other round), so both meet the same host. What to compare
is B / A, the ratio of each round's two batches, over many rounds.

    python3 scripts/eager-ab.py --b-env "PYTHONPATH=/path/to/other/site" [--a-env "K=V ..."]
        [--backend cuda|host] [--tokens 1] [--hidden 7168] [--top-k 8] [--experts 256]
        [--rounds 40] [--pairs 400] [--cpu N]

Each side's environment is this one with the ``K=V`` words of its ``--a-env`` / ``--b-env``
set. Prints each side's time a pair and pair / reference (two in-place torch ops beside each
batch, as profile-eager.py), then the median of B / A with its p10-p90 and how many rounds B
took longer.
"""

from __future__ import annotations

import argparse
import os
import selectors
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _eager_pair import add_pair_arguments, eager_pair, positive

READY_TIMEOUT_S = 300.0  # a worker's start: CUDA, its daemon, the job, the JIT-built extension
ROUND_TIMEOUT_S = 120.0  # one batch of pairs and one of the reference


def assignments(text: str) -> dict[str, str]:
    out = {}
    for word in shlex.split(text):
        key, eq, value = word.partition("=")
        if not eq or not key or not key.replace("_", "a").isalnum():
            raise argparse.ArgumentTypeError(f"expected K=V words, got {word!r}")
        out[key] = value
    return out


# --- the worker: one side ------------------------------------------------------------

def worker(backend: str, tokens: int, hidden: int, top_k: int, experts: int) -> int:
    """Set the pair up, say "ready", then answer "run N FIRST" with the seconds of N pairs and of
    N references (FIRST 1: the reference first), until "quit" or end of input."""
    with eager_pair(backend, tokens, hidden, top_k, experts) as job:
        print("ready", flush=True)
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                break
            p, r = job.batch(int(words[1]), words[2] == "1")
            print(f"{p!r} {r!r}", flush=True)
    return 0


# --- the driver ---------------------------------------------------------------------

class Side:
    def __init__(self, name: str, env_words: dict[str, str], argv: list[str], folder: Path):
        self.name = name
        self.words = env_words
        env = dict(os.environ)
        env.update(env_words)
        self.err_path = folder / f"{name}.stderr"
        self.err = open(self.err_path, "w")
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     text=True, bufsize=1)
        self.pair_us: list[float] = []
        self.ratio_ref: list[float] = []

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.words.items()) or "this environment"

    def line(self, timeout: float, what: str) -> str:
        """The worker's next line, within timeout seconds; a worker that ends or stays silent is
        an error naming the side and what was waited for, with its stderr's tail."""
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            if not sel.select(timeout):
                raise RuntimeError(f"side {self.name}: no {what} within {timeout:.0f} s{self.tail()}")
        finally:
            sel.close()
        text = self.proc.stdout.readline()
        if not text:
            self.proc.wait(timeout=10)
            raise RuntimeError(f"side {self.name}: its worker ended (exit {self.proc.returncode}) "
                               f"while this waited for {what}{self.tail()}")
        return text.strip()

    def tail(self) -> str:
        self.err.flush()
        text = self.err_path.read_text(errors="replace")[-3000:]
        return f"; its stderr ends:\n{text}" if text else ""

    def close(self):
        try:
            if self.proc.poll() is None:
                try:
                    self.proc.stdin.write("quit\n")
                    self.proc.stdin.flush()
                except OSError:
                    pass
                try:
                    self.proc.wait(timeout=60)  # its job closes and its daemon stops
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
        finally:
            self.err.close()


def pct(values: list[float], f: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(f * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=5, metavar=("BACKEND", "T", "HIDDEN", "TOP_K", "EXPERTS"), help=argparse.SUPPRESS)
    ap.add_argument("--a-env", type=assignments, default={}, help="K=V words for side A (default: none)")
    ap.add_argument("--b-env", type=assignments, default={}, help="K=V words for side B (default: none)")
    add_pair_arguments(ap, "the daemons' memory backend: cuda (default; one GPU) or host (no GPU)")
    ap.add_argument("--rounds", type=positive, default=40, help="rounds, each a batch in A and one in B (default 40)")
    ap.add_argument("--pairs", type=positive, default=400, help="pairs in each batch (default 400)")
    ap.add_argument("--cpu", type=int, default=None,
                    help="the CPU both workers' main threads run on (default: the last this process may use)")
    args = ap.parse_args()
    if args.worker:
        b, t, h, k, e = args.worker
        return worker(b, int(t), int(h), int(k), int(e))
    if args.top_k > args.experts:
        ap.error(f"--top-k ({args.top_k}) must not exceed --experts ({args.experts})")
    allowed = sorted(os.sched_getaffinity(0))
    cpu = allowed[-1] if args.cpu is None else args.cpu
    if cpu not in allowed:
        ap.error(f"--cpu {cpu} is not one this process may use ({allowed})")

    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", args.backend, str(args.tokens),
            str(args.hidden), str(args.top_k), str(args.experts)]
    with tempfile.TemporaryDirectory(prefix="a2ad-eager-ab-") as tmp:
        sides = []
        try:
            for name, words in (("A", args.a_env), ("B", args.b_env)):
                sides.append(Side(name, words, argv, Path(tmp)))
            for s in sides:  # both start at once; each says when its job is up
                got = s.line(READY_TIMEOUT_S, "ready (its job set up)")
                if got != "ready":
                    raise RuntimeError(f"side {s.name}: expected 'ready', got {got!r}{s.tail()}")
                os.sched_setaffinity(s.proc.pid, {cpu})  # its main thread, which issues the pairs
            print(f"eager pair, one rank, T={args.tokens}, hidden={args.hidden}, top_k={args.top_k}, "
                  f"backend {args.backend}: {args.rounds} rounds of {args.pairs} pairs a side, in turn, "
                  f"both main threads on CPU {cpu}", flush=True)
            t0 = time.monotonic()
            for i in range(args.rounds):
                for s in (sides if i % 2 == 0 else sides[::-1]):
                    s.proc.stdin.write(f"run {args.pairs} {i % 2}\n")
                    s.proc.stdin.flush()
                    p, r = (float(v) for v in s.line(ROUND_TIMEOUT_S, f"round {i}'s batch").split())
                    s.pair_us.append(p / args.pairs * 1e6)
                    s.ratio_ref.append(p / r)
                if (i + 1) % 10 == 0 and i + 1 < args.rounds:
                    print(f"  {i + 1} of {args.rounds} rounds ({time.monotonic() - t0:.0f} s)", flush=True)
        except RuntimeError as e:
            print(f"eager-ab: {e}", file=sys.stderr)
            return 1
        finally:
            for s in sides:
                s.close()
    a, b = sides
    for s in sides:
        print(f"{s.name} ({s.describe()}): {statistics.median(s.pair_us):.2f} us a pair (median of rounds; "
              f"p10-p90 {pct(s.pair_us, 0.1):.2f}-{pct(s.pair_us, 0.9):.2f}), pair / reference "
              f"{statistics.median(s.ratio_ref):.3f}")
    ratios = [y / x for x, y in zip(a.pair_us, b.pair_us)]
    slower = sum(1 for v in ratios if v > 1)
    print(f"B / A: {statistics.median(ratios):.3f} (median of {len(ratios)} rounds; p10-p90 "
          f"{pct(ratios, 0.1):.3f}-{pct(ratios, 0.9):.3f}; B took longer in {slower} of {len(ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
