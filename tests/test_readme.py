"""The README's tour runs as written (on the emulator)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_tour_runs(device):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "no python block in the README"
    for code in blocks:
        if "import torch" in code and importlib.util.find_spec("torch") is None:
            continue  # the torch block needs the optional torch (CI installs the CPU build)
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})
