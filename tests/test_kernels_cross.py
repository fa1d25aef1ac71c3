"""The kernel library's variants against each other, through the C driver tests/csrc/kernel_check.c: every kernel
of csrc/tokenmill.h run in two builds on the same inputs, their results compared.

The NEON variant runs on no machine the suite usually sees, so it is cross-compiled for aarch64 together with the
aarch64 generic variant and both run under qemu-user; the variants of this machine's own architecture run
natively."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "csrc" / "kernel_check.c"
CSRC = ROOT / "tokenmill" / "executor" / "csrc"
CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed$")


def _compile_driver(cc: str, out: Path) -> Path:
    cmd = [cc, "-O1", "-g", "-Wall", "-I", str(CSRC), str(DRIVER), "-o", str(out), "-ldl", "-lm"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"compiling the kernel driver failed:\n  {' '.join(cmd)}\n{res.stderr}"
    return out


def _run_driver(cmd: list[str]) -> str:
    """Runs the driver, asserts every check passed, returns its output."""
    # passive: OpenMP's idle threads sleep instead of spinning on cores the rest of the suite shares
    env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    output = res.stdout + res.stderr
    lines = res.stdout.strip().splitlines()
    summary = SUMMARY.match(lines[-1]) if lines else None
    failures = "\n".join(line for line in lines if line.startswith("FAIL"))
    assert res.returncode == 0 and summary and summary.group(2) == "0", (
        f"{' '.join(cmd)} exited with {res.returncode}\n{failures}\n\nits whole output:\n{output}")
    assert int(summary.group(1)) > 100, f"far fewer checks than the driver has:\n{output}"
    return res.stdout


def _aarch64_sysroot() -> str:
    """Where the cross toolchain's aarch64 libc lives (qemu -L): Debian's /usr/aarch64-linux-gnu."""
    res = subprocess.run([CROSS_CC, "-print-file-name=libc.so.6"], capture_output=True, text=True)
    libc = Path(res.stdout.strip())
    return str(libc.resolve().parent.parent) if libc.is_absolute() and libc.exists() else "/usr/aarch64-linux-gnu"


@pytest.mark.slow
def test_neon_against_generic_under_qemu(tmp_path: Path) -> None:
    missing = [tool for tool in (CROSS_CC, QEMU) if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"no {' or '.join(missing)}: the aarch64 kernels are cross-compiled and run under qemu-user "
                    f"(Debian: apt-get install gcc-aarch64-linux-gnu qemu-user)")
    from tokenmill.executor.kernels.build import build, library_name

    build(out=tmp_path, cc=CROSS_CC, arch="aarch64", quiet=True)
    driver = _compile_driver(CROSS_CC, tmp_path / "kernel_check")
    _run_driver([QEMU, "-L", _aarch64_sysroot(), str(driver),
                 str(tmp_path / library_name("neon")), str(tmp_path / library_name("generic"))])


def test_native_variants_against_generic(tmp_path: Path) -> None:
    """Every variant this CPU runs (AVX-512, AVX2 on x86-64), as installed, against the generic one."""
    from tokenmill.executor.kernels import runnable_variants
    from tokenmill.executor.kernels.build import OUT, find_compiler, library_name, source_hash

    variants = runnable_variants()
    if len(variants) < 2 or "generic" not in variants:
        pytest.skip(f"fewer than two kernel variants built and runnable here ({', '.join(variants) or 'none'})")
    driver = _compile_driver(find_compiler(None), tmp_path / "kernel_check")
    for isa in variants:
        if isa == "generic":
            continue
        output = _run_driver([str(driver), str(OUT / library_name(isa)), str(OUT / library_name("generic"))])
        # the driver checks that both came from the same sources; that those are today's is checked here
        assert f"build_hash={source_hash()}" in output, (
            f"the kernels in {OUT} were built from other sources than tokenmill/executor/csrc: rebuild them "
            f"(make kernels)\n{output}")


@pytest.mark.slow
def test_clang_builds_the_library_and_it_agrees_with_gcc(tmp_path: Path) -> None:
    """The kernels are plain C11 plus GCC/clang vector extensions: clang builds this machine's best variant, and
    the driver finds it equal to gcc's generic build."""
    if shutil.which("clang") is None:
        pytest.skip("no clang here (Debian: apt-get install clang)")
    from tokenmill.executor.kernels import runnable_variants
    from tokenmill.executor.kernels.build import OUT, build, find_compiler, library_name

    best = runnable_variants()[0]
    try:
        build(out=tmp_path, cc="clang", isas=[best], quiet=True)
    except SystemExit as e:
        if "libomp" in str(e):
            pytest.skip(f"clang without LLVM's OpenMP runtime here: {e}")
        raise
    driver = _compile_driver(find_compiler(None), tmp_path / "kernel_check")
    _run_driver([str(driver), str(tmp_path / library_name(best)), str(OUT / library_name("generic"))])


def test_a_missing_compiler_stops_the_build_with_what_to_install(tmp_path: Path) -> None:
    from tokenmill.executor.kernels.build import build

    with pytest.raises(SystemExit, match="needs a C compiler with OpenMP.*apt-get install gcc"):
        build(out=tmp_path, cc="no-such-cc", quiet=True)
