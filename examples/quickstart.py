"""NumPy in, NumPy out: the backward of MoE token routing in one call.

Run with an installed CANN (after `source /usr/local/Ascend/ascend-toolkit/set_env.sh`), or on
the bundled emulator:  PYACL_MOE_EMULATOR=1 python examples/quickstart.py
"""

import numpy as np

import pyacl_moe as pm

tokens, top_k, hidden = 4, 2, 8
rng = np.random.default_rng(0)

# Dropless routing: every (token, expert) slot has a row in grad_expanded_x, and
# expanded_row_idx[i * top_k + t] says which row holds token i's t-th copy.
grad_expanded_x = rng.standard_normal((tokens * top_k, hidden)).astype(np.float32)
expanded_row_idx = rng.permutation(tokens * top_k).astype(np.int32)

grad_x = pm.moe_init_routing_v2_grad(grad_expanded_x, expanded_row_idx, top_k)

expected = pm.reference.moe_init_routing_v2_grad(grad_expanded_x, expanded_row_idx, top_k)
print("backend:", pm.library_info().backend)
print("grad_x shape:", grad_x.shape)
print("max abs difference from the NumPy reference:", float(np.abs(grad_x - expected).max()))
assert np.allclose(grad_x, expected, rtol=1e-5, atol=1e-6)

# bfloat16 works the same way (ml_dtypes), and so do the other scenarios:
# drop/pad mode takes [experts, capacity, hidden] and -1 for dropped slots.
experts, capacity = 3, 2
x3 = rng.standard_normal((experts, capacity, hidden)).astype(pm.bfloat16)
idx3 = np.array([0, -1, 3, 1, -1, 5, 2, 4], dtype=np.int32)
out3 = pm.moe_init_routing_v2_grad(x3, idx3, top_k, drop_pad_mode=1)
print("drop/pad bfloat16 result:", out3.dtype, out3.shape)
