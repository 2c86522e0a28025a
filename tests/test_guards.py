"""Guard bytes: the end-of-run check (conftest.guards_intact) would catch a stray
write; this shows the check sees one."""

from __future__ import annotations

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe._cann.errcheck import check


def test_corruption_is_seen_and_reported_on_free(device):
    arr = pm.to_device(np.zeros(100, np.uint8))
    assert pm.emulator.check_guards() == 0
    pm.emulator.corrupt_guard(arr.address)
    assert pm.emulator.check_guards() == 1
    before = pm.emulator.stats()["guard_corruptions"]
    mem = arr.allocation().mem  # the allocation's handle (bindings layer)
    with pytest.raises(pm.AclRuntimeError) as info:
        check(mem.release(), mem.API)  # aclrtFree reports it (and frees the block anyway)
    assert info.value.status == 507053 and info.value.api == "aclrtFree" and "guard" in info.value.message
    assert not mem and mem.release() == 0  # released once: the array's own release is a no-op now
    del arr
    assert pm.emulator.check_guards() == 0
    assert pm.emulator.stats()["guard_corruptions"] == before + 1
