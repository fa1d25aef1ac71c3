"""The GPU's Triton kernels compile for an H100 (sm_90) with Triton's own toolchain, no GPU needed
(benchmarks/triton_aot_check.py): a kernel that would not compile on the device fails here."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow     # a compile of about 120 kernels (make test-fast skips it)


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_aot_check.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "kernels compiled for sm_90" in run.stdout, run.stdout[-2000:]
