"""aclTensor handles describe DeviceArrays exactly, strides and offset included."""

from __future__ import annotations

import gc

import numpy as np
import pytest

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
    with pytest.raises(pm.ClosedError, match="tensor"):
        _ = t.view_shape
    with pytest.raises(pm.ClosedError, match="tensor"):
        _ = t.raw_address


def test_arguments_are_checked(device):
    arr = pm.to_device(np.zeros(4, np.float32))
    with pytest.raises(pm.InvalidArgument, match="array"):
        pm.AclTensor(np.zeros(4, np.float32))
    with pytest.raises(pm.InvalidArgument, match="fmt"):
        pm.AclTensor(arr, fmt="ND")
    with pm.AclTensor(arr, fmt=0) as t:  # ACL_FORMAT_NCHW
        assert t.format == 0 and t.array is arr
    arr.close()
    with pytest.raises(pm.ClosedError):
        pm.AclTensor(arr)


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


def test_a_tensor_keeps_its_memory_and_an_executor_keeps_its_tensors(device, no_leaks):
    x = pm.to_device(np.ones((8, 4), np.float32))
    idx = pm.to_device(np.arange(8, dtype=np.int32))
    out = pm.empty((4, 4), np.float32)
    gc.collect()
    st0 = pm.emulator.stats()
    tx = pm.AclTensor(x)
    del x  # the tensor keeps the array (and its memory) alive
    assert pm.emulator.stats()["device_allocations"] == st0["device_allocations"]
    tx.array.copy_from_host(np.full((8, 4), 3, np.float32))
    ti, to = pm.AclTensor(idx), pm.AclTensor(out)
    size, ex = pm.get_workspace_size(tx, ti, 2, 0, 0, to)
    assert ex.tensors == (tx, ti, to)
    for t in (tx, ti, to):
        t.close()
    # Closed, but the executor was built from them: the handles live as long as it does.
    assert pm.emulator.stats()["tensors"] == st0["tensors"] + 3
    pm.execute(pm.empty((size,), np.uint8), size, ex)
    np.testing.assert_array_equal(out.to_host(), np.full((4, 4), 6, np.float32))
    del ex
    st = pm.emulator.stats()
    assert st["tensors"] == st0["tensors"] and st["executors"] == st0["executors"]
