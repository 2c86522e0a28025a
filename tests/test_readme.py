"""Every snippet of the README runs on its own, as written, on a machine without CANN.

Each ```python block runs in a fresh interpreter whose environment names no CANN and selects
no emulator: a block must do what a reader pasting it would need. Shell blocks run in bash
from the repository's root, except the setup steps, which .ci/run runs itself (checked here to
be the README's, verbatim). A block that needs an Ascend NPU says so in a comment ("needs an
Ascend NPU") and is skipped; one that imports torch is skipped when torch is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
NEEDS_NPU = "needs an Ascend NPU"
# Set-up steps: they install the package, which .ci/run does with exactly these lines.
SETUP = re.compile(r"^(python3 -m venv|pip install)")

BLOCKS = re.findall(r"```(python|sh)\n(.*?)```", README.read_text(), re.S)


def _env() -> dict[str, str]:
    """This environment without anything that names a CANN or selects the emulator, with this
    interpreter's scripts (pyacl-moe, python) first on PATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ASCEND_", "PYACL_MOE_EMU")) and k not in ("PYACL_MOE_EMULATOR", "LD_LIBRARY_PATH")}
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


def _ids() -> list[str]:
    return [f"{lang}-{i}-{code.strip().splitlines()[0][:40]}" for i, (lang, code) in enumerate(BLOCKS)]


def test_the_readme_has_snippets_of_both_kinds():
    assert {lang for lang, _ in BLOCKS} == {"python", "sh"}


@pytest.mark.parametrize("lang,code", BLOCKS, ids=_ids())
def test_a_readme_snippet_runs_on_its_own(lang, code):
    if NEEDS_NPU in code:
        pytest.skip("the snippet says it needs an Ascend NPU")
    if re.search(r"^import torch", code, re.M) and importlib.util.find_spec("torch") is None:
        pytest.skip("the snippet needs torch (CI installs the CPU build)")
    if lang == "python":
        cmd = [sys.executable, "-c", code]
    else:
        lines = [line for line in code.splitlines() if line.strip()]
        setup = [line for line in lines if SETUP.match(line)]
        if setup:
            ci = (ROOT / ".ci" / "run").read_text()
            missing = [line for line in setup if line.split("  #")[0].strip() not in ci]
            assert not missing, f"README set-up lines that .ci/run does not run: {missing}"
            assert len(setup) == len(lines), "a set-up block holds only set-up steps"
            return
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=str(ROOT), timeout=240)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, r.stderr


def test_the_test_time_the_readme_gives_is_a_measurement():
    # A figure with where and when it was measured, not a guess ("about a minute and a half"
    # had gone stale: the run took two minutes).
    text = " ".join(README.read_text().split())
    m = re.search(r"`pytest` runs the default suite \(([\d,]+) tests: (\d+) s on two cores, measured by "
                  r"`\.ci/run` on (\d{4}-\d{2}-\d{2})", text)
    assert m, "the README's test-time sentence gives no measured figure"


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None,
                    reason="the README counts the suite where torch is not installed")
def test_the_test_count_the_readme_gives_is_what_a_fresh_clone_collects():
    """The README said 1,248 tests where a fresh clone collected 1,260 (issue: papercuts, 8)."""
    text = " ".join(README.read_text().split())
    said = int(re.search(r"`pytest` runs the default suite \(([\d,]+) tests", text).group(1).replace(",", ""))
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider"],
                       capture_output=True, text=True, cwd=str(ROOT), env=_env(), timeout=120)
    m = re.search(r"(\d+)(?:/\d+)? tests collected", r.stdout)
    assert m, r.stdout[-2000:] + r.stderr[-2000:]
    assert said == int(m.group(1)), f"the README says {said} tests; the suite collects {m.group(1)}"
