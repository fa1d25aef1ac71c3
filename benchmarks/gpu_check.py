#!/usr/bin/env python3
"""The GPU check, one command on a GPU machine (`make gpu-check`, or `bash benchmarks/gpu_check.sh`): the GPU tests,
then the GPU figures, into one JSON file.

  1. the tests marked gpu (tests/test_gpu.py: token-exact against transformers, the Triton kernels against torch, graph
     replay against eager at every captured size under torch.cuda.set_sync_debug_mode("error"), the Gemma 2 probe)
     and the Triton kernels' tests on CUDA (tests/test_triton_ops.py, test_triton_quant.py, test_triton_moe.py);
  2. benchmarks/gpu.py --quick (bandwidth and compute ceilings; the 8B shape's start-up, single-stream ITL against
     the HBM limit, busy fraction, first and warm TTFT, decode at 256 requests; int4 and fp8 ITL over bf16's; a
     Mixtral-shaped step against its active and total experts' HBM limits; offline 1B against transformers).

It runs from the source tree (PYTHONPATH), never installs the project or a torch: the machine's own torch, Triton and
transformers serve; gpu_check.sh installs the wheels carried in .whl/ (gguf) first. Each part has its own time
limit, and what a part measured is kept if a later one fails or runs out of time.

  python3 benchmarks/gpu_check.py --out DIR [--budget-s 470]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str], timeout: float, log: Path) -> dict:
    t = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=max(timeout, 1)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return {"cmd": " ".join(cmd), "rc": rc, "seconds": round(time.perf_counter() - t, 1), "log": log.name}


def junit(path: Path, log: Path) -> dict:
    """Counts and the failures (name, first lines of the message) of a pytest JUnit report; without one (the run
    was cut short), the counts and failed tests' names from the verbose log."""
    if not path.exists():
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        failed = [next((w for w in ln.split() if "::" in w), ln) for ln in lines if " FAILED" in ln or " ERROR" in ln]
        return {"missing": True, "passed": sum(" PASSED" in ln for ln in lines), "failed": len(failed),
                "skipped": sum(" SKIPPED" in ln for ln in lines), "failures": [{"test": t} for t in failed]}
    root = ET.parse(path).getroot()
    cases = root.iter("testcase")
    out = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for c in cases:
        bad = c.find("failure") if c.find("failure") is not None else c.find("error")
        if bad is not None:
            out["failed"] += 1
            msg = (bad.get("message") or bad.text or "").strip().splitlines()
            out["failures"].append({"test": f"{c.get('classname')}::{c.get('name')}", "message": msg[:6]})
        elif c.find("skipped") is not None:
            out["skipped"] += 1
        else:
            out["passed"] += 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=470.0, help="the whole check's seconds, its parts in shares")
    ap.add_argument("--skip", nargs="*", default=[], help="benchmarks/gpu.py's parts to leave out (its --skip)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + a.budget_s
    res: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    py = sys.executable
    env = subprocess.run([py, "-c", "import json, torch, triton, transformers; print(json.dumps({'torch': "
                          "torch.__version__, 'cuda': torch.version.cuda, 'triton': triton.__version__, "
                          "'transformers': transformers.__version__, 'device': torch.cuda.get_device_name() "
                          "if torch.cuda.is_available() else None}))"], capture_output=True, text=True, cwd=ROOT)
    res["versions"] = json.loads(env.stdout) if env.returncode == 0 else {"error": env.stderr[-2000:]}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        res["nvidia_smi"] = smi.stdout.strip() if smi.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        res["nvidia_smi"] = None
    print(json.dumps(res, indent=1), flush=True)

    def save() -> None:
        (out / "gpu_check.json").write_text(json.dumps(res, indent=1))

    # 1. the tests: at most 45% of the budget
    # every test marked gpu is in test_gpu.py; the fused kernels' tests run on CUDA where it is there. Verbose, so
    # that a run cut short by its time limit still says which tests passed and failed.
    # four workers: a fresh machine compiles every Triton kernel first, on its CPUs, too slowly in one process for
    # the tests' share; addopts cleared, or its -q cancels -v
    res["pytest"] = run([py, "-m", "pytest", "-o", "addopts=", "-n", "4", "-v", "--tb=short", "-p",
                         "no:cacheprovider", "--timeout=300",
                         f"--junitxml={out / 'pytest.xml'}", "tests/test_gpu.py", "tests/test_triton_ops.py",
                         "tests/test_triton_quant.py", "tests/test_triton_moe.py"],
                        0.45 * a.budget_s, out / "pytest.log")
    res["pytest"].update(junit(out / "pytest.xml", out / "pytest.log"))
    print(json.dumps(res["pytest"], indent=1), flush=True)
    save()
    # 2. the figures, in what is left
    res["bench"] = run([py, "benchmarks/gpu.py", "--quick", "--out", str(out / "bench.json"),
                        *(["--skip", *a.skip] if a.skip else [])],
                       deadline - time.perf_counter(), out / "bench.log")
    if (out / "bench.json").exists():
        res["figures"] = json.loads((out / "bench.json").read_text())
    save()
    f = res.get("figures", {})
    b8, dec, off = f.get("8b", {}), f.get("decode_256", {}), f.get("offline_1b", {})
    print("\nGPU check:", res["versions"].get("device"), res["nvidia_smi"])
    print(f"  tests: {res['pytest'].get('passed')} passed, {res['pytest'].get('failed')} failed "
          f"({res['pytest']['seconds']} s)")
    print(f"  8B ITL {b8.get('itl_ms', float('nan')):.2f} ms = {100 * b8.get('of_limit', float('nan')):.0f}% of the "
          f"HBM limit ({b8.get('hbm_limit_ms', float('nan')):.2f} ms); busy {b8.get('busy')}")
    if b8.get("async_itl_s"):
        print(f"  with async scheduling: ITL {1e3 * b8['async_itl_s']:.2f} ms, busy {b8.get('async_busy')}")
    for line in b8.get("host_profile", [])[:24]:
        print("    " + line[:150])
    print(f"  8B TTFT 2048: warm {b8.get('ttft_ms', float('nan')):.1f} ms ({100 * b8.get('ttft_of_limit', 0):.0f}% "
          f"of the compute limit), first after start {b8.get('first_ttft_ms', float('nan')):.1f} ms")
    print(f"  start {b8.get('start_s')} s, capture {b8.get('capture_s')} s, graphs {b8.get('graph_memory_gib')} GiB")
    print(f"  decode at 256: {dec.get('decode_tok_s', float('nan')):,.0f} tok/s, "
          f"{100 * dec.get('of_limit', float('nan')):.0f}% of its steps' HBM limit; async "
          f"{dec.get('async_decode_tok_s', float('nan')):,.0f} tok/s")
    prof = dec.get("profile", {})
    print(f"    8 steps at 256 under the profiler: {prof.get('wall_ms', float('nan')):.1f} ms, busy {prof.get('busy')}")
    for k in prof.get("kernels", [])[:10]:
        print(f"    {k['ms']:8.2f} ms {k['launches']:6d}x {k['name'][:100]}")
    for line in prof.get("host_profile", [])[:16]:
        print("    " + line[:150])
    print(f"  a first prompt of another length: TTFT {1e3 * b8.get('odd_ttft_s', float('nan')):.1f} ms")
    for line in b8.get("odd_profile", [])[:14]:
        print("    " + line[:150])
    print(f"  offline 1B: {off.get('tokenmill_tok_s', float('nan')):,.0f} tok/s, transformers "
          f"{off.get('transformers_tok_s', float('nan')):,.0f}: {off.get('ratio', float('nan')):.2f}x")
    kvo = f.get("offload", {})
    print(f"  KV offload host tier: restore {kvo.get('restore_gbs', float('nan')):.1f} GB/s, save "
          f"{kvo.get('save_gbs', float('nan')):.1f} GB/s; PCIe host-to-device pinned "
          f"{kvo.get('pinned_h2d_gbs', float('nan')):.1f} GB/s, pageable {kvo.get('pageable_h2d_gbs', float('nan')):.1f}")
    mk = f.get("matmul_kernels", {})
    for r in mk.get("rows", []):
        if "error" in r:
            print(f"  kernel {r['matrix']} x{r['rows']} {r['form']}: {r['error'][:120]}")
        else:
            print(f"  kernel {r['matrix']:7s} x{r['rows']:<2d} {r['form']:26s} {r['us']:9.1f} us "
                  f"{r['weight_gbs']:7.0f} GB/s  {r['over_bf16']:.2f}x bf16")
    for bits, b in mk.get("gemv_best", {}).items():
        print(f"  GEMV sweep {bits}: best {b['best']} {b['best_layer_us']:.1f} us a layer; default "
              f"{b['default']} {b['default_layer_us']}")
    for method, q in f.get("quant", {}).items():
        print(f"  quant {method}: {q}")
    print(f"  JSON: {out / 'gpu_check.json'}")
    return 0 if res["pytest"].get("failed") == 0 and res["bench"]["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
