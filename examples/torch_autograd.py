"""One MoE layer's training step in torch, with the routing as a differentiable operator.

    PYACL_MOE_EMULATOR=1 python examples/torch_autograd.py     (or on an Ascend machine without the variable)

The gate picks each token's top-k experts; pyacl_moe.torch.moe_init_routing_v2 sorts the
tokens into expert order (aclnnMoeInitRoutingV2); each expert's rows go through its two
matmuls; the outputs are gathered back to the tokens and mixed by the gate's weights.
loss.backward() runs the routing's derivative, aclnnMoeInitRoutingV2Grad, with no hand-written
backward. The same step as a plain PyTorch loop over tokens must give the same loss, the
same gradients and the same weights after one SGD step.

Needs torch (the CPU build is enough); without it, it says so on stderr and exits with status 77 (skipped). On CPU tensors the
routing runs through the host path; torch_npu tensors would run in place on torch_npu's stream.
"""

import sys
from typing import Callable

import pyacl_moe as pm

SKIPPED = 77  # the exit status of a run skipped for a missing dependency (what test drivers read as skip)

try:
    import torch
except ImportError:
    print("torch_autograd.py: skipped: it needs torch (pip install -e '.[torch]')", file=sys.stderr)
    sys.exit(SKIPPED)

import pyacl_moe.torch as pmt

tokens, hidden, ffn, experts, top_k = 64, 32, 48, 4, 2
torch.manual_seed(0)
params = {
    "gate": (torch.randn(hidden, experts) * 0.3).requires_grad_(),
    "w1": (torch.randn(experts, hidden, ffn) * hidden ** -0.5).requires_grad_(),
    "w2": (torch.randn(experts, ffn, hidden) * ffn ** -0.5).requires_grad_(),
}
x = torch.randn(tokens, hidden, requires_grad=True)
target = torch.randn(tokens, hidden)


def gate(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts ([N, K] int32, as the op takes them) and their weights."""
    scores = torch.softmax(x @ params["gate"], dim=-1)
    weights, ids = scores.topk(top_k, dim=-1)
    return ids.to(torch.int32), weights / weights.sum(-1, keepdim=True)


def ffn_of(e: int, rows: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.relu(rows @ params["w1"][e]) @ params["w2"][e]
    return out


def moe_layer_routed(x: torch.Tensor) -> torch.Tensor:
    ids, weights = gate(x)
    r = pmt.moe_init_routing_v2(x, ids, expert_num=experts, expert_tokens_count_or_cumsum_flag=2)
    counts = r.expert_tokens_count_or_cumsum
    assert counts is not None  # asked for with the count flag
    # expanded_x holds the tokens' copies in expert order: one contiguous block per expert.
    blocks = r.expanded_x.split_with_sizes(counts.tolist())
    y = torch.cat([ffn_of(e, rows) for e, rows in enumerate(blocks)])
    # Slot i*K + t (token i's t-th expert) is row expanded_row_idx[i*K + t] of y.
    y = y[r.expanded_row_idx.long()].view(tokens, top_k, hidden)
    return (y * weights.unsqueeze(-1)).sum(1)


def moe_layer_plain(x: torch.Tensor) -> torch.Tensor:
    ids, weights = gate(x)
    rows = []
    for i in range(tokens):
        row = weights[i, 0] * ffn_of(int(ids[i, 0]), x[i:i + 1])
        for t in range(1, top_k):
            row = row + weights[i, t] * ffn_of(int(ids[i, t]), x[i:i + 1])
        rows.append(row)
    return torch.cat(rows)


Layer = Callable[[torch.Tensor], torch.Tensor]


def training_step(layer: Layer, lr: float = 0.1) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss, the gradients of x and of every parameter, and the weights one SGD step
    gives (computed, not applied: both layers start from the same weights)."""
    for t in (x, *params.values()):
        t.grad = None
    loss = torch.nn.functional.mse_loss(layer(x), target)
    torch.autograd.backward(loss)
    grads = {"x": x.grad.clone()}  # type: ignore[union-attr]  # set by the backward
    grads.update({name: p.grad.clone() for name, p in params.items()})
    with torch.no_grad():
        after = {name: p - lr * grads[name] for name, p in params.items()}
    grads.update({f"{name} after the step": v for name, v in after.items()})
    return loss.item(), grads


loss_routed, grads_routed = training_step(moe_layer_routed)
loss_plain, grads_plain = training_step(moe_layer_plain)
print(f"loss: routed {loss_routed:.6f}, plain loop {loss_plain:.6f}")
worst = max(float((grads_routed[k] - grads_plain[k]).abs().max()) for k in grads_plain)
assert abs(loss_routed - loss_plain) < 1e-5 and worst < 1e-5, (loss_routed, loss_plain, worst)
print(f"moe layer training step: loss and gradients match the plain PyTorch loop (max difference {worst:.1e})")
print("CANN", pm.cann_version().toolkit_version, "at", pm.library_info().op_library)
