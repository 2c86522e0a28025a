"""Which of the host's devices a process's device is: ``ASCEND_RT_VISIBLE_DEVICES`` read as
CANN's runtime reads it, so a report records the host's id of the device it ran on (a task that
Ray gives the host's NPU 3 sees it as device 0).

The runtime (hicann/runtime, ``Runtime::GetVisibleDevices`` and ``SplitString`` in
src/runtime/core/src/runtime.cc; docs/emulator.md, *Visible devices*) keeps the first 128
characters of the value and reads ids from them: runs of digits separated by single commas, up
to the first other character or a second comma in a row (a value that does not begin with a
digit has none). It then stops at the first id the host does not have, and makes no device
visible when the ids are not ascending or one is repeated. The visible devices are numbered from
0 in the order given. Which ids the host has is the runtime's to judge; here, a device id the
process could open is looked up in the ids the value lists.

Plain Python: imports nothing of the package.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["MAX_CHARS", "VARIABLE", "host_device", "listed", "process_device"]

VARIABLE = "ASCEND_RT_VISIBLE_DEVICES"
MAX_CHARS = 128  # RT_SET_DEVICE_STR_MAX_LEN: the runtime keeps this many characters of the value


def listed(value: str) -> list[int]:
    """The ids ``value`` lists, in order, as the runtime splits it (before it checks them
    against the host's devices): ``"1,3"`` is [1, 3], ``"1, 2"`` is [1], ``"1,,2"`` is [1],
    ``"x1"`` is []. An id beyond a C int (which the runtime cannot convert) ends the list."""
    text = value[:MAX_CHARS]
    ids: list[int] = []
    if not text or not "0" <= text[0] <= "9":
        return ids
    for token in _tokens(text):
        number = int(token)
        if number > 2**31 - 1:
            break
        ids.append(number)
    return ids


def _tokens(text: str) -> list[str]:
    out: list[str] = []
    digits = ""
    commas = 0
    for ch in text:
        if "0" <= ch <= "9":
            digits += ch
            commas = 0
            continue
        if digits:
            out.append(digits)
            digits = ""
        commas += 1
        if ch != "," or commas > 1:
            break
    else:
        if digits:
            out.append(digits)
    return out


def host_device(device: int, environ: Mapping[str, str] | None = None) -> int:
    """The host's id of this process's device ``device``: the ``device``-th id the variable
    lists, or ``device`` itself when the variable is unset (or lists fewer: the runtime would
    not have opened it)."""
    env = os.environ if environ is None else environ
    value = env.get(VARIABLE)
    if value is None:
        return device
    ids = listed(value)
    return ids[device] if 0 <= device < len(ids) else device


def process_device(host_id: int, environ: Mapping[str, str] | None = None) -> int | None:
    """The id this process opens the host's device ``host_id`` by (the inverse of
    :func:`host_device`); None when the variable hides it."""
    env = os.environ if environ is None else environ
    value = env.get(VARIABLE)
    if value is None:
        return host_id
    ids = listed(value)
    return ids.index(host_id) if host_id in ids else None
