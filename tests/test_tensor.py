"""aclTensor handles describe DeviceArrays exactly, strides and offset included."""

from __future__ import annotations

import numpy as np

import pyacl_moe as pm


def test_contiguous_descriptor(device, no_leaks):
    arr = pm.to_device(np.zeros((6, 4), np.float16))
    with pm.AclTensor(arr) as t:
        assert t.view_shape == (6, 4)
        assert t.view_strides == (4, 1)
        assert t.view_offset == 0
        assert t.storage_shape == (24,)
        assert t.data_type == 1 and t.format == 2  # ACL_FLOAT16, ACL_FORMAT_ND
        assert t.raw_address == arr.data_ptr
    assert t.closed and t.handle == 0


def test_view_becomes_strided_tensor_without_copy(device, no_leaks):
    arr = pm.to_device(np.zeros((8, 10), np.float32))
    allocs = pm.emulator.stats()["device_allocations"]
    view = arr[2:6, 1::2]
    t = pm.AclTensor(view)
    assert pm.emulator.stats()["device_allocations"] == allocs  # no hidden copy
    assert t.view_shape == (4, 5)
    assert t.view_strides == (10, 2)
    assert t.view_offset == 21
    assert t.raw_address == arr.data_ptr
    t.close()
    t.close()


def test_finalizer_destroys_forgotten_tensor(device):
    arr = pm.to_device(np.zeros(4, np.int32))
    before = pm.emulator.stats()["tensors"]
    t = pm.AclTensor(arr)
    assert pm.emulator.stats()["tensors"] == before + 1
    del t
    assert pm.emulator.stats()["tensors"] == before
