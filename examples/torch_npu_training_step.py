"""One training step's routing backward on torch_npu tensors, on torch_npu's own stream.

The gradient of the routed tokens (grad_expanded_x) and the routing indices live on the NPU
as torch tensors; pm.from_torch wraps their memory (no copy) and pm.Stream.from_handle
borrows torch_npu's current stream, so the op runs in order with torch's own kernels and
nothing has to synchronize in between.

Needs an Ascend machine with CANN and torch_npu:
    python examples/torch_npu_training_step.py
Elsewhere it says so on stderr and exits with status 77 (skipped).
"""

import sys

import numpy as np

import pyacl_moe as pm

SKIPPED = 77  # the exit status of a run skipped for a missing dependency (what test drivers read as skip)

try:
    import torch
    import torch_npu  # type: ignore[import-not-found]  # noqa: F401  (registers the "npu" device with torch)
except ImportError:
    print("torch_npu_training_step.py: skipped: it needs torch and torch_npu on an Ascend machine", file=sys.stderr)
    sys.exit(SKIPPED)

tokens, top_k, hidden = 1024, 2, 512
device = torch.device("npu", 0)
rng = np.random.default_rng(0)
expanded_row_idx = torch.from_numpy(rng.permutation(tokens * top_k).astype(np.int32)).to(device)

# The forward pass produced expanded_x from x; autograd hands us the gradient of expanded_x.
grad_expanded_x = torch.randn(tokens * top_k, hidden, dtype=torch.bfloat16, device=device)
grad_expanded_x = grad_expanded_x * 0.5  # some torch work queued on torch_npu's stream

stream = pm.Stream.from_handle(torch_npu.npu.current_stream().npu_stream, device=0)
grad_x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=device)
pm.moe_init_routing_v2_grad(pm.from_torch(grad_expanded_x), pm.from_torch(expanded_row_idx), top_k,
                            out=pm.from_torch(grad_x), stream=stream)
# Same stream: torch's next kernels see grad_x without a synchronize.
norm = grad_x.float().norm()
print(f"grad_x norm: {norm.item():.3f}")

expected = pm.reference.moe_init_routing_v2_grad(
    grad_expanded_x.view(torch.int16).cpu().numpy().view(pm.bfloat16), expanded_row_idx.cpu().numpy(), top_k)
got = grad_x.view(torch.int16).cpu().numpy().view(pm.bfloat16)
print("max abs difference from the reference:",
      float(np.max(np.abs(got.astype(np.float32) - expected.astype(np.float32)))))
