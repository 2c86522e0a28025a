"""The two phases as CANN has them: get_workspace_size -> (size, Executor), execute(...)."""

from __future__ import annotations

from contextlib import closing

import ml_dtypes
import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe.tools.cases import make_case

from .test_op_moe_init_routing_v2_grad import loop_reference


def test_contract_examples_from_vendor_tests(device):
    # (x shape, len(idx), out shape, dtype, top_k, mode, active) -> vendor status (0 = ok)
    table = [
        ((480, 8), 480, (80, 8), np.float32, 6, 0, 0, 0),
        ((40, 512), 640, (10, 512), ml_dtypes.bfloat16, 64, 0, 40, 0),
        ((40, 512), 80, (80, 512), np.float16, 1, 0, 40, 0),
        ((10, 8, 512), 640, (80, 512), np.float32, 8, 1, 40, 0),
        ((10, 512), 640, (80, 512), ml_dtypes.bfloat16, 8, 1, 40, 561002),
        ((40, 512), 640, (10, 510), ml_dtypes.bfloat16, 64, 0, 40, 561002),
    ]
    for xs, n_idx, outs, dt, k, mode, active, want in table:
        x, idx, out = pm.empty(xs, dt), pm.empty((n_idx,), np.int32), pm.empty(outs, dt)
        size, ex = pm.get_workspace_size(x, idx, k, mode, active, out) if not want else (None, None)
        if want:
            with pytest.raises(pm.AclnnError) as info:
                pm.get_workspace_size(x, idx, k, mode, active, out)
            assert info.value.status == want
        else:
            assert size == 16 * 1024 * 1024
            ex.close()


def test_low_level_two_phases(device, no_leaks):
    case = make_case(10, 2, 6, "float16", "dropless", seed=9)
    x, idx = pm.to_device(case.grad_expanded_x), pm.to_device(case.expanded_row_idx)
    out = pm.empty((10, 6), np.float16)
    tx, ti, to = pm.AclTensor(x), pm.AclTensor(idx), pm.AclTensor(out)
    size, ex = pm.get_workspace_size(tx, ti, 2, 0, 0, to)
    assert size == 16 << 20 and ex.workspace_size == size and not ex.closed and not ex.repeatable
    assert ex.handle != 0 and ex.device is device and ex.tensors == (tx, ti, to)
    ws = pm.empty((size,), np.uint8)
    with closing(pm.Stream(device)) as s:
        pm.execute(ws, size, ex, s)
        assert ex.closed and ex.handle == 0  # a one-shot executor is consumed by its launch
        with pytest.raises(pm.ClosedError, match="executor"):
            pm.execute(ws, size, ex, s)
        with pytest.raises(pm.ClosedError, match="executor"):
            ex.set_repeatable()
        np.testing.assert_array_equal(out.to_host(s), loop_reference(case))
    ex.close()  # a no-op now
    for t in (tx, ti, to):
        t.close()


def test_repeatable_executor_and_rebinding(device, no_leaks):
    a = make_case(6, 2, 4, "float32", "dropless", seed=1)
    b = make_case(6, 2, 4, "float32", "dropless", seed=2)
    xa, ia = pm.to_device(a.grad_expanded_x), pm.to_device(a.expanded_row_idx)
    xb, ib = pm.to_device(b.grad_expanded_x), pm.to_device(b.expanded_row_idx)
    out_a, out_b = pm.empty((6, 4), np.float32), pm.empty((6, 4), np.float32)
    size, ex = pm.get_workspace_size(xa, ia, 2, 0, 0, out_a)
    assert ex.set_repeatable() is ex and ex.repeatable and "repeatable" in repr(ex)
    ws = pm.empty((size,), np.uint8)
    s = device.default_stream
    pm.execute(ws, size, ex, s)
    pm.execute(ws, size, ex, s)  # twice: repeatable
    assert not ex.closed
    tx, ti, to = ex.tensors
    ex.set_input_addr(0, tx, xb.data_ptr)
    ex.set_input_addr(1, ti, ib.data_ptr)
    ex.set_output_addr(0, to, out_b.data_ptr)
    pm.execute(ws, size, ex)  # the default stream when none is given
    np.testing.assert_allclose(out_a.to_host(s), loop_reference(a), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out_b.to_host(s), loop_reference(b), rtol=1e-5, atol=1e-6)
    executors = pm.emulator.stats()["executors"]
    ex.close()
    assert ex.closed and ex.tensors == () and ex.device is None
    assert pm.emulator.stats()["executors"] == executors - 1
    ex.close()
    with pytest.raises(pm.ClosedError, match="executor"):
        pm.execute(ws, size, ex, s)


def test_executor_as_a_context_manager(device, no_leaks):
    x, idx = pm.to_device(np.ones((8, 4), np.float32)), pm.to_device(np.arange(8, dtype=np.int32))
    executors = pm.emulator.stats()["executors"]
    with pm.get_workspace_size(x, idx, 2, 0, 0, pm.empty((4, 4), np.float32))[1] as ex:
        assert pm.emulator.stats()["executors"] == executors + 1
    assert ex.closed and pm.emulator.stats()["executors"] == executors


def test_vendor_checks_in_the_first_phase(device):
    idx = pm.empty((8,), np.int32)
    with pytest.raises(pm.AclnnError) as info:
        pm.get_workspace_size(pm.empty((8, 4), np.float64), idx, 2, 0, 0, pm.empty((4, 4), np.float64))
    assert info.value.status == 161002  # ACL_DOUBLE: the vendor refuses it
    with pytest.raises(pm.AclnnError) as info:
        pm.get_workspace_size(None, idx, 2, 0, 0, pm.empty((4, 4), np.float32))
    assert info.value.status == 161001
    with pytest.raises(pm.AclnnError) as info:
        pm.get_workspace_size(pm.empty((8, 4), np.float32), idx, 2)  # no out: a null pointer
    assert info.value.status == 161001


@pytest.mark.parametrize("name", ["top_k", "drop_pad_mode", "active_num"])
@pytest.mark.parametrize("value", [2.0, True, "2", None, 2**63, np.float32(1)])
def test_attributes_must_be_int64(device, name, value):
    x, idx = pm.empty((8, 4), np.float32), pm.empty((8,), np.int32)
    attrs = dict(top_k=2, drop_pad_mode=0, active_num=0)
    attrs[name] = value
    executors = pm.emulator.stats()["executors"]
    with pytest.raises(pm.InvalidArgument, match=name):
        pm.get_workspace_size(x, idx, attrs["top_k"], attrs["drop_pad_mode"], attrs["active_num"],
                              pm.empty((4, 4), np.float32))
    assert pm.emulator.stats()["executors"] == executors  # refused before CANN


def test_numpy_integers_are_ints(device):
    x, idx, out = pm.empty((8, 4), np.float32), pm.empty((8,), np.int32), pm.empty((4, 4), np.float32)
    size, ex = pm.get_workspace_size(x, idx, np.int64(2), np.int32(0), np.uint8(0), out)
    assert size == 16 << 20
    ex.close()


def test_tensor_arguments_are_checked(device):
    x, idx = pm.empty((8, 4), np.float32), pm.empty((8,), np.int32)
    with pytest.raises(pm.InvalidArgument, match="expanded_row_idx"):
        pm.get_workspace_size(x, np.zeros(8, np.int32), 2, 0, 0, pm.empty((4, 4), np.float32))
    with pytest.raises(pm.InvalidArgument, match="out"):
        pm.get_workspace_size(x, idx, 2, 0, 0, "out")
    closed = pm.AclTensor(x)
    closed.close()
    with pytest.raises(pm.ClosedError):
        pm.get_workspace_size(closed, idx, 2, 0, 0, pm.empty((4, 4), np.float32))
    with pytest.raises(pm.InvalidArgument, match="device"):
        pm.get_workspace_size(x, idx, 2, 0, 0, pm.empty((4, 4), np.float32), device="0")


def test_execute_refuses_what_cann_would_not_recycle(device, no_leaks):
    # CANN returns from these without taking a one-shot executor: refused on the host, so the
    # executor is still the caller's, and a corrected launch works.
    x, idx = pm.to_device(np.ones((8, 4), np.float32)), pm.to_device(np.arange(8, dtype=np.int32))
    out = pm.empty((4, 4), np.float32)
    size, ex = pm.get_workspace_size(x, idx, 2, 0, 0, out)
    ws = pm.empty((size,), np.uint8)
    launched = pm.emulator.stats()["kernels_launched"]
    refusals = [
        (lambda: pm.execute(ws, size - 1, ex), "workspace_size"),
        (lambda: pm.execute(ws, -1, ex), "workspace_size"),
        (lambda: pm.execute(ws, 2**64, ex), "workspace_size"),
        (lambda: pm.execute(ws, float(size), ex), "workspace_size"),
        (lambda: pm.execute(None, size, ex), "workspace"),
        (lambda: pm.execute(0, size, ex), "workspace"),
        (lambda: pm.execute(pm.empty((16,), np.uint8), size, ex), "workspace"),
        (lambda: pm.execute("ws", size, ex), "workspace"),
        (lambda: pm.execute(ws, size, "executor"), "executor"),
        (lambda: pm.execute(ws, size, ex, stream=1), "stream"),
    ]
    for call, name in refusals:
        with pytest.raises(pm.InvalidArgument) as info:
            call()
        assert info.value.parameter == name, info.value
        assert not ex.closed
    assert pm.emulator.stats()["kernels_launched"] == launched
    pm.execute(ws.address, size, ex)  # a raw device address is a workspace too
    assert ex.closed
    np.testing.assert_array_equal(out.to_host(), np.full((4, 4), 2.0, np.float32))
    closed_ws = pm.empty((size,), np.uint8)
    closed_ws.close()
    size, ex = pm.get_workspace_size(x, idx, 2, 0, 0, out)
    with pytest.raises(pm.ClosedError, match="workspace"):
        pm.execute(closed_ws, size, ex)
    ex.close()


def test_a_one_shot_executor_is_consumed_even_when_its_launch_fails(device, no_leaks, uncached):
    x, idx = pm.to_device(np.ones((8, 4), np.float32)), pm.to_device(np.arange(8, dtype=np.int32))
    size, ex = pm.get_workspace_size(x, idx, 2, 0, 0, pm.empty((4, 4), np.float32))
    ws = pm.empty((size,), np.uint8)
    closed = pm.Stream(device)
    closed.close()
    with pytest.raises(pm.ClosedError, match="stream"):
        pm.execute(ws, size, ex, closed)  # refused on the host: still the caller's
    assert not ex.closed
    freed = pm.empty((size,), np.uint8)
    address = freed.address
    del freed
    executors = pm.emulator.stats()["executors"]  # (and the memory at address is free now)
    # A workspace that is no live device memory: the launch fails past nnopbase's guard, which
    # takes the one-shot executor whatever happens next.
    with pytest.raises(pm.AclError):
        pm.execute(address, size, ex)
    assert ex.closed
    with pytest.raises(pm.ClosedError, match="executor"):
        pm.execute(ws, size, ex)
    assert pm.emulator.stats()["executors"] == executors - 1  # CANN freed it, nobody else may
    ex.close()


def test_executor_addresses_are_checked(device, no_leaks):
    x, idx = pm.to_device(np.ones((8, 4), np.float32)), pm.to_device(np.arange(8, dtype=np.int32))
    size, ex = pm.get_workspace_size(x, idx, 2, 0, 0, pm.empty((4, 4), np.float32))
    tx, ti, to = ex.tensors
    for call, name in (
        (lambda: ex.set_input_addr(2, tx, x.data_ptr), "index"),  # two inputs
        (lambda: ex.set_output_addr(1, to, x.data_ptr), "index"),  # one output
        (lambda: ex.set_input_addr(-1, tx, x.data_ptr), "index"),
        (lambda: ex.set_input_addr(True, tx, x.data_ptr), "index"),
        (lambda: ex.set_input_addr(0, x, x.data_ptr), "tensor"),
        (lambda: ex.set_input_addr(0, tx, -1), "address"),
        (lambda: ex.set_input_addr(0, tx, 2**64), "address"),
        (lambda: ex.set_input_addr(0, tx, "0"), "address"),
    ):
        with pytest.raises(pm.InvalidArgument) as info:
            call()
        assert info.value.parameter == name
    ex.close()
    with pytest.raises(pm.ClosedError, match="executor"):
        ex.set_input_addr(0, tx, x.data_ptr)
