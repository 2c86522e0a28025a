"""Run in a fresh interpreter against whatever CANN the environment points at (an emulated
release's home in ``$ASCEND_HOME_PATH``, no ``--emulator``): prints, as JSON, what the binding
sees of the release and how its op answers where releases differ. tests/test_release.py runs it
once per emulated release.

    ASCEND_HOME_PATH=<home> python -m tests.release_probe
"""

from __future__ import annotations

import json

import numpy as np

import pyacl_moe as pm
from pyacl_moe import reference


def _status(fn) -> int:
    try:
        fn()
    except pm.AclError as exc:
        return exc.status
    return 0


def main() -> None:
    info, version = pm.library_info(), pm.cann_version()
    dev = pm.Device(0)
    s = pm.Stream(dev)
    rng = np.random.default_rng(0)
    n, k, h = 6, 2, 5
    x = rng.standard_normal((n * k, h)).astype(np.float32)
    idx = rng.permutation(n * k).astype(np.int32)
    want = reference.moe_init_routing_v2_grad(x, idx, k)
    dx, di = pm.to_device(x, stream=s), pm.to_device(idx, stream=s)

    # topK 5 does not divide 12 indices: the tiling refuses it, in the release's own code.
    tiling = _status(lambda: pm.get_workspace_size(dx, di, 5, 0, 0, pm.empty((2, h), np.float32)))
    size, executor = pm.get_workspace_size(dx, di, k, 0, 0, pm.empty((n, h), np.float32))
    executor.close()

    # A strided out (every other column of [n, 2h + 1], past a poisoned first column), handed to
    # CANN untouched: densely at the view's address, or through its strides?
    poison = np.full((n, 2 * h + 1), -3.0, np.float32)
    buf = pm.to_device(poison, stream=s)
    pm.moe_init_routing_v2_grad(dx, di, k, out=buf[:, 1::2], stream=s, validate=False)
    whole = buf.to_host(s)
    dense = np.array_equal(whole.reshape(-1)[1:1 + n * h], want.reshape(-1))
    strides = np.array_equal(whole[:, 1::2], want)
    try:
        pm.moe_init_routing_v2_grad(dx, di, k, out=pm.empty((n, 2 * h), np.float32)[:, ::2], stream=s)
        binding = "accepted"
    except pm.InvalidArgument as exc:
        binding = str(exc)

    # The one call and a plan, as any user makes them.
    one = pm.moe_init_routing_v2_grad(x, idx, k)
    with pm.MoeInitRoutingV2Grad(dx, di, k) as plan:
        planned = plan(s).to_host(s)
    routed = pm.moe_init_routing_v2(x[:n], rng.integers(0, 4, (n, k)).astype(np.int32), expert_num=4)
    print(json.dumps({
        "backend": info.backend, "home": info.home, "libraries": info.paths, "dependencies": list(info.dependencies),
        **version.as_dict(), "expectations": version.behaviour.behaviour.since, "note": version.behaviour.note,
        "tiling_status": tiling, "workspace": size, "strided_out": "strides" if strides else "dense" if dense else
        "neither", "binding_strided_out": binding, "one_call": bool(np.array_equal(one, want)),
        "plan": bool(np.array_equal(planned, want)),
        "forward_rows": list(routed.expanded_x.shape),
    }))


if __name__ == "__main__":
    main()
