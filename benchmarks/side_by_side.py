"""``pyacl-moe --emulator bench --quick --json`` on another checkout of the project and on this
one, alternating, and the target ratios of each run (BENCHMARKS.md). Run:
``python benchmarks/side_by_side.py OTHER_CHECKOUT [RUNS]`` (e.g. a ``git worktree`` of an
older commit; both run with this interpreter).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
RATIOS = {
    "plan overhead": lambda r: (r["plan_launch_ns"] - r["raw_launch_ns"]) / r["ffi_call_ns"],
    "backward one call": lambda r: r["oneshot_launch_ns"] / r["ffi_call_ns"],
    "forward one call, out given": lambda r: r["fwd_oneshot_out_launch_ns"] / r["ffi_call_ns"],
    "forward one call": lambda r: r["fwd_oneshot_launch_ns"] / r["ffi_call_ns"],
    "NumPy call": lambda r: (r["numpy_call_ns"] - r["numpy_kernel_ns"]) / r["numpy_copy_ns"],
    "the unit (ns)": lambda r: r["ffi_call_ns"],
}


def run(tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-m", "pyacl_moe.cli", "--emulator", "bench", "--quick", "--json"],
                         cwd="/", env=env, capture_output=True, text=True, check=False).stdout
    return json.loads(out)


def main() -> None:
    other, runs = Path(sys.argv[1]).resolve(), int(sys.argv[2]) if len(sys.argv) > 2 else 3
    results: dict[str, list[dict]] = {str(other): [], str(HERE): []}
    for _ in range(runs):
        for tree in (other, HERE):
            results[str(tree)].append(run(tree))
    for tree, rs in results.items():
        print(tree)
        for name, ratio in RATIOS.items():
            print(f"  {name:28s} " + " / ".join(f"{ratio(r):.2f}" for r in rs))


if __name__ == "__main__":
    main()
