"""Guard bytes: the end-of-run check (conftest.guards_intact) would catch a stray
write; this shows the check sees one."""

from __future__ import annotations

import numpy as np
import pytest

import pyacl_moe as pm


def test_corruption_is_seen_and_reported_on_free(device):
    pm.empty_cache()
    arr = pm.to_device(np.zeros(100, np.uint8))
    assert pm.emulator.check_guards() == 0
    pm.emulator.corrupt_guard(arr.address)
    assert pm.emulator.check_guards() == 1
    before = pm.emulator.stats()["guard_corruptions"]
    del arr  # its block goes to the array cache: not freed yet
    assert pm.emulator.check_guards() == 1
    with pytest.raises(pm.AclRuntimeError) as info:
        pm.empty_cache()  # aclrtFree reports it (and frees the block anyway)
    assert info.value.status == 507053 and info.value.api == "aclrtFree" and "guard" in info.value.message
    pm.empty_cache()  # released once: nothing left to report
    assert pm.emulator.check_guards() == 0
    assert pm.emulator.stats()["guard_corruptions"] == before + 1
