"""Builds the CPU kernel library (executor/csrc) at install time, once per variant of an architecture:
x86-64: avx512, avx2, generic; aarch64: neon, generic. The running CPU picks one at load (isa.py), so one build
runs on every machine of its architecture. Called by setup.py (pip install, make setup) and by `make kernels`;
standard library only, so setup.py can run it before anything is installed.

    python tokenmill/executor/kernels/build.py [--out DIR] [--cc CC] [--arch aarch64] [--isa neon,generic]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"
OUT = Path(__file__).resolve().parent / "_lib"

# per architecture, the variants and the flags that make each one (-march sets the instruction set only;
# nothing is tuned to the build machine)
VARIANTS: dict[str, dict[str, list[str]]] = {
    "x86_64": {"avx512": ["-march=x86-64-v4"], "avx2": ["-march=x86-64-v3"], "generic": ["-march=x86-64"]},
    "aarch64": {"neon": ["-march=armv8-a"], "generic": ["-march=armv8-a+nosimd"]},
}
COMMON = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wno-unused-parameter",
          "-Wno-psabi", "-Wno-unknown-warning-option"]


def machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def sources(isa: str) -> list[Path]:
    """The variant's translation units: every kernel's generic file, plus its own arch/<isa>/ files."""
    return sorted(CSRC.glob("*.c")) + sorted((CSRC / "arch" / isa).glob("*.c"))


def source_hash() -> str:
    """Of every source and header: a library built from other sources than these is refused at load."""
    h = hashlib.sha256()
    for p in sorted(CSRC.rglob("*")):
        if p.suffix in (".c", ".h"):
            h.update(str(p.relative_to(CSRC)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def library_name(isa: str) -> str:
    return f"tokenmill-{isa}.so"


def is_clang(compiler: str) -> bool:
    res = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    return "clang" in res.stdout.lower()


def _openmp_link_flags(cc_arch: str, compiler: str) -> list[str]:
    """Link against the OpenMP runtime torch loads, so that GEMMs and our kernels share one thread pool (two
    runtimes would each keep spinning threads and fight over the cores); the compiler's own without torch, or
    with clang, whose OpenMP calls only LLVM's runtime (libomp) answers."""
    if cc_arch == machine() and not is_clang(compiler):
        try:
            import torch   # present when `make setup` builds: it installs torch first
        except ImportError:
            torch = None
        if torch is not None:
            lib = Path(torch.__file__).parent / "lib"
            gomp = sorted(lib.glob("libgomp*.so*"))
            if gomp:
                return [f"-L{lib}", f"-l:{gomp[0].name}", f"-Wl,-rpath,{lib}"]
    return ["-fopenmp"]


def find_compiler(cc: str | None) -> str:
    for name in ([cc] if cc else [os.environ.get("CC"), "gcc", "cc", "clang"]):
        if name and shutil.which(name):
            return shutil.which(name)
    raise SystemExit("tokenmill: building the CPU kernels needs a C compiler with OpenMP, and none was found. "
                     "Install one (Debian/Ubuntu: apt-get install gcc; Fedora: dnf install gcc; macOS: brew "
                     "install gcc) or name it in CC, then run `make setup` again.")


def _run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"tokenmill: building the CPU kernels failed:\n  {' '.join(cmd)}\n{res.stderr.strip()}")


def _check_loads(lib: Path, compiler: str) -> None:
    """A library that links but cannot load (a runtime missing) fails the build, not the first request."""
    import ctypes
    try:
        ctypes.CDLL(str(lib))
    except OSError as e:
        hint = " clang's OpenMP needs LLVM's runtime: install it (Debian/Ubuntu: apt-get install libomp-dev) or " \
               "build with gcc (CC=gcc)." if is_clang(compiler) else ""
        raise SystemExit(f"tokenmill: the CPU kernels built but do not load ({e}).{hint}") from e


def build(out: Path = OUT, cc: str | None = None, arch: str | None = None, isas: list[str] | None = None,
          quiet: bool = False) -> list[Path]:
    """Compiles and links each variant into out/tokenmill-<isa>.so; returns their paths."""
    arch = arch or machine()
    if arch not in VARIANTS:
        raise SystemExit(f"tokenmill: no CPU kernels for the {arch!r} architecture (have: {', '.join(VARIANTS)})")
    compiler = find_compiler(cc)
    isas = isas or list(VARIANTS[arch])
    unknown = [i for i in isas if i not in VARIANTS[arch]]
    if unknown:
        raise SystemExit(f"tokenmill: no variant {unknown[0]!r} for {arch}; choose from {', '.join(VARIANTS[arch])}")
    digest, t0 = source_hash(), time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        jobs = []
        for isa in isas:
            flags = COMMON + VARIANTS[arch][isa] + [f'-DTM_ISA_NAME="{isa}"', f'-DTM_BUILD_HASH="{digest}"']
            for src in sources(isa):
                obj = Path(tmp) / isa / (src.relative_to(CSRC).as_posix().replace("/", "_") + ".o")
                obj.parent.mkdir(exist_ok=True)
                jobs.append((isa, [compiler, *flags, "-c", str(src), "-o", str(obj)], obj))
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            list(pool.map(_run, [cmd for _, cmd, _ in jobs]))
        built = []
        for isa in isas:
            objs = [str(obj) for i, _, obj in jobs if i == isa]
            tmp_lib = Path(tmp) / library_name(isa)
            _run([compiler, "-shared", *objs, "-o", str(tmp_lib), "-lm", *_openmp_link_flags(arch, compiler)])
            if arch == machine():
                _check_loads(tmp_lib, compiler)
            os.replace(tmp_lib, out / library_name(isa))     # atomic: a running process never sees half a file
            built.append(out / library_name(isa))
    if not quiet:
        print(f"tokenmill: built CPU kernels {', '.join(isas)} for {arch} with {Path(compiler).name} "
              f"in {time.perf_counter() - t0:.1f} s -> {out}", file=sys.stderr)
    return built


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--cc")
    ap.add_argument("--arch", help="build for another architecture (a cross compiler in --cc)")
    ap.add_argument("--isa", help="comma-separated variants (default: all of the architecture)")
    a = ap.parse_args()
    build(a.out, a.cc, a.arch, a.isa.split(",") if a.isa else None)


if __name__ == "__main__":
    main()
