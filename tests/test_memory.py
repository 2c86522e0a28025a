"""DeviceArray: allocation, copies, views, borrowed memory."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

import pyacl_moe as pm


@pytest.mark.parametrize("dtype", [np.float16, np.float32, ml_dtypes.bfloat16, np.int32])
def test_round_trip(device, dtype, no_leaks):
    host = (np.arange(24).reshape(2, 3, 4) - 7).astype(dtype)
    arr = pm.to_device(host)
    assert arr.shape == (2, 3, 4) and arr.dtype == np.dtype(dtype)
    assert arr.strides == (12, 4, 1) and arr.offset == 0 and arr.is_contiguous
    np.testing.assert_array_equal(arr.to_host(), host)
    np.testing.assert_array_equal(arr.numpy(), host)
    np.testing.assert_array_equal(np.asarray(arr), host)


def test_device_pointer_is_not_a_host_pointer(device):
    arr = pm.to_device(np.ones(4, np.float32))
    # The emulator reserves device addresses that the host never maps, like real HBM.
    maps = open("/proc/self/maps").read().splitlines()
    holding = [line for line in maps
               if int(line.split()[0].split("-")[0], 16) <= arr.address < int(line.split()[0].split("-")[1], 16)]
    assert holding, "the device address is not inside the emulator's reserved range"
    assert holding[0].split()[1].startswith("---"), f"device address is host-accessible: {holding[0]}"


def test_empty_and_zeros(device, no_leaks):
    z = pm.zeros((5, 3), np.float16)
    np.testing.assert_array_equal(z.to_host(), np.zeros((5, 3), np.float16))
    e = pm.empty((2, 2), np.float32)
    assert e.shape == (2, 2) and e.nbytes == 16
    s = pm.Stream(device)
    z2 = pm.zeros((7,), np.int32, stream=s)
    np.testing.assert_array_equal(z2.to_host(), np.zeros(7, np.int32))  # reads on s, after the memset
    s.close()


def test_host_layouts_are_normalized(device):
    f = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    np.testing.assert_array_equal(pm.to_device(f).to_host(), f)
    swapped = np.arange(6, dtype=">f4")
    back = pm.to_device(swapped).to_host()
    assert back.dtype == np.dtype("<f4") and back.tolist() == list(range(6))
    strided = np.arange(20, dtype=np.int32)[::3]
    np.testing.assert_array_equal(pm.to_device(strided).to_host(), strided)


def test_refused_dtypes(device):
    with pytest.raises(pm.InvalidArgument, match="array"):
        pm.to_device(np.array([object()]))
    with pytest.raises(pm.InvalidArgument, match="dtype"):
        pm.empty((2,), np.dtype("U4"))


def test_views_share_memory_and_carry_strides(device):
    host = np.arange(60, dtype=np.float32).reshape(5, 12)
    arr = pm.to_device(host)
    v = arr[1:4, 2:11:3]
    assert v.shape == (3, 3) and v.strides == (12, 3) and v.offset == 14
    assert v.data_ptr == arr.data_ptr and not v.is_contiguous
    np.testing.assert_array_equal(v.to_host(), host[1:4, 2:11:3])
    row = arr[2]
    assert row.shape == (12,) and row.offset == 24
    np.testing.assert_array_equal(arr[..., 5].to_host(), host[..., 5])
    np.testing.assert_array_equal(arr[-1].to_host(), host[-1])
    # Writing through the base is visible through the view: same memory.
    arr.copy_from_host(host * 2)
    np.testing.assert_array_equal(v.to_host(), (host * 2)[1:4, 2:11:3])
    with pytest.raises(IndexError):
        arr[5]
    with pytest.raises(pm.InvalidArgument, match="negative"):
        arr[::-1]


def test_view_keeps_memory_alive_after_base_is_closed(device, no_leaks):
    host = np.arange(10, dtype=np.float32)
    base = pm.to_device(host)
    view = base[3:7]
    base.close()
    gc.collect()
    np.testing.assert_array_equal(view.to_host(), host[3:7])
    with pytest.raises(pm.InvalidArgument, match="closed"):
        base.to_host()
    view.close()


def test_memory_is_freed_when_last_array_goes(device):
    gc.collect()
    before = pm.emulator.stats()["device_allocations"]
    a = pm.empty((1000,), np.float32)
    v = a[10:20]
    assert pm.emulator.stats()["device_allocations"] == before + 1
    del a
    assert pm.emulator.stats()["device_allocations"] == before + 1  # the view still holds it
    del v
    assert pm.emulator.stats()["device_allocations"] == before


def test_from_pointer_borrows_and_keeps_owner_alive(device, no_leaks):
    owner = pm.to_device(np.arange(16, dtype=np.float32))
    ptr = owner.data_ptr
    borrowed = pm.DeviceArray.from_pointer(ptr, (2, 4), np.float32, strides=(8, 1), offset=4, owner=owner)
    del owner
    gc.collect()
    assert not borrowed.owns_memory
    np.testing.assert_array_equal(borrowed.to_host(), np.array([[4, 5, 6, 7], [12, 13, 14, 15]], np.float32))
    before = pm.emulator.stats()["device_allocations"]
    del borrowed
    gc.collect()
    assert pm.emulator.stats()["device_allocations"] == before - 1  # the owner went with it
    with pytest.raises(pm.InvalidArgument, match="ptr"):
        pm.DeviceArray.from_pointer(0, (2,), np.float32)
    with pytest.raises(pm.InvalidArgument, match="strides"):
        pm.DeviceArray.from_pointer(ptr, (2,), np.float32, strides=(1, 1))


def test_async_copy_keeps_host_buffer_alive(device, no_leaks):
    s = pm.Stream(device)
    arr = pm.to_device(np.arange(1000, dtype=np.float32) * 3, stream=s)  # the temporary is kept by s
    gc.collect()
    np.testing.assert_array_equal(arr.to_host(), np.arange(1000, dtype=np.float32) * 3)
    s.close()
