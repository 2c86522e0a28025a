"""Threads sharing a device, input arrays, a plan, a stream and the workspace pool.

No locks in user code: the binding keeps what queued work uses alive until it has run, a
plan's steady state launches without a lock, and closing is safe from any thread. Ordering
between two streams is the caller's: here each thread reads back on the stream it launched on.

Run with an installed CANN, or on the bundled emulator:
    PYACL_MOE_EMULATOR=1 python examples/threads.py
"""

import threading
from contextlib import closing

import numpy as np

import pyacl_moe as pm

tokens, top_k, hidden = 64, 4, 256
rng = np.random.default_rng(2)
x_host = rng.standard_normal((tokens * top_k, hidden)).astype(np.float32)
idx_host = rng.permutation(tokens * top_k).astype(np.int32)

dev = pm.Device(0)
x, idx = pm.to_device(x_host), pm.to_device(idx_host)  # shared, read-only, by every thread
expected = pm.moe_init_routing_v2_grad(x, idx, top_k).to_host()  # the kernel is deterministic
results: dict[object, np.ndarray] = {}


def worker(i: int) -> None:
    # Each thread: its own stream and its own plan (a plan writes one `out`), the same inputs.
    with closing(pm.Stream(dev)) as own, pm.MoeInitRoutingV2Grad(x, idx, top_k) as plan:
        for _ in range(20):
            plan(own)
        results[i] = plan.out.to_host(own)


shared = pm.Stream(dev)
shared_plan = pm.MoeInitRoutingV2Grad(x, idx, top_k)


def producer() -> None:
    for _ in range(20):
        shared_plan(shared)  # several threads queue the same plan on one stream
        pm.moe_init_routing_v2_grad(x, idx, top_k, stream=shared)  # its `out` is dropped at once


def consumer() -> None:
    for _ in range(20):
        shared.synchronize()  # releases only what was queued before it began


threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
threads += [threading.Thread(target=producer) for _ in range(2)] + [threading.Thread(target=consumer)]
for t in threads:
    t.start()
for t in threads:
    t.join()

results["shared"] = shared_plan.out.to_host(shared)
shared_plan.close()
shared.close()
print("threads:", len(threads), "results bit-exact:", all(np.array_equal(r, expected) for r in results.values()))
assert all(np.array_equal(r, expected) for r in results.values())
pm.empty_cache()
print("pool after empty_cache:", pm.memory_stats())
