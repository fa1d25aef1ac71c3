"""What the side-by-side benchmarks share: a measurement in a fresh process, and the commit the figures are of."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_child(script: str, spec: dict, timeout: float = 7200) -> dict:
    """`script --child SPEC` in a fresh process: its last JSON line on stdout (stderr, the progress, passed on)."""
    cmd = [sys.executable, str(Path(script).resolve()), "--child", json.dumps(spec)]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{Path(script).name} {spec} failed ({res.returncode}); its stderr is above")
    return json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])


def git_commit() -> dict:
    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT)
        return r.stdout if r.returncode == 0 else ""
    # tracked files changed since the commit (the figures are of the working tree as it was)
    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line]
    return {"tokenmill_commit": git("rev-parse", "HEAD").strip() or None, "tokenmill_dirty": bool(dirty),
            "tokenmill_dirty_files": dirty}


def write_result(path: Path, res: dict) -> None:
    """The result JSON, where the figures of BENCHMARKS.md come from."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {path}")
