"""Prints where the interpreter that runs this file imports pyacl_moe from (test_packaging.py:
the installed wheel's copy, not a checkout's). Run as a file, not with -m, so that only this
folder, which holds no pyacl_moe, is added to the import path."""

import pyacl_moe

print(pyacl_moe.__file__)
