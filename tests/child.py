"""Runs one child function in this fresh interpreter: ``python -m tests.child MODULE:FUNCTION
JSON``, made by conftest.child_command. Imports MODULE and calls FUNCTION with the JSON list of
arguments; what it prints and raises, and its exit status, are the test's to read. What it
returns stays referenced until the interpreter exits (for tests of what happens at exit)."""

from __future__ import annotations

import importlib
import json
import sys

if __name__ == "__main__":
    _target, _args = sys.argv[1], json.loads(sys.argv[2])
    _module, _, _name = _target.partition(":")
    alive_at_exit = getattr(importlib.import_module(_module), _name)(*_args)
