"""The size of each CUDA kernel's machine code, per source file, optionally against another revision.

After an L2 flush a launch fetches its kernel's instructions from memory, and the code on its
path is part of what a small-T round costs (docs/PERF.md, "Less code on the kernels' path").
This compiles the sources as the extension does (``nvcc -O3``, one architecture, the
extension's defines) to cubins and reads each kernel's ``.text`` section from them: no GPU is
needed, only ``nvcc``.

    python3 scripts/kernel-sizes.py                       # csrc/dispatch.cu and csrc/combine.cu, sm_90
    python3 scripts/kernel-sizes.py --against HEAD~1      # the same for a git revision, side by side
    python3 scripts/kernel-sizes.py --files sanitize.cu --arch sm_100 --timing
"""

from __future__ import annotations

import argparse
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILES = ("dispatch.cu", "combine.cu")


# nvcc names an anonymous namespace after the source's path (<len>_GLOBAL__N__<hash>_<n>_<file>_<hash>):
# one name for it, so that the same kernel compiled from two folders has the same symbol
ANON_NS = re.compile(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_[0-9a-f]{8}(?=\d)")


def text_sections(cubin: bytes) -> dict[str, int]:
    """``{function symbol: bytes}`` from the ``.text.<symbol>`` sections of a 64-bit ELF cubin
    (an anonymous namespace in the symbol under one name, ``12_GLOBAL__N_1``)."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("not a little-endian 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at, names_size = headers[shstrndx][4], headers[shstrndx][5]
    names = cubin[names_at:names_at + names_size]
    out = {}
    for h in headers:
        end = names.index(b"\0", h[0])
        name = names[h[0]:end].decode()
        if name.startswith(".text."):
            out[ANON_NS.sub("12_GLOBAL__N_1", name[len(".text."):])] = h[5]
    return out


def demangle(symbols: list[str]) -> dict[str, str]:
    """Readable names (``c++filt`` where it exists, else the symbols as they are), each cut to
    the kernel's name and template arguments."""
    tool = shutil.which("c++filt")
    if not tool or not symbols:
        return {s: s for s in symbols}
    res = subprocess.run([tool], input="\n".join(symbols), capture_output=True, text=True, check=False)
    lines = res.stdout.splitlines()
    if res.returncode != 0 or len(lines) != len(symbols):
        return {s: s for s in symbols}
    out = {}
    for s, d in zip(symbols, lines):
        d = d.replace("a2ad::(anonymous namespace)::", "").replace("a2ad::", "")
        d = d.split("(", 1)[0] if d.count("(") else d
        out[s] = d[len("void "):] if d.startswith("void ") else d
    return out


def compile_sizes(csrc: Path, files: list[str], arch: str, timing: bool, nvcc: str, work: Path) -> dict[str, dict[str, int]]:
    """``{file: {symbol: bytes}}`` of the sources in *csrc*."""
    sizes = {}
    for name in files:
        src = csrc / name
        if not src.is_file():
            raise FileNotFoundError(f"{src}: no such source")
        cubin = work / (src.stem + ".cubin")
        cmd = [nvcc, "-O3", "-std=c++17", f"-arch={arch}", "-cubin", f"-I{csrc}", "-o", str(cubin), str(src)]
        if timing:
            cmd.insert(1, "-DA2AD_KERNEL_TIMING")
        print(f"compiling {src} ({arch}) ...", file=sys.stderr, flush=True)
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed on {src}:\n{res.stderr[-4000:]}")
        sizes[name] = text_sections(cubin.read_bytes())
    return sizes


def revision_csrc(rev: str, work: Path) -> Path:
    """The csrc folder of git revision *rev*, unpacked into *work*."""
    dest = work / "rev"
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "csrc"], capture_output=True, check=False)
    if archive.returncode != 0:
        raise RuntimeError(f"git archive {rev} csrc: {archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest / "csrc"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", default=",".join(DEFAULT_FILES),
                    help="comma-separated sources in csrc/ (default: dispatch.cu,combine.cu)")
    ap.add_argument("--arch", default="sm_90", help="the nvcc -arch to size (default sm_90)")
    ap.add_argument("--timing", action="store_true", help="the timing build (-DA2AD_KERNEL_TIMING)")
    ap.add_argument("--against", metavar="REV", help="also size a git revision's csrc and print both")
    ap.add_argument("--csrc", type=Path, default=ROOT / "csrc", help="the sources to size (default: this tree's csrc)")
    args = ap.parse_args(argv)
    nvcc = shutil.which("nvcc")
    if not nvcc:
        print("kernel-sizes: nvcc not found on PATH (it compiles the sources; no GPU is needed)", file=sys.stderr)
        return 2
    files = [f.strip() for f in args.files.split(",") if f.strip()]
    if not files:
        ap.error("--files: no source named")
    with tempfile.TemporaryDirectory(prefix="a2ad-sizes-") as tmp:
        work = Path(tmp)
        try:
            (work / "now").mkdir()
            now = compile_sizes(args.csrc, files, args.arch, args.timing, nvcc, work / "now")
            before = None
            if args.against:
                (work / "then").mkdir()
                before = compile_sizes(revision_csrc(args.against, work), files, args.arch, args.timing, nvcc,
                                       work / "then")
        except (FileNotFoundError, RuntimeError) as exc:
            print(f"kernel-sizes: {exc}", file=sys.stderr)
            return 1
    for name in files:
        symbols = sorted(set(now[name]) | set(before[name] if before else ()))
        readable = demangle(symbols)
        print(f"\n{name} ({args.arch}{', timing build' if args.timing else ''}): bytes of machine code per kernel")
        if before is not None:
            print(f"| kernel | {args.against} | this tree | change |\n| --- | --: | --: | --: |")
        else:
            print("| kernel | bytes |\n| --- | --: |")
        for s in sorted(symbols, key=lambda x: (readable[x], x)):
            a = now[name].get(s)
            if before is None:
                print(f"| `{readable[s]}` | {a} |")
            else:
                b = before[name].get(s)
                change = f"{a - b:+d}" if a is not None and b is not None else "new" if b is None else "gone"
                print(f"| `{readable[s]}` | {b if b is not None else '-'} | {a if a is not None else '-'} | {change} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
