"""Full control: device arrays, your own stream, your own workspace, events for timing,
and the two phases of the op called as CANN has them.

Run with an installed CANN, or on the bundled emulator:
    PYACL_MOE_EMULATOR=1 python examples/streams_and_workspace.py
"""

from contextlib import closing

import numpy as np

import pyacl_moe as pm

tokens, top_k, hidden = 256, 8, 1024
rng = np.random.default_rng(1)
x_host = rng.standard_normal((tokens * top_k, hidden)).astype(np.float16)
idx_host = rng.permutation(tokens * top_k).astype(np.int32)

with pm.Device(0) as dev, closing(pm.Stream(dev)) as stream:
    # Copies are queued on the stream; the host arrays are kept alive until it syncs.
    x = pm.to_device(x_host, stream=stream)
    idx = pm.to_device(idx_host, stream=stream)
    out = pm.empty((tokens, hidden), np.float16, dev)

    # The op's workspace is yours to allocate once and reuse.
    size, executor = pm.get_workspace_size(x, idx, top_k, 0, 0, out)
    workspace = pm.empty((size,), np.uint8, dev)

    start, end = pm.Event(dev), pm.Event(dev)
    start.record(stream)
    pm.execute(workspace, size, executor, stream)  # queued; returns at once
    end.record(stream)

    # The high-level call takes the same stream and workspace and stays asynchronous.
    out2 = pm.moe_init_routing_v2_grad(x, idx, top_k, stream=stream, workspace=workspace)

    stream.synchronize()
    print(f"kernel time between events: {start.elapsed_ms(end):.3f} ms")

    result = out.to_host(stream)
    expected = pm.reference.moe_init_routing_v2_grad(x_host, idx_host, top_k)
    diff = np.abs(result.astype(np.float32) - expected.astype(np.float32)).max()
    print("max abs difference from the reference:", float(diff))
    assert np.array_equal(result, out2.to_host(stream))

    # A strided view goes to CANN as a strided aclTensor, without a copy: here every other
    # hidden column of the input, and an output of matching width.
    half = pm.moe_init_routing_v2_grad(x[:, ::2], idx, top_k, stream=stream)
    view = x[:, ::2]
    print(f"strided input: shape {view.shape}, element strides {view.element_strides} -> output shape "
          f"{half.to_host(stream).shape}")
    start.close()
    end.close()
