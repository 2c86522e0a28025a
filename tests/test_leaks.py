"""Long loops leave nothing behind: every emulator counter back where it started once the
caches are emptied, and the process's resident memory within 16 MiB of where it was after
warm-up. A short version runs by default; the full one (100,000 plan relaunches, 10,000
one-shot calls, 1,000 NumPy calls) is marked slow. Each runs in a fresh process, so the
memory figure is this loop's alone."""

from __future__ import annotations

import gc
import json
import os
from contextlib import closing

import pytest

import pyacl_moe as pm
from pyacl_moe.tools.cases import compare, make_case

from .conftest import LIVE


def child_soak(plan_n: int, oneshot_n: int, numpy_n: int) -> None:
    """The loops once to warm up, then ``plan_n`` plan relaunches, ``oneshot_n`` one-shot calls
    and ``numpy_n`` NumPy calls; prints the live counters before and after, the growth of the
    resident memory, the guards and the kernels run, as JSON."""
    pm.use_emulator()
    dev = pm.Device(0)
    case = make_case(16, 4, 64, "bfloat16", "dropless", seed=1)
    want = pm.reference.moe_init_routing_v2_grad(*case.args())
    page = os.sysconf("SC_PAGE_SIZE")

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    def settle():
        dev.synchronize()
        pm.empty_cache()
        gc.collect()
        return pm.emulator.stats()

    def loops(plan_n, oneshot_n, numpy_n):
        with closing(pm.Stream(dev)) as s:
            x, idx = pm.to_device(case.grad_expanded_x, stream=s), pm.to_device(case.expanded_row_idx, stream=s)
            with pm.MoeInitRoutingV2Grad(x, idx, 4) as plan:
                for i in range(plan_n):
                    plan(s)
                    if i % 1000 == 999:
                        s.synchronize()
                assert compare(plan.out.to_host(s), want).passed
            out = pm.empty((16, 64), pm.bfloat16)
            for i in range(oneshot_n):
                pm.moe_init_routing_v2_grad(x, idx, 4, out=out, stream=s)
                if i % 1000 == 999:
                    s.synchronize()
            assert compare(out.to_host(s), want).passed
        for _ in range(numpy_n):
            got = pm.moe_init_routing_v2_grad(*case.args())
        assert compare(got, want).passed

    loops(300, 300, 30)  # warm-up: caches, pools, allocator arenas
    before, rss0 = settle(), rss()
    loops(plan_n, oneshot_n, numpy_n)
    after, rss1 = settle(), rss()
    print(json.dumps({"before": {k: before[k] for k in LIVE}, "after": {k: after[k] for k in LIVE},
                      "rss_growth": rss1 - rss0, "guards": pm.emulator.check_guards(),
                      "kernels": after["kernels_run"] - before["kernels_run"]}))


def _soak(isolated, plan: int, oneshot: int, numpy: int) -> dict:
    r = isolated(child_soak, plan, oneshot, numpy, timeout=1200)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _check(res: dict, kernels: int) -> None:
    assert res["after"] == res["before"], res
    assert res["rss_growth"] < 16 << 20, f"resident memory grew by {res['rss_growth'] / 2**20:.1f} MiB"
    assert res["guards"] == 0
    assert res["kernels"] == kernels


def test_short_soak(isolated):
    _check(_soak(isolated, 2000, 1000, 50), 2000 + 1000 + 50)


@pytest.mark.slow
def test_full_soak(isolated):
    _check(_soak(isolated, 100_000, 10_000, 1_000), 100_000 + 10_000 + 1_000)
