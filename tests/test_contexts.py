"""`with device:` and `with stream:` switch the thread's current device and stream, as CuPy's
and torch's contexts do, and close nothing."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe import reference


def _case(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n, k, h = 16, 2, 32
    x = rng.standard_normal((n * k, h)).astype(np.float32)
    idx = rng.permutation(n * k).astype(np.int32)
    return x, idx


def test_with_device_leaves_objects_made_outside_usable(device):
    x, idx = _case()
    arr = pm.to_device(x)
    s = pm.Stream(device)
    with pm.Device(0) as d:
        assert d is device and pm.current_device() is device
        with pm.Device(0):
            pass
    assert not device.closed and not s.closed and not arr.closed
    np.testing.assert_array_equal(arr.to_host(s), x)
    s.close()


def child_with_device_restores_the_previous_device() -> None:
    pm.use_emulator()
    d0, d1 = pm.Device(0), pm.Device(1)
    d0.set_current()
    with d1:
        assert pm.current_device() is d1
        with d0:
            assert pm.current_device() is d0
        assert pm.current_device() is d1
        a = pm.zeros((4,), "float32")  # no device given: the current one
        assert a.device is d1
    assert pm.current_device() is d0
    assert not d1.closed
    print("ok")


def test_with_device_restores_the_previous_device(isolated):
    r = isolated(child_with_device_restores_the_previous_device, env={"PYACL_MOE_EMU_DEVICES": "2"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def _queued_on(s: pm.Stream, default: pm.Stream) -> bool:
    """Lazy streams run nothing until waited for: work queued on ``s`` shows as a busy ``s``
    while the default stream stays idle. Runs it, to start the next check clean."""
    busy, default_idle = not s.query(), default.query()
    s.synchronize()
    return busy and default_idle


def test_with_stream_routes_calls_without_stream_to_it(device, lazy_streams):
    x, idx = _case(1)
    expected = reference.moe_init_routing_v2_grad(x, idx, 2)
    dx, di = pm.to_device(x), pm.to_device(idx)
    plan = pm.MoeInitRoutingV2Grad(dx, di, 2)
    plan()  # published for the default stream: the block must not reuse that
    device.synchronize()
    s, default = pm.Stream(device), device.default_stream
    with s as entered:
        assert entered is s and pm.current_stream() is s and pm.current_stream(device) is s
        out = pm.moe_init_routing_v2_grad(dx, di, 2)
        assert _queued_on(s, default), "the one-call path on DeviceArrays"
        plan()
        assert _queued_on(s, default), "a plan launch"
        plan()
        assert _queued_on(s, default), "a plan's steady-state launch"
        size, ex = pm.get_workspace_size(dx, di, 2, 0, 0, out)
        ws = pm.empty((max(size, 1),), np.uint8)
        pm.execute(ws, size, ex)
        assert _queued_on(s, default), "execute"
        z = pm.zeros((8,), "float32")
        assert _queued_on(s, default), "zeros"
        y = pm.to_device(x)
        assert _queued_on(s, default), "to_device"
        y.copy_from_host(x)
        assert _queued_on(s, default), "copy_from_host"
        pm.Event(device).record()
        assert _queued_on(s, default), "Event.record"
        got = out.to_host()
        host = pm.moe_init_routing_v2_grad(x, idx, 2)  # the NumPy path waits for its stream
    assert not s.closed, "with stream: must close nothing"
    assert pm.current_stream() is default
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(host, expected)
    np.testing.assert_array_equal(z.to_host(), np.zeros(8, np.float32))
    # Outside the block, calls go back to the default stream, not the one the plan last used.
    plan()
    assert not default.query() and s.query()
    device.synchronize()
    plan.close()
    s.close()


def test_with_stream_is_per_thread_and_nests(device):
    a, b = pm.Stream(device), pm.Stream(device)
    seen: list[object] = []
    with a:
        t = threading.Thread(target=lambda: seen.append(pm.current_stream(device)))
        t.start()
        t.join()
        with b:
            assert pm.current_stream() is b
        assert pm.current_stream() is a
    assert seen == [device.default_stream]
    assert pm.current_stream() is device.default_stream
    a.close()
    b.close()


def test_a_stream_closed_inside_its_block_is_not_silently_replaced(device):
    s = pm.Stream(device)
    with s:
        s.close()
        with pytest.raises(pm.ClosedError):
            pm.zeros((4,), "float32")
    pm.zeros((4,), "float32")  # the default stream again after the block


def test_entering_a_closed_stream_raises_closed_error(device):
    s = pm.Stream(device)
    s.close()
    with pytest.raises(pm.ClosedError):
        with s:
            pass
    assert pm.current_stream() is device.default_stream
