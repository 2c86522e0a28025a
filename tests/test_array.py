"""DeviceArray: allocation, copies, views, layouts, borrowed memory."""

from __future__ import annotations

import gc
import sys
import time
from contextlib import closing

import ml_dtypes
import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe.array import may_overlap
from pyacl_moe.tools.cases import make_case


@pytest.mark.parametrize("dtype", [np.float16, np.float32, ml_dtypes.bfloat16, np.int32])
def test_round_trip(device, dtype, no_leaks):
    host = (np.arange(24).reshape(2, 3, 4) - 7).astype(dtype)
    arr = pm.to_device(host)
    assert arr.shape == (2, 3, 4) and arr.dtype == np.dtype(dtype)
    assert arr.element_strides == (12, 4, 1) and arr.offset == 0 and arr.is_contiguous
    assert arr.strides == host.strides  # bytes, as NumPy has them
    assert arr.ndim == 3 and arr.size == 24 and len(arr) == 2 and arr.nbytes == 24 * arr.itemsize
    assert arr.owns_memory and arr.storage_size == 24 and arr.address == arr.data_ptr and not arr.closed
    np.testing.assert_array_equal(arr.to_host(), host)
    np.testing.assert_array_equal(arr.numpy(), host)


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
    assert pm.empty(5, np.float32).shape == (5,) and pm.empty((), np.float32).shape == ()
    assert pm.empty((0, 3), np.float32).to_host().shape == (0, 3)


@pytest.mark.parametrize("shape, words", [
    ((-1,), "shape[0]"), ((2, -3), "shape[1]"), ("12", "shape"), (b"12", "shape"), (None, "shape"),
    ((2.0,), "shape[0]"), ((True,), "shape[0]"), ((2**62, 4), "cannot be addressed"), ((2**63,), "shape[0]"),
])
def test_bad_shapes_are_refused_by_name(device, shape, words):
    with pytest.raises(pm.InvalidArgument, match=words.replace("[", r"\[").replace("]", r"\]")) as info:
        pm.empty(shape, np.float32)
    assert info.value.parameter.startswith("shape")
    with pytest.raises(pm.InvalidArgument):
        pm.zeros(shape, np.float32)


def test_bad_streams_and_devices_are_refused_by_name(device):
    with pytest.raises(pm.InvalidArgument, match="stream"):
        pm.zeros((2,), np.float32, stream=3)
    with pytest.raises(pm.InvalidArgument, match="stream"):  # (an AttributeError before)
        pm.empty((2,), np.float32, stream=3)
    with pytest.raises(pm.InvalidArgument, match="stream"):
        pm.to_device(np.ones(2, np.float32), stream="default")
    with pytest.raises(pm.InvalidArgument, match="stream"):
        pm.to_device(np.ones(2, np.float32)).to_host(stream=0)
    with pytest.raises(pm.InvalidArgument, match="device"):
        pm.empty((2,), np.float32, device="0")
    with pytest.raises(pm.InvalidArgument, match="device_id"):
        pm.empty((2,), np.float32, device=7)


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
    assert v.shape == (3, 3) and v.element_strides == (12, 3) and v.offset == 14
    assert v.strides == host[1:4, 2:11:3].strides
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
    with pytest.raises(IndexError):
        arr[1, 2, 3]
    with pytest.raises(pm.InvalidArgument, match="negative"):
        arr[::-1]
    with pytest.raises(pm.InvalidArgument, match="key"):
        arr[1.5]


def test_layout_and_layout_id_name_shape_dtype_and_strides(device):
    a = pm.to_device(np.arange(24, dtype=np.float32).reshape(4, 6))
    assert a.layout == ((4, 6), np.dtype(np.float32), (6, 1))
    assert a[:, ::2].layout == ((4, 3), np.dtype(np.float32), (6, 2))
    # Equal layouts, equal ids, whatever the memory and offset; different layouts, different ids.
    assert a[1:].layout_id == pm.empty((3, 6), np.float32).layout_id != a.layout_id
    assert a.layout_id == pm.zeros((4, 6), np.float32).layout_id
    assert len({a.layout_id, a[:, ::2].layout_id, pm.empty((4, 6), np.float16).layout_id, a[:, :3].layout_id}) == 4


def test_may_overlap_is_exact(device):
    a = pm.to_device(np.arange(24, dtype=np.float32).reshape(4, 6))
    b = pm.empty((4, 6), np.float32)
    assert may_overlap(a, a) and may_overlap(a[:2], a[1:]) and may_overlap(a[:, 1], a[2])
    assert not may_overlap(a[:2], a[2:])
    assert not may_overlap(a[:, ::2], a[:, 1::2])  # interleaved, never the same byte
    assert not may_overlap(a, b)
    assert not may_overlap(a[:0], a)  # an empty view touches nothing
    wide = pm.DeviceArray.from_pointer(a.data_ptr, (6,), np.float64, owner=a)  # other dtype, same bytes
    assert may_overlap(wide, a[1]) and not may_overlap(wide[:3], a[1]) and not may_overlap(wide, a[2])


def test_copy_from_host_checks_its_argument(device):
    a = pm.to_device(np.zeros((4, 6), np.float32))
    with pytest.raises(pm.InvalidArgument, match="shape"):
        a.copy_from_host(np.ones((4, 5), np.float32))
    with pytest.raises(pm.InvalidArgument, match="dtype"):
        a.copy_from_host(np.ones((4, 6), np.float64))
    with pytest.raises(pm.InvalidArgument, match="contiguous"):
        a[:, ::2].copy_from_host(np.ones((4, 3), np.float32))
    a[1].copy_from_host(np.arange(6, dtype=np.float32))  # a contiguous view
    np.testing.assert_array_equal(a.to_host()[1], np.arange(6, dtype=np.float32))
    np.testing.assert_array_equal(a.to_host()[0], np.zeros(6, np.float32))


def test_view_keeps_memory_alive_after_base_is_closed(device, no_leaks):
    host = np.arange(10, dtype=np.float32)
    base = pm.to_device(host)
    view = base[3:7]
    base.close()
    gc.collect()
    np.testing.assert_array_equal(view.to_host(), host[3:7])
    with pytest.raises(pm.ClosedError, match="closed"):
        base.to_host()
    with pytest.raises(pm.ClosedError):
        base[0]
    with pytest.raises(pm.ClosedError):
        base.copy_from_host(host)
    with pytest.raises(pm.ClosedError):
        _ = base.data_ptr
    assert base.closed and "closed" in repr(base)
    base.close()  # twice is fine
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
    pm.empty_cache()  # the block went to the array cache; empty_cache gives it back
    assert pm.emulator.stats()["device_allocations"] == before


def test_from_pointer_borrows_and_keeps_owner_alive(device, no_leaks, uncached):
    owner = pm.to_device(np.arange(16, dtype=np.float32))
    ptr = owner.data_ptr
    borrowed = pm.DeviceArray.from_pointer(ptr, (2, 4), np.float32, strides=(32, 4), offset=4, owner=owner)
    also = pm.from_pointer(ptr, (16,), np.float32)  # the module-level spelling, no owner
    np.testing.assert_array_equal(also.to_host(), np.arange(16, dtype=np.float32))
    del also
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
        pm.DeviceArray.from_pointer(ptr, (2,), np.float32, strides=(4, 4))
    with pytest.raises(pm.InvalidArgument, match="strides.*in bytes.*multiples of the item size"):
        pm.DeviceArray.from_pointer(ptr, (2, 2), np.float32, strides=(8, 1))  # element strides: refused
    with pytest.raises(pm.InvalidArgument, match="ptr"):
        pm.from_pointer(2**64 - 4, (2,), np.float32)  # runs past the address space
    with pytest.raises(pm.InvalidArgument, match="ptr"):
        pm.from_pointer("0x1000", (2,), np.float32)
    with pytest.raises(pm.InvalidArgument, match="offset"):
        pm.from_pointer(ptr, (2,), np.float32, offset=-1)
    with pytest.raises(pm.InvalidArgument, match="shape"):
        pm.from_pointer(ptr, (-2,), np.float32)


def test_async_copy_keeps_host_buffer_alive(device, lazy_streams, no_leaks):
    s = pm.Stream(device)
    arr = pm.to_device(np.arange(1000, dtype=np.float32) * 3, stream=s)  # the temporary is kept by s
    gc.collect()
    assert pm.emulator.stats()["pending_tasks"] > 0  # the copy has not run yet
    np.testing.assert_array_equal(arr.to_host(), np.arange(1000, dtype=np.float32) * 3)
    s.close()


def test_reading_back_waits_for_the_last_writer(device, lazy_streams, no_leaks):
    with closing(pm.Stream(device)) as a, closing(pm.Stream(device)) as b:
        arr = pm.zeros((256,), np.float32, stream=a)
        arr.copy_from_host(np.full(256, 7, np.float32), stream=a)
        assert pm.emulator.stats()["pending_tasks"] > 0
        # No stream given: the copy back runs on a, the stream that last wrote it.
        np.testing.assert_array_equal(arr.to_host(), np.full(256, 7, np.float32))
        # A host write without a stream waits for queued work of another stream that reads it.
        x = pm.to_device(np.ones((256, 4), np.float32), stream=b)
        idx = pm.to_device(np.arange(256, dtype=np.int32), stream=b)
        out = pm.moe_init_routing_v2_grad(x, idx, 2, stream=b)
        x.copy_from_host(np.zeros((256, 4), np.float32))
        np.testing.assert_array_equal(out.to_host(b), np.full((128, 4), 2.0, np.float32))
        del arr, x, idx, out


def test_reading_back_reports_a_fault_of_the_work_that_wrote_the_array(device):
    # The kernel faults (an index past the rows, unchecked with validate=False); by the time
    # the array is read back the device is idle, and a query would say so without the fault:
    # the read back waits for the writer's stream, so the fault is reported here, and on every
    # later read, launch and wait of the device until it is reset.
    x = pm.to_device(np.ones((8, 4), np.float32))
    bad = pm.to_device(np.full(8, 99, np.int32))
    out = pm.moe_init_routing_v2_grad(x, bad, 2, validate=False)
    deadline = time.time() + 5
    while not device.default_stream.query() and time.time() < deadline:
        time.sleep(0.001)
    with pytest.raises(pm.AclRuntimeError) as info:
        out.to_host()
    assert info.value.status == 507015
    with pytest.raises(pm.AclRuntimeError, match="507015"):
        out.to_host()
    with pytest.raises(pm.AclRuntimeError, match="507015"):
        pm.moe_init_routing_v2_grad(x, pm.to_device(np.arange(8, dtype=np.int32)), 2)
    device.reset()
    ones, ids = pm.to_device(np.ones((8, 4), np.float32)), pm.to_device(np.arange(8, dtype=np.int32))
    out2 = pm.moe_init_routing_v2_grad(ones, ids, 2)
    assert np.array_equal(out2.to_host(), np.full((4, 4), 2.0, np.float32))  # the next one is clean


def test_a_host_write_waits_for_queued_work_that_reads_the_array(device, lazy_streams):
    case = make_case(8, 2, 16, "float32", "dropless", seed=13)
    expected = pm.moe_init_routing_v2_grad(*case.args())
    with closing(pm.Stream(device)) as s:
        x, idx = pm.to_device(case.grad_expanded_x, stream=s), pm.to_device(case.expanded_row_idx, stream=s)
        out = pm.moe_init_routing_v2_grad(x, idx, 2, stream=s)  # queued: reads x when it runs
        x.copy_from_host(np.zeros_like(case.grad_expanded_x))  # must not overtake the kernel
        assert np.array_equal(out.to_host(s), expected)
        with closing(pm.Stream(device)) as t:
            out2 = pm.moe_init_routing_v2_grad(x, idx, 2, stream=s)
            t.wait_event(s.record())  # on another stream: the caller orders it, as in CUDA
            x.copy_from_host(case.grad_expanded_x, stream=t)
            assert np.array_equal(out2.to_host(s), np.zeros_like(expected))
            t.synchronize()
        assert np.array_equal(x.to_host(), case.grad_expanded_x)


def _views_of_new_shapes(count: int) -> None:
    base = pm.empty((count + 1,), np.float32)
    for n in range(1, count + 1):
        v = base[:n]
        assert v.shape == (n,)


def test_distinct_view_shapes_leave_no_host_memory_behind(device):
    """MoE token counts change every step: 50,000 views of one buffer, each of a shape not
    seen before, leave (almost) nothing behind: per-layout state is bounded (200,000 in
    bytes: the slow test below)."""
    _views_of_new_shapes(10)
    gc.collect()
    blocks = sys.getallocatedblocks()
    _views_of_new_shapes(50_000)
    gc.collect()
    assert sys.getallocatedblocks() - blocks < 8_000  # (an entry per layout would be 150,000)


@pytest.mark.slow
def test_distinct_view_shapes_leave_under_a_mib_behind(device):
    """The same, in bytes (tracemalloc is slow: 200,000 views take about 15 s under it)."""
    import tracemalloc

    _views_of_new_shapes(10)
    gc.collect()
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        _views_of_new_shapes(200_000)
        gc.collect()
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert end - start < 1 << 20, f"{(end - start) / 2**20:.2f} MiB left behind"
