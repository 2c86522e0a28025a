"""torch tensors on the host in, torch tensors out: bfloat16 included, no conversion by hand.

    PYACL_MOE_EMULATOR=1 python examples/torch_cpu.py     (or on an Ascend machine without the variable)

Needs torch (the CPU build is enough: see the README for getting it; pip install -e '.[torch]' then
installs nothing more); without it, it says so on stderr and exits with status 77 (skipped).
"""

import sys

import numpy as np

import pyacl_moe as pm

SKIPPED = 77  # the exit status of a run skipped for a missing dependency (what test drivers read as skip)

try:
    import torch
except ImportError:
    print("torch_cpu.py: skipped: it needs torch (pip install -e '.[torch]')", file=sys.stderr)
    sys.exit(SKIPPED)

tokens, top_k, hidden = 64, 2, 128
grad_expanded_x = torch.randn(tokens * top_k, hidden).to(torch.bfloat16)
expanded_row_idx = torch.randperm(tokens * top_k, dtype=torch.int32)

grad_x = pm.moe_init_routing_v2_grad(grad_expanded_x, expanded_row_idx, top_k)
print(type(grad_x).__name__, grad_x.dtype, tuple(grad_x.shape))

expected = pm.reference.moe_init_routing_v2_grad(grad_expanded_x.view(torch.int16).numpy().view(pm.bfloat16),
                                                 expanded_row_idx.numpy(), top_k)
diff = (grad_x.float() - torch.from_numpy(expected.astype(np.float32))).abs().max().item()
print("max abs difference from the reference:", diff)
