"""The workspace pool: one workspace block per stream, shared through the device's pool."""

from __future__ import annotations

import gc
from contextlib import closing

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe.tools.cases import compare, make_case

MIB16 = 16 << 20  # the op's workspace
WORKSPACE_KEYS = {"hits", "misses", "cross_stream_reuses", "blocks_free", "blocks_in_use", "bytes_held"}


def _workspace_stats() -> dict[str, int]:
    return {k: v for k, v in pm.memory_stats().items() if k in WORKSPACE_KEYS}


def test_steady_state_launches_allocate_nothing(device, no_leaks):
    case = make_case(8, 2, 16, "float32", "dropless", seed=1)
    with closing(pm.Stream(device)) as s:
        x, idx = pm.to_device(case.grad_expanded_x, stream=s), pm.to_device(case.expanded_row_idx, stream=s)
        out = pm.empty((8, 16), np.float32)
        pm.moe_init_routing_v2_grad(x, idx, 2, out=out, stream=s)  # warm: the stream gets its block
        before = pm.emulator.stats()["mallocs_total"]
        pool_before = _workspace_stats()
        for _ in range(200):
            pm.moe_init_routing_v2_grad(x, idx, 2, out=out, stream=s)
        s.synchronize()
        assert pm.emulator.stats()["mallocs_total"] == before
        pool_after = _workspace_stats()
        assert pool_after == pool_before  # the steady state never touches the pool
        assert pool_after["bytes_held"] >= MIB16 and pool_after["blocks_in_use"] >= 1  # the stream holds its block
        np.testing.assert_array_equal(out.to_host(s), pm.reference.moe_init_routing_v2_grad(*case.args()))
    st = pm.memory_stats()
    assert st["blocks_in_use"] == pool_after["blocks_in_use"] - 1  # given back when the stream closed
    assert st["blocks_free"] == pool_after["blocks_free"] + 1


def test_each_live_stream_keeps_its_own_block(device, no_leaks):
    pm.empty_cache()
    case = make_case(8, 2, 16, "float32", "dropless", seed=2)
    x, idx = pm.to_device(case.grad_expanded_x), pm.to_device(case.expanded_row_idx)
    st0 = pm.memory_stats()
    assert st0["bytes_held"] == 0
    with closing(pm.Stream(device)) as a, closing(pm.Stream(device)) as b:
        out_a = pm.moe_init_routing_v2_grad(x, idx, 2, stream=a)
        out_b = pm.moe_init_routing_v2_grad(x, idx, 2, stream=b)
        st = pm.memory_stats()
        assert st["misses"] - st0["misses"] == 2 and st["hits"] == st0["hits"]
        assert (st["blocks_in_use"], st["blocks_free"], st["bytes_held"]) == (2, 0, 2 * MIB16)
        want = pm.reference.moe_init_routing_v2_grad(*case.args())
        assert compare(out_a.to_host(a), want).passed and compare(out_b.to_host(b), want).passed
    st = pm.memory_stats()
    assert (st["blocks_in_use"], st["blocks_free"], st["bytes_held"]) == (0, 2, 2 * MIB16)
    pm.empty_cache()
    assert pm.memory_stats()["bytes_held"] == 0


def test_a_closed_streams_block_is_reused_at_once_by_another(device, lazy_streams, no_leaks):
    pm.empty_cache()
    a_case = make_case(64, 4, 64, "float32", "dropless", seed=2)
    b_case = make_case(64, 4, 64, "float32", "dropless", seed=3)
    a, b = pm.Stream(device), pm.Stream(device)
    xa, ia = pm.to_device(a_case.grad_expanded_x, stream=a), pm.to_device(a_case.expanded_row_idx, stream=a)
    xb, ib = pm.to_device(b_case.grad_expanded_x, stream=b), pm.to_device(b_case.expanded_row_idx, stream=b)
    pool0 = pm.memory_stats()
    run_before, events = pm.emulator.stats()["kernels_run"], pm.emulator.stats()["events"]
    out_a = pm.moe_init_routing_v2_grad(xa, ia, 4, stream=a)  # queued on a, not run
    assert pm.emulator.stats()["kernels_run"] == run_before
    a.close()  # waits for a: its kernel (which used the block) has run, the block is idle
    assert pm.emulator.stats()["kernels_run"] == run_before + 1
    assert pm.memory_stats()["blocks_free"] == pool0["blocks_free"] + 1
    out_b = pm.moe_init_routing_v2_grad(xb, ib, 4, stream=b)  # takes a's block, no event needed
    st = pm.memory_stats()
    assert st["cross_stream_reuses"] - pool0["cross_stream_reuses"] == 1
    assert st["hits"] - pool0["hits"] == 1 and st["misses"] == pool0["misses"] + 1  # one block for both
    assert pm.emulator.stats()["events"] == events  # no event ordered the reuse
    assert compare(out_b.to_host(b), pm.reference.moe_init_routing_v2_grad(*b_case.args())).passed
    assert compare(out_a.to_host(), pm.reference.moe_init_routing_v2_grad(*a_case.args())).passed
    b.close()
    pm.empty_cache()


def test_a_dropped_stream_gives_its_block_back_once_its_work_has_run(device, lazy_streams, no_leaks):
    pm.empty_cache()
    case = make_case(64, 4, 64, "float32", "dropless", seed=6)
    s = pm.Stream(device)
    x, idx = pm.to_device(case.grad_expanded_x, stream=s), pm.to_device(case.expanded_row_idx, stream=s)
    out = pm.moe_init_routing_v2_grad(x, idx, 4, stream=s)
    del s  # dropped with its kernel queued: nothing waits, the block stays in use
    gc.collect()
    assert pm.memory_stats()["blocks_in_use"] == 1 and pm.emulator.stats()["pending_tasks"] > 0
    device.synchronize()  # the work runs; the stream goes at the next safe point
    pm.emulator.stats()
    st = pm.memory_stats()
    assert (st["blocks_in_use"], st["blocks_free"]) == (0, 1)
    assert compare(out.to_host(), pm.reference.moe_init_routing_v2_grad(*case.args())).passed
    pm.empty_cache()


def test_user_workspace_wins(device, no_leaks):
    case = make_case(8, 2, 16, "float32", "dropless", seed=4)
    x, idx = pm.to_device(case.grad_expanded_x), pm.to_device(case.expanded_row_idx)
    pm.empty_cache()
    ws = pm.empty((MIB16,), np.uint8)
    before = pm.memory_stats()
    pm.moe_init_routing_v2_grad(x, idx, 2, workspace=ws)
    after = pm.memory_stats()
    assert (after["hits"], after["misses"], after["bytes_held"]) == (before["hits"], before["misses"], 0)
    plan = pm.MoeInitRoutingV2Grad(x, idx, 2)
    plan(workspace=ws)
    assert pm.memory_stats()["bytes_held"] == 0
    plan.close()
    with pytest.raises(pm.InvalidArgument, match="workspace"):
        pm.moe_init_routing_v2_grad(x, idx, 2, workspace=pm.empty((100,), np.uint8))


def test_empty_cache_releases_idle_blocks(device):
    case = make_case(8, 2, 16, "float32", "dropless", seed=5)
    x, idx = pm.to_device(case.grad_expanded_x), pm.to_device(case.expanded_row_idx)
    pm.moe_init_routing_v2_grad(x, idx, 2).to_host()
    assert pm.memory_stats()["bytes_held"] >= MIB16
    allocs = pm.emulator.stats()["device_allocations"]
    pm.empty_cache()
    assert pm.memory_stats()["bytes_held"] == 0
    assert pm.emulator.stats()["device_allocations"] < allocs
    pm.empty_cache(device)  # one device, by object or id: nothing left to do
    pm.empty_cache(0)


def test_empty_cache_never_waits_for_queued_work(device, lazy_streams):
    pm.empty_cache()
    case = make_case(64, 4, 64, "float32", "dropless", seed=7)
    x, idx = pm.to_device(case.grad_expanded_x), pm.to_device(case.expanded_row_idx)
    s = device.default_stream
    out = pm.moe_init_routing_v2_grad(x, idx, 4, stream=s)  # queued, not run
    ran, executors = pm.emulator.stats()["kernels_run"], pm.emulator.stats()["executors"]
    pm.empty_cache()
    st = pm.emulator.stats()
    assert st["kernels_run"] == ran  # nothing waited
    assert st["executors"] == executors - 1  # the cached executor goes at once (the launch captured it)
    assert pm.memory_stats()["bytes_held"] == MIB16  # the workspace, until the kernel has run
    s.synchronize()
    assert pm.memory_stats()["bytes_held"] == 0
    assert compare(out.to_host(), pm.reference.moe_init_routing_v2_grad(*case.args())).passed


def test_memory_stats_refuses_a_bad_device(device):
    caches = {f"{kind}_{k}" for kind in ("array", "pinned")
              for k in ("hits", "misses", "bytes_idle", "bytes_in_use", "blocks_idle")}
    assert set(pm.memory_stats()) == WORKSPACE_KEYS | caches
    assert pm.memory_stats(device) == pm.memory_stats(0)
    with pytest.raises(pm.InvalidArgument, match="device"):
        pm.memory_stats("0")
