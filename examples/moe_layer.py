"""One MoE layer around the routing pair: the forward (aclnnMoeInitRoutingV2) sends each token
to its top-k experts, each expert multiplies its rows by its own weight (NumPy), the gate's
weights combine the results; backwards, the experts' input gradients go back to the tokens
through the routing's backward (aclnnMoeInitRoutingV2Grad). Dropless and drop/pad, each
checked against a plain NumPy loop over the tokens and their experts.

Run with an installed CANN, or on the bundled emulator:
    PYACL_MOE_EMULATOR=1 python examples/moe_layer.py
"""

from __future__ import annotations

import numpy as np

import pyacl_moe as pm

tokens, hidden, ffn, experts, top_k = 64, 32, 48, 8, 2
capacity = 12  # drop/pad: an expert takes at most this many slots (16 on average here, so some drop)
rng = np.random.default_rng(0)
x = rng.standard_normal((tokens, hidden)).astype(np.float32)
w = (rng.standard_normal((experts, hidden, ffn)) / np.sqrt(hidden)).astype(np.float32)
grad_out = rng.standard_normal((tokens, ffn)).astype(np.float32)  # dLoss/dOutput, from the layers above

# The gate: each token's top-k experts by score, weighted by a softmax over those k scores.
logits = rng.standard_normal((tokens, experts)).astype(np.float32)
expert_idx = np.argsort(-logits, axis=1, kind="stable")[:, :top_k].astype(np.int32)
chosen = np.take_along_axis(logits, expert_idx, axis=1)
gates = np.exp(chosen - chosen.max(axis=1, keepdims=True))
gates /= gates.sum(axis=1, keepdims=True)


def layer(drop_pad_mode: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The layer's output and dLoss/dx through the two ops, and the slots kept."""
    if drop_pad_mode == 0:
        routed = pm.moe_init_routing_v2(x, expert_idx, expert_num=experts, expert_tokens_count_or_cumsum_flag=2)
        # expanded_x [N*K, H] holds the experts' rows one expert after the other; the count
        # output says how many each has.
        bounds = np.concatenate([[0], np.cumsum(routed.expert_tokens_count_or_cumsum)])
        own = [slice(int(bounds[e]), int(bounds[e + 1])) for e in range(experts)]
        y = np.empty((tokens * top_k, ffn), np.float32)
        for e in range(experts):
            y[own[e]] = routed.expanded_x[own[e]] @ w[e]
    else:
        routed = pm.moe_init_routing_v2(x, expert_idx, expert_capacity=capacity, expert_num=experts,
                                        drop_pad_mode=1)
        y = routed.expanded_x @ w  # [E, C, H] @ [E, H, F]: one batched matmul; padding rows stay 0

    # Combine: slot i*K + t (token i's t-th expert) is row expanded_row_idx[i*K + t] of the
    # experts' output; a dropped slot (-1) gives nothing.
    idx = routed.expanded_row_idx
    kept = idx >= 0
    rows = y.reshape(-1, ffn)
    slot_out = np.where(kept[:, None], rows[np.where(kept, idx, 0)], 0).reshape(tokens, top_k, ffn)
    out = (gates[..., None] * slot_out).sum(axis=1)

    # Backwards through the combine (each kept slot's row gets its gate times the token's
    # gradient), then through each expert's matmul.
    grad_rows = np.zeros_like(rows)
    grad_rows[idx[kept]] = (gates[..., None] * grad_out[:, None, :]).reshape(-1, ffn)[kept]
    if drop_pad_mode == 0:
        grad_expanded_x = np.empty((tokens * top_k, hidden), np.float32)
        for e in range(experts):
            grad_expanded_x[own[e]] = grad_rows[own[e]] @ w[e].T
    else:
        grad_expanded_x = grad_rows.reshape(experts, capacity, ffn) @ w.transpose(0, 2, 1)

    # Backwards through the routing: each token's kept slots summed back into its row.
    grad_x = pm.moe_init_routing_v2_grad(grad_expanded_x, idx, top_k, drop_pad_mode)
    return out, grad_x, int(kept.sum())


def plain_loop(drop_pad_mode: int) -> tuple[np.ndarray, np.ndarray]:
    """The same layer token by token, in float64: out[i] = sum over kept t of gate * x[i] @ W[e],
    so dLoss/dx[i] = sum over kept t of gate * grad_out[i] @ W[e]^T."""
    out = np.zeros((tokens, ffn))
    grad_x = np.zeros((tokens, hidden))
    taken = [0] * experts
    for i in range(tokens):
        for t in range(top_k):
            e = int(expert_idx[i, t])
            taken[e] += 1
            if drop_pad_mode == 1 and taken[e] > capacity:
                continue  # the expert is full: it keeps its first slots, in token order
            out[i] += gates[i, t] * (x[i].astype(np.float64) @ w[e])
            grad_x[i] += gates[i, t] * (grad_out[i].astype(np.float64) @ w[e].T)
    return out, grad_x


for mode, name in ((0, "dropless"), (1, f"drop/pad, capacity {capacity}")):
    out, grad_x, kept = layer(mode)
    want_out, want_grad_x = plain_loop(mode)
    diff = max(float(np.abs(out - want_out).max()), float(np.abs(grad_x - want_grad_x).max()))
    assert np.allclose(out, want_out, rtol=1e-4, atol=1e-5) and np.allclose(grad_x, want_grad_x, rtol=1e-4, atol=1e-5)
    print(f"{name}: {kept} of {tokens * top_k} slots kept; output and grad_x match the loop "
          f"(max abs difference {diff:.1e})")
print("moe layer: grad_x matches the plain NumPy loop in both modes")
