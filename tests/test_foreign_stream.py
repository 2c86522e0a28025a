"""Stream.from_handle: pyacl_moe's work on an aclrtStream that someone else created and owns."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe import reference
from tests.emu_raw import Emu


class _Owner:
    """Stands for the foreign object the handle belongs to (a torch_npu stream, say)."""

    def __init__(self, raw: Emu) -> None:
        self.raw = raw
        p = raw.ffi.new("aclrtStream *")
        raw.ok(raw.acl.aclrtCreateStream(p))
        self.stream = p[0]
        self.address = int(raw.ffi.cast("uintptr_t", p[0]))


def test_a_borrowed_stream_runs_work_and_is_never_destroyed(device, lazy_streams):
    raw = Emu()
    device.activate()  # the raw stream is created under the binding's device context
    owner = _Owner(raw)
    streams = raw.stats()["streams"]
    rng = np.random.default_rng(5)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    idx = rng.permutation(32).astype(np.int32)
    s = pm.Stream.from_handle(owner.address, device=device, owner=owner)
    assert s.handle == owner.address and not s.is_default and s.device is device
    dx, di = pm.to_device(x, stream=s), pm.to_device(idx, stream=s)
    out = pm.moe_init_routing_v2_grad(dx, di, 2, stream=s)
    # The work is queued on the foreign stream: the raw handle shows it pending.
    status = raw.ffi.new("aclrtStreamStatus *")
    raw.ok(raw.acl.aclrtStreamQuery(owner.stream, status))
    assert status[0] != 0, "nothing was queued on the foreign stream"
    with pm.MoeInitRoutingV2Grad(dx, di, 2) as plan:
        plan(s)
    np.testing.assert_array_equal(out.to_host(s), reference.moe_init_routing_v2_grad(x, idx, 2))
    s.close()
    assert s.closed
    assert raw.stats()["streams"] == streams, "close() destroyed a stream it does not own"
    raw.ok(raw.acl.aclrtSynchronizeStream(owner.stream))  # still alive and usable
    # Dropped without close(): still never destroyed.
    s2 = pm.Stream.from_handle(owner.address, device=device, owner=owner)
    pm.to_device(x, stream=s2)
    del s2
    gc.collect()
    device.synchronize()
    pm.zeros((1,), "float32")  # a safe point: what was dropped is released
    assert raw.stats()["streams"] == streams
    raw.ok(raw.acl.aclrtDestroyStream(owner.stream))  # the owner destroys it, once
    assert raw.stats()["streams"] == streams - 1


def test_a_borrowed_stream_keeps_its_owner_alive_while_used(device):
    raw = Emu()
    device.activate()
    owner = _Owner(raw)
    address, stream = owner.address, owner.stream
    import weakref
    alive = weakref.ref(owner)
    s = pm.Stream.from_handle(address, device=device, owner=owner)
    del owner
    gc.collect()
    assert alive() is not None, "the owner went while the stream is in use"
    s.close()
    del s
    gc.collect()
    pm.zeros((1,), "float32")
    gc.collect()
    assert alive() is None
    raw.ok(raw.acl.aclrtDestroyStream(stream))


def test_handle_zero_is_the_default_stream_and_bad_handles_are_refused(device):
    assert pm.Stream.from_handle(0, device=device) is device.default_stream
    for bad in (-1, 2**64, "0x10", 1.0, None):
        with pytest.raises(pm.InvalidArgument, match="handle"):
            pm.Stream.from_handle(bad, device=device)
