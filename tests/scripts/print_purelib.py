"""Prints the site-packages folder of the interpreter that runs this file (test_packaging.py
runs it in a fresh virtual environment)."""

import sysconfig

print(sysconfig.get_paths()["purelib"])
