"""Workspaces: one block per stream, from the device's block cache like any array's."""

from __future__ import annotations

import gc
from contextlib import closing

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe.tools.cases import compare, make_case

from .conftest import settle
from .stress import ITERATIONS, Progress, hammer

MIB16 = 16 << 20  # the op's workspace
WORKSPACE_KEYS = {"workspace_blocks", "workspace_bytes", "workspace_takes"}


def test_steady_state_launches_allocate_nothing(device, no_leaks):
    case = make_case(8, 2, 16, "float32", "dropless", seed=1)
    with closing(pm.Stream(device)) as s:
        x, idx = pm.to_device(case.grad_expanded_x, stream=s), pm.to_device(case.expanded_row_idx, stream=s)
        out = pm.empty((8, 16), np.float32)
        pm.moe_init_routing_v2_grad(x, idx, 2, out=out, stream=s)  # warm: the stream gets its block
        s.synchronize()  # (the copies' pinned staging goes back to its cache)
        before = pm.emulator.stats()["mallocs_total"]
        stats_before = pm.memory_stats()
        for _ in range(200):
            pm.moe_init_routing_v2_grad(x, idx, 2, out=out, stream=s)
        s.synchronize()
        assert pm.emulator.stats()["mallocs_total"] == before
        held = pm.memory_stats()
        assert held == stats_before  # the steady state takes nothing, from the cache or CANN
        assert held["workspace_bytes"] >= MIB16 and held["workspace_blocks"] >= 1  # the stream holds its block
        np.testing.assert_array_equal(out.to_host(s), pm.reference.moe_init_routing_v2_grad(*case.args()))
    st = pm.memory_stats()
    assert st["workspace_blocks"] == held["workspace_blocks"] - 1  # given back when the stream closed
    assert st["array_bytes_idle"] >= held["array_bytes_idle"] + MIB16  # to the cache, for the next


def test_each_live_stream_keeps_its_own_block(device, no_leaks):
    pm.empty_cache()
    case = make_case(8, 2, 16, "float32", "dropless", seed=2)
    x, idx = pm.to_device(case.grad_expanded_x), pm.to_device(case.expanded_row_idx)
    st0 = pm.memory_stats()
    assert st0["workspace_bytes"] == 0 and st0["array_bytes_idle"] == 0
    with closing(pm.Stream(device)) as a, closing(pm.Stream(device)) as b:
        out_a = pm.moe_init_routing_v2_grad(x, idx, 2, stream=a)
        out_b = pm.moe_init_routing_v2_grad(x, idx, 2, stream=b)
        st = pm.memory_stats()
        assert st["workspace_takes"] - st0["workspace_takes"] == 2
        assert (st["workspace_blocks"], st["workspace_bytes"]) == (2, 2 * MIB16)
        want = pm.reference.moe_init_routing_v2_grad(*case.args())
        assert compare(out_a.to_host(a), want).passed and compare(out_b.to_host(b), want).passed
    st = pm.memory_stats()
    assert (st["workspace_blocks"], st["workspace_bytes"]) == (0, 0)
    assert st["array_bytes_idle"] >= 2 * MIB16  # both blocks idle in the cache
    pm.empty_cache()
    assert pm.memory_stats()["array_bytes_idle"] == 0


def test_a_closed_streams_block_is_reused_at_once_by_another(device, lazy_streams, no_leaks):
    pm.empty_cache()
    a_case = make_case(64, 4, 64, "float32", "dropless", seed=2)
    b_case = make_case(64, 4, 64, "float32", "dropless", seed=3)
    a, b = pm.Stream(device), pm.Stream(device)
    xa, ia = pm.to_device(a_case.grad_expanded_x, stream=a), pm.to_device(a_case.expanded_row_idx, stream=a)
    xb, ib = pm.to_device(b_case.grad_expanded_x, stream=b), pm.to_device(b_case.expanded_row_idx, stream=b)
    run_before, events = pm.emulator.stats()["kernels_run"], pm.emulator.stats()["events"]
    out_a = pm.moe_init_routing_v2_grad(xa, ia, 4, stream=a)  # queued on a, not run
    assert pm.emulator.stats()["kernels_run"] == run_before
    a.close()  # waits for a: its kernel (which used the block) has run, the block is idle
    assert pm.emulator.stats()["kernels_run"] == run_before + 1
    pool0 = pm.memory_stats()
    assert pool0["array_bytes_idle"] >= MIB16
    out_b = pm.moe_init_routing_v2_grad(xb, ib, 4, stream=b)  # takes a's block, no event needed
    st = pm.memory_stats()
    assert st["array_hits"] - pool0["array_hits"] >= 1
    assert st["array_bytes_idle"] == pool0["array_bytes_idle"] - MIB16  # one block for both streams
    assert st["workspace_takes"] - pool0["workspace_takes"] == 1
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
    in_use = pm.memory_stats()["array_bytes_in_use"]
    del s  # dropped with its kernel queued: nothing waits, the block stays in use
    gc.collect()
    pm.emulator.stats()  # a safe point
    st = pm.memory_stats()
    assert st["array_bytes_in_use"] == in_use and pm.emulator.stats()["pending_tasks"] > 0
    device.synchronize()  # the work runs; the stream goes at the next safe point
    pm.emulator.stats()
    st = pm.memory_stats()
    assert st["array_bytes_in_use"] <= in_use - MIB16 and st["array_bytes_idle"] >= MIB16
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
    assert after["workspace_takes"] == before["workspace_takes"] and after["workspace_bytes"] == 0
    plan = pm.MoeInitRoutingV2Grad(x, idx, 2)
    plan(workspace=ws)
    assert pm.memory_stats()["workspace_bytes"] == 0
    plan.close()
    with pytest.raises(pm.InvalidArgument, match="workspace"):
        pm.moe_init_routing_v2_grad(x, idx, 2, workspace=pm.empty((100,), np.uint8))


def test_empty_cache_releases_idle_blocks(device):
    case = make_case(8, 2, 16, "float32", "dropless", seed=5)
    x, idx = pm.to_device(case.grad_expanded_x), pm.to_device(case.expanded_row_idx)
    pm.moe_init_routing_v2_grad(x, idx, 2).to_host()
    assert pm.memory_stats()["workspace_bytes"] >= MIB16
    allocs = pm.emulator.stats()["device_allocations"]
    pm.empty_cache()
    st = pm.memory_stats()
    assert st["workspace_bytes"] == 0 and st["array_bytes_idle"] == 0
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
    allocs = pm.emulator.stats()["device_allocations"]
    pm.empty_cache()
    st = pm.emulator.stats()
    assert st["kernels_run"] == ran  # nothing waited
    assert st["executors"] == executors - 1  # the cached executor goes at once (the launch captured it)
    assert st["device_allocations"] == allocs  # the workspace, until the kernel has run
    s.synchronize()
    pm.empty_cache()  # its work has run: the next empty_cache gives it back to CANN
    assert pm.emulator.stats()["device_allocations"] == allocs - 1
    assert pm.memory_stats()["array_bytes_idle"] == 0
    assert compare(out.to_host(), pm.reference.moe_init_routing_v2_grad(*case.args())).passed


def test_memory_stats_refuses_a_bad_device(device):
    caches = {f"{kind}_{k}" for kind in ("array", "pinned")
              for k in ("hits", "misses", "bytes_idle", "bytes_in_use", "blocks_idle")}
    assert set(pm.memory_stats()) == WORKSPACE_KEYS | caches
    assert pm.memory_stats(device) == pm.memory_stats(0)
    with pytest.raises(pm.InvalidArgument, match="device"):
        pm.memory_stats("0")


def test_empty_cache_never_frees_a_workspace_a_queued_kernel_uses(device):
    case = make_case(64, 4, 128, "float32", "dropless", seed=12)
    expected = pm.moe_init_routing_v2_grad(*case.args())  # the kernel is deterministic: bit-exact

    launches = Progress()

    def launcher(i, steps):
        with closing(pm.Stream(device)) as s:
            x, idx = pm.to_device(case.grad_expanded_x, stream=s), pm.to_device(case.expanded_row_idx, stream=s)
            for _ in launches.steps(steps):
                outs = [pm.moe_init_routing_v2_grad(x, idx, 4, stream=s) for _ in range(4)]
                for o in outs:
                    assert np.array_equal(o.to_host(s), expected)

    def emptier(i, steps):
        while launches.running:
            pm.empty_cache()

    faults = pm.emulator.stats()["device_faults"]
    errors = hammer([launches.counted(launcher), launches.counted(launcher), emptier], 4 * ITERATIONS)
    assert not errors, errors[0]
    assert pm.emulator.stats()["device_faults"] == faults


def test_the_caches_keep_count_of_every_block_under_threads(device):
    """Six threads, each with a layout of its own on one shared stream, take and give back
    blocks at once: afterwards the figures add up, and empty_cache() leaves nothing behind."""
    before, st0 = settle(), pm.memory_stats()
    shared = pm.Stream(device)
    cases = [make_case(16, 2, 16 + 8 * i, "float32", "dropless", seed=i) for i in range(6)]
    arrays = [(pm.to_device(c.grad_expanded_x, stream=shared), pm.to_device(c.expanded_row_idx, stream=shared))
              for c in cases]

    def worker(i, steps):
        x, idx = arrays[i]
        for _ in range(steps):
            pm.moe_init_routing_v2_grad(x, idx, 2, stream=shared)  # a new out each call

    errors = hammer([worker] * 6, 4 * ITERATIONS)
    shared.close()
    arrays.clear()
    assert not errors, errors[0]
    after = settle()
    st = pm.memory_stats()
    assert (st["workspace_blocks"], st["array_bytes_idle"], st["array_blocks_idle"]) == (0, 0, 0)
    assert st["array_bytes_in_use"] == st0["array_bytes_in_use"]
    taken = st["array_hits"] + st["array_misses"] - st0["array_hits"] - st0["array_misses"]
    assert taken > 6 * 4 * ITERATIONS  # each out taken from the cache or made
    assert after["device_allocations"] == before["device_allocations"]


def test_a_live_plan_keeps_no_closed_streams_workspace(device, no_leaks):
    # A plan bound to a stream kept the stream's workspace for as long as the plan lived: 100
    # short-lived streams held 1.6 GiB that empty_cache() did not free and memory_stats did
    # not show. A stream's workspace is the stream's: its close gives it back.
    pm.empty_cache()
    case = make_case(8, 2, 16, "float32", "dropless", seed=21)
    x, idx = pm.to_device(case.grad_expanded_x), pm.to_device(case.expanded_row_idx)
    before = pm.emulator.stats()["device_bytes"]
    with pm.MoeInitRoutingV2Grad(x, idx, 2) as plan:
        for _ in range(12):
            with closing(pm.Stream(device)) as s:
                plan(s)
        st = pm.memory_stats()
        assert st["workspace_blocks"] <= 1 and st["array_bytes_in_use"] < 2 * MIB16, st
        pm.empty_cache()
        assert pm.emulator.stats()["device_bytes"] - before < 2 * MIB16  # at most the default stream's
        np.testing.assert_array_equal(plan(device.default_stream).to_host(), pm.reference.moe_init_routing_v2_grad(
            *case.args()))


def child_out_of_memory_frees_idle_workspaces() -> None:
    import numpy as np

    import pyacl_moe as pm

    pm.use_emulator()
    dev = pm.Device(0)
    x, idx = pm.to_device(np.ones((8, 4), np.float32)), pm.to_device(np.arange(8, dtype=np.int32))
    streams = [pm.Stream(dev) for _ in range(14)]
    for s in streams:  # each takes a workspace of 16 MiB, kept while the stream lives
        pm.moe_init_routing_v2_grad(x, idx, 2, stream=s).to_host(s)
    print("held", pm.memory_stats()["workspace_bytes"] >> 20)
    big = pm.empty((64 << 20,), np.uint8)  # 224 MiB held of 256: an idle workspace must go
    big.fill(1)
    print("allocated", big.nbytes >> 20, pm.memory_stats()["workspace_blocks"])


def test_out_of_memory_gives_back_idle_streams_workspaces(isolated):
    # With 256 MiB of device memory, 14 idle streams' workspaces made a 64 MiB allocation fail
    # with 207001: the out-of-memory retry emptied only the block caches.
    from .conftest import run_isolated

    r = run_isolated(child_out_of_memory_frees_idle_workspaces, env={"PYACL_MOE_EMU_MEMORY": "256M"})
    assert r.returncode == 0, r.stderr
    held, allocated = r.stdout.split("\n")[:2]
    assert held == "held 224" and allocated.startswith("allocated 64 "), r.stdout


def test_a_plans_queued_launch_keeps_its_streams_workspace(device, lazy_streams):
    """A plan's launch in its steady state took no point of its stream: once the stream had
    been waited for, its workspace looked unused while a launch using it was still queued, so
    empty_cache() freed it (the kernel faulted on freed memory) and a grown workspace's old
    block went to another stream at once."""
    rng = np.random.default_rng(0)
    x, idx = rng.standard_normal((64, 32)).astype(np.float32), rng.permutation(64).astype(np.int32)
    want = pm.reference.moe_init_routing_v2_grad(x, idx, 4)
    with closing(pm.Stream(device)) as s1, closing(pm.Stream(device)) as s2:
        dx, di = pm.to_device(x, stream=s1), pm.to_device(idx, stream=s1)
        with pm.MoeInitRoutingV2Grad(dx, di, 4) as plan:
            plan(s1)  # binds the plan to s1 and its workspace
            s1.synchronize()
            out = plan(s1)  # the steady state: queued (lazy), on s1's workspace
            pm.empty_cache()  # s1's workspace given up: kept until the launch has run
            s1.synchronize()
            np.testing.assert_array_equal(out.to_host(s1), want)
            plan(s1)
            s1.synchronize()
            out = plan(s1)  # queued again, on the new workspace
            old = s1.state.workspace.ptr
            s1.state.ensure_workspace(plan.workspace_size + 1)  # grown (as a bigger op's launch would)
            other = pm.empty((plan.workspace_size,), np.uint8, stream=s2)
            assert other.data_ptr != old, "another stream took a workspace block a queued launch uses"
            s1.synchronize()
            np.testing.assert_array_equal(out.to_host(s1), want)
