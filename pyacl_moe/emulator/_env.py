"""The emulator's environment variables, checked before the libraries are used.

The emulated libascendcl reads the same variables with the same rules (rt_state.c,
``config_locked``) and makes aclInit fail on a malformed one; checking them here first turns a
typo into an exception that names the variable and the accepted forms, when the emulator is
selected or built, instead of a status at the first call. An empty value means unset.
docs/emulator.md lists the variables.

Plain Python: neither imports cffi nor loads anything. The SoC names are the binding's table
(pyacl_moe._contract.SOCS), which the C library's (emu.h) matches.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Mapping

from .._contract import SOCS, family_of
from ._errors import EmulatorBuildError
from ._releases import DEFAULT, PROFILES, SHORT_NAMES, canonical, selected

PREFIX = "PYACL_MOE_EMU_"
MAX_DEVICES = 64  # EMU_MAX_DEVICES in rt_internal.h
MAX_CAPACITY = 1 << 40  # EMU_MAX_CAPACITY in rt_state.c: the largest device range reserved
MAX_QUEUE_DEPTH = 1 << 24
MAX_THREADS_SETTING = 1024
MUTATIONS = ("none", "skip-last-k", "fp16-accumulate", "off-by-one-row", "fwd-unstable-sort", "fwd-wrong-row",
             "skip-last-row", "overrun")
STREAM_MODES = ("async", "lazy")
SANITIZERS = ("address", "undefined", "leak", "thread")

_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)([kKmMgGtT]?)")
_SOC = re.compile(r"[A-Za-z0-9_.-]{1,63}")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class EmulatorConfigError(EmulatorBuildError, ValueError):
    """A PYACL_MOE_EMU_* environment variable has a value the emulator does not accept (an
    EmulatorBuildError too: the emulator cannot be used as configured)."""


def _int(lo: int, hi: int) -> Callable[[str], bool]:
    # Digits only, as the C side reads them: no sign, blank, underscore or exponent.
    return lambda v: v.isascii() and v.isdigit() and lo <= int(v) <= hi


def _size(v: str) -> bool:
    m = _SIZE.fullmatch(v)
    if not m or len(m.group(1).replace(".", "")) > 20:
        return False
    return 1 <= float(m.group(1)) * _UNITS[m.group(2).lower()] <= MAX_CAPACITY


def _sanitizers(v: str) -> bool:
    names = [n.strip() for n in v.split(",") if n.strip()]
    return bool(names) and all(n in SANITIZERS for n in names)


def _seconds(v: str) -> bool:
    try:
        x = float(v)
    except ValueError:
        return False
    return x > 0 and x < float("inf")


# name -> (check, accepted forms). The C library reads all but the last three, which only the
# build reads (_build.py, _releases.py).
VARIABLES: dict[str, tuple[Callable[[str], bool], str]] = {
    "PYACL_MOE_EMU_DEVICES": (_int(0, MAX_DEVICES), f"a whole number of devices from 0 to {MAX_DEVICES}"),
    "PYACL_MOE_EMU_MEMORY": (_size, "a positive number of bytes, optionally with a fraction and one of the "
                                    "suffixes K, M, G, T (powers of 1024), e.g. 8G or 1.5M, at most 1T"),
    "PYACL_MOE_EMU_SOC": (lambda v: bool(_SOC.fullmatch(v)) and v in SOCS,
                          "a SoC name CANN's platform files give a family the op is built for: Ascend910B1 to "
                          "Ascend910B4 (Atlas A2), Ascend910_9362 to Ascend910_9392 (Atlas A3), Ascend950PR_* or "
                          "Ascend950DT_* (arch35), e.g. Ascend950PR_9599"),
    "PYACL_MOE_EMU_MUTATION": (lambda v: v in MUTATIONS, "one of " + ", ".join(MUTATIONS)),
    "PYACL_MOE_EMU_STREAMS": (lambda v: v in STREAM_MODES, "async or lazy"),
    "PYACL_MOE_EMU_QUEUE_DEPTH": (_int(1, MAX_QUEUE_DEPTH), f"a whole number of tasks from 1 to {MAX_QUEUE_DEPTH}"),
    "PYACL_MOE_EMU_THREADS": (_int(1, MAX_THREADS_SETTING),
                              f"a whole number of kernel threads from 1 to {MAX_THREADS_SETTING} "
                              "(at most 16 are used)"),
    "PYACL_MOE_EMU_SANITIZE": (_sanitizers, "a comma-separated list of " + ", ".join(SANITIZERS)),
    "PYACL_MOE_EMU_BUILD_TIMEOUT": (_seconds, "a positive number of seconds, e.g. 300 or 0.5"),
    "PYACL_MOE_EMU_RELEASE": (lambda v: canonical(v) is not None, "one of the emulated releases "
                              + ", ".join(PROFILES) + " or its line " + ", ".join(SHORT_NAMES)
                              + f" (default {DEFAULT})"),
}


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Raise EmulatorConfigError naming every malformed PYACL_MOE_EMU_* variable and its
    accepted forms; warn about a PYACL_MOE_EMU_* name the emulator does not know (a typo would
    otherwise be ignored silently)."""
    env = os.environ if environ is None else environ
    problems = []
    for name, (ok, forms) in VARIABLES.items():
        value = env.get(name, "")
        if value and not ok(value):
            problems.append(f"{name}={value!r} is malformed: use {forms}")
    soc = env.get("PYACL_MOE_EMU_SOC", "")
    release = env.get("PYACL_MOE_EMU_RELEASE", "").strip()
    if family_of(soc) == "Ascend950" and soc in SOCS and (not release or canonical(release)) and \
            selected(dict(env)).code < 90000:
        problems.append(f"PYACL_MOE_EMU_SOC={soc!r} is refused: the emulator models the Ascend 950 from release 9.0 "
                        "(8.5 named it Ascend910_95 and summed another way): use PYACL_MOE_EMU_RELEASE=9.0.0 or 9.1.0")
    if problems:
        raise EmulatorConfigError("; ".join(problems))
    unknown = sorted(n for n in env if n.startswith(PREFIX) and n not in VARIABLES)
    if unknown:
        warnings.warn(f"unknown emulator variable(s) {', '.join(unknown)} ignored; the emulator reads "
                      f"{', '.join(VARIABLES)}", stacklevel=3)
