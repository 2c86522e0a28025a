"""The stream-ordered workspace pool."""

from __future__ import annotations

import numpy as np

import pyacl_moe as pm
from pyacl_moe.tools.cases import compare, make_case


def test_steady_state_launches_allocate_nothing(device, no_leaks):
    case = make_case(8, 2, 16, "float32", "dropless", seed=1)
    with pm.Stream(device) as s:
        x, idx = pm.to_device(case.grad_expanded_x, stream=s), pm.to_device(case.expanded_row_idx, stream=s)
        out = pm.empty((8, 16), np.float32)
        pm.moe_init_routing_v2_grad(x, idx, 2, out=out, stream=s)  # warm: the pool gets its block
        before = pm.emulator.stats()["mallocs_total"]
        pool_before = pm.memory_stats()
        for _ in range(200):
            pm.moe_init_routing_v2_grad(x, idx, 2, out=out, stream=s)
        s.synchronize()
        assert pm.emulator.stats()["mallocs_total"] == before
        pool_after = pm.memory_stats()
        assert pool_after["misses"] == pool_before["misses"]
        assert pool_after["hits"] - pool_before["hits"] == 200
        assert pool_after["bytes_held"] == 16 << 20 and pool_after["blocks_in_use"] == 0


def test_cross_stream_reuse_waits_for_the_event(device, no_leaks):
    pm.empty_cache()
    a_case = make_case(64, 4, 64, "float32", "dropless", seed=2)
    b_case = make_case(64, 4, 64, "float32", "dropless", seed=3)
    with pm.Stream(device) as a, pm.Stream(device) as b:
        xa, ia = pm.to_device(a_case.grad_expanded_x, stream=a), pm.to_device(a_case.expanded_row_idx, stream=a)
        xb, ib = pm.to_device(b_case.grad_expanded_x, stream=b), pm.to_device(b_case.expanded_row_idx, stream=b)
        pool0 = pm.memory_stats()
        out_a = pm.moe_init_routing_v2_grad(xa, ia, 4, stream=a)  # queued on a, not run
        run_before = pm.emulator.stats()["kernels_run"]
        assert pm.memory_stats()["blocks_free"] == 1
        out_b = pm.moe_init_routing_v2_grad(xb, ib, 4, stream=b)  # gets a's block, behind an event
        st = pm.memory_stats()
        assert st["cross_stream_reuses"] - pool0["cross_stream_reuses"] == 1
        assert st["misses"] - pool0["misses"] == 1  # reused, not allocated again
        assert pm.emulator.stats()["kernels_run"] == run_before  # nothing ran yet: streams are lazy
        b.synchronize()
        # Running b ran a up to the event first: a's kernel (which used the block) is done.
        assert pm.emulator.stats()["kernels_run"] == run_before + 2
        assert compare(out_b.to_host(b), pm.reference.moe_init_routing_v2_grad(*b_case.args())).passed
        assert compare(out_a.to_host(a), pm.reference.moe_init_routing_v2_grad(*a_case.args())).passed
    pm.empty_cache()


def test_user_workspace_wins(device, no_leaks):
    case = make_case(8, 2, 16, "float32", "dropless", seed=4)
    x, idx = pm.to_device(case.grad_expanded_x), pm.to_device(case.expanded_row_idx)
    pm.empty_cache()
    ws = pm.empty((16 << 20,), np.uint8)
    before = pm.memory_stats()
    pm.moe_init_routing_v2_grad(x, idx, 2, workspace=ws)
    after = pm.memory_stats()
    assert (after["hits"], after["misses"], after["bytes_held"]) == (before["hits"], before["misses"], 0)
    plan = pm.MoeInitRoutingV2Grad(x, idx, 2)
    plan(workspace=ws)
    assert pm.memory_stats()["bytes_held"] == 0
    plan.close()


def test_empty_cache_releases_idle_blocks(device):
    case = make_case(8, 2, 16, "float32", "dropless", seed=5)
    x, idx = pm.to_device(case.grad_expanded_x), pm.to_device(case.expanded_row_idx)
    pm.moe_init_routing_v2_grad(x, idx, 2)
    assert pm.memory_stats()["bytes_held"] >= 16 << 20
    allocs = pm.emulator.stats()["device_allocations"]
    pm.empty_cache()
    assert pm.memory_stats()["bytes_held"] == 0
    assert pm.emulator.stats()["device_allocations"] < allocs
