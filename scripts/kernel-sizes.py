"""The size of each CUDA kernel's machine code, per source file, optionally against another revision.

After an L2 flush a launch fetches its kernel's instructions from memory, and the code on its
path is part of what a small-T round costs (docs/PERF.md, "Less code on the kernels' path").
This compiles the sources as the extension does (``nvcc -O3``, one architecture, the
extension's defines) to cubins and reads each kernel's ``.text`` section from them: no GPU is
needed, only ``nvcc``.

    python3 scripts/kernel-sizes.py                       # csrc/dispatch.cu and csrc/combine.cu, sm_90
    python3 scripts/kernel-sizes.py --against HEAD~1      # the same for a git revision, side by side
    python3 scripts/kernel-sizes.py --files sanitize.cu --arch sm_100 --timing
    python3 scripts/kernel-sizes.py --files dispatch.cu --by-line dispatch_kernelILi1ELb0ELb1E   # bytes per source line
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


def normalized(symbol: str) -> str:
    """*symbol* with an anonymous namespace under one name, ``12_GLOBAL__N_1``."""
    return ANON_NS.sub("12_GLOBAL__N_1", symbol)


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
            out[normalized(name[len(".text."):])] = h[5]
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


def compile_cubin(src: Path, arch: str, timing: bool, nvcc: str, work: Path, lineinfo: bool = False) -> Path:
    """*src* compiled to a cubin in *work* (its folder on the include path, as the extension's)."""
    if not src.is_file():
        raise FileNotFoundError(f"{src}: no such source")
    cubin = work / (src.stem + ".cubin")
    cmd = [nvcc, "-O3", "-std=c++17", f"-arch={arch}", "-cubin", f"-I{src.parent}", "-o", str(cubin), str(src)]
    if timing:
        cmd.insert(1, "-DA2AD_KERNEL_TIMING")
    if lineinfo:
        cmd.insert(1, "-lineinfo")
    print(f"compiling {src} ({arch}) ...", file=sys.stderr, flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed on {src}:\n{res.stderr[-4000:]}")
    return cubin


def compile_sizes(csrc: Path, files: list[str], arch: str, timing: bool, nvcc: str, work: Path) -> dict[str, dict[str, int]]:
    """``{file: {symbol: bytes}}`` of the sources in *csrc*."""
    return {name: text_sections(compile_cubin(csrc / name, arch, timing, nvcc, work).read_bytes()) for name in files}


_LINE = re.compile(r'\s*//## File "([^"]+)", line (\d+)(.*)')
_INLINED = re.compile(r'inlined at "([^"]+)", line (\d+)')
_INSN = re.compile(r"\s*/\*([0-9a-f]{4,})\*/")


def bytes_by_line(listing: str, source_name: str, match: str) -> dict[str, dict[int | str, int]]:
    """``{symbol: {line: bytes}}`` from ``nvdisasm -gi`` output, for the functions whose
    symbol contains *match*: each instruction is counted at the innermost frame of its
    inlining chain that lies in *source_name* (else at the outermost frame, as ``file:line``)."""
    out: dict[str, dict[int | str, int]] = {}
    current = None
    where: int | str | None = None
    for text in listing.splitlines():
        if text.startswith("//---------------------"):
            parts = text.split()
            name = next((x for x in parts if x.startswith(".text.")), None)
            symbol = normalized(name[len(".text."):]) if name else None
            current = out.setdefault(symbol, {}) if symbol and match in symbol else None
            where = None
            continue
        if current is None:
            continue
        m = _LINE.match(text)
        if m:
            frames = [(m[1], int(m[2]))] + [(f, int(n)) for f, n in _INLINED.findall(m[3])]
            where = next((n for f, n in frames if Path(f).name == source_name), None)
            if where is None:
                where = f"{Path(frames[-1][0]).name}:{frames[-1][1]}"
            continue
        if _INSN.match(text):
            current[where] = current.get(where, 0) + 16
    return out


def print_by_line(csrc: Path, name: str, match: str, arch: str, timing: bool, nvcc: str, nvdisasm: str, work: Path,
                  top: int) -> int:
    """The *top* source lines of *name* by bytes of machine code, per kernel matching *match*."""
    cubin = compile_cubin(csrc / name, arch, timing, nvcc, work, lineinfo=True)
    res = subprocess.run([nvdisasm, "-gi", str(cubin)], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"nvdisasm failed on {cubin}:\n{res.stderr[-2000:]}")
    found = bytes_by_line(res.stdout, name, match)
    if not found:
        print(f"kernel-sizes: no kernel of {name} has {match!r} in its symbol", file=sys.stderr)
        return 1
    lines = (csrc / name).read_text().splitlines()
    readable = demangle(sorted(found))
    for symbol in sorted(found, key=lambda x: readable[x]):
        per = found[symbol]
        total = sum(per.values())
        print(f"\n`{readable[symbol]}` ({name}, {arch}): {total} bytes; the {top} source lines with the most")
        print("| bytes | line | source |\n| --: | --: | --- |")
        for where, n in sorted(per.items(), key=lambda kv: -kv[1])[:top]:
            code = lines[where - 1].strip() if isinstance(where, int) and 0 < where <= len(lines) else ""
            print(f"| {n} | {where} | `{code[:90]}` |")
    return 0


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
    ap.add_argument("--by-line", metavar="MATCH",
                    help="instead: for each kernel of the (single) --files source whose symbol contains MATCH "
                         "(e.g. dispatch_kernelILi1ELb0ELb1E), the source lines with the most machine code; needs "
                         "nvdisasm (the PyPI wheel nvidia-cuda-nvdisasm has it)")
    ap.add_argument("--top", type=int, default=25, help="--by-line: how many lines per kernel (default 25)")
    args = ap.parse_args(argv)
    nvcc = shutil.which("nvcc")
    if not nvcc:
        print("kernel-sizes: nvcc not found on PATH (it compiles the sources; no GPU is needed)", file=sys.stderr)
        return 2
    files = [f.strip() for f in args.files.split(",") if f.strip()]
    if not files:
        ap.error("--files: no source named")
    nvdisasm = None
    if args.by_line is not None:
        if len(files) != 1 or args.against:
            ap.error("--by-line: one source in --files, and no --against")
        if args.top < 1:
            ap.error(f"--top: at least 1, got {args.top}")
        nvdisasm = shutil.which("nvdisasm")
        if not nvdisasm:
            print("kernel-sizes: --by-line needs nvdisasm on PATH (pip install nvidia-cuda-nvdisasm has it)",
                  file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="a2ad-sizes-") as tmp:
        work = Path(tmp)
        try:
            if nvdisasm is not None:
                return print_by_line(args.csrc, files[0], args.by_line, args.arch, args.timing, nvcc, nvdisasm, work,
                                     args.top)
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
