"""The examples run, as a user would run them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# What an example prints when its result checks out (examples not listed: a clean exit).
CHECKED = {"quickstart.py": "max abs difference", "streams_and_workspace.py": "max abs difference",
           "moe_layer.py": "moe layer: grad_x matches the plain NumPy loop in both modes"}
if importlib.util.find_spec("torch") is not None:  # CI installs the CPU build; without it the example says so
    CHECKED["torch_cpu.py"] = "max abs difference from the reference: 0.0"
    CHECKED["torch_autograd.py"] = "moe layer training step: loss and gradients match the plain PyTorch loop"


def test_every_checked_example_exists():
    assert set(CHECKED) <= {p.name for p in EXAMPLES.glob("*.py")}


NEEDS = {"torch_cpu.py": "torch", "torch_autograd.py": "torch", "torch_npu_training_step.py": "torch_npu"}
SKIPPED = 77  # an example's status when what it needs is missing


def _missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_runs(name):
    env = dict(os.environ, PYACL_MOE_EMULATOR="1")
    r = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, env=env, timeout=300)
    if name in NEEDS and _missing(NEEDS[name]):
        assert r.returncode == SKIPPED and "skipped: it needs" in r.stderr and not r.stdout, (r.returncode, r.stderr)
        return
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    assert CHECKED.get(name, "") in r.stdout


@pytest.mark.parametrize("name", sorted(NEEDS))
def test_an_example_whose_dependency_is_missing_says_so_and_exits_skipped(name, tmp_path):
    """They printed a line on stdout and exited 0, as a pass would (issue: papercuts, 9)."""
    for module in ("torch", "torch_npu"):  # a module of that name that cannot be imported
        (tmp_path / f"{module}.py").write_text("raise ImportError('not installed here')\n")
    env = dict(os.environ, PYACL_MOE_EMULATOR="1", PYTHONPATH=str(tmp_path))
    r = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == SKIPPED and f"{name}: skipped: it needs" in r.stderr and not r.stdout, r


def test_the_strided_example_says_which_tuple_is_a_shape():
    """It printed ``strided input: (1024, 2) -> (256, 512)``: element strides read as a shape
    (issue: papercuts, 10)."""
    r = subprocess.run([sys.executable, str(EXAMPLES / "streams_and_workspace.py")], capture_output=True, text=True,
                       env=dict(os.environ, PYACL_MOE_EMULATOR="1"), timeout=300)
    line = next(line for line in r.stdout.splitlines() if line.startswith("strided input"))
    assert "shape (2048, 512), element strides (1024, 2) -> output shape (256, 512)" in line, line
