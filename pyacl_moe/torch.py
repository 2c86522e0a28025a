"""The routing pair as torch operators: the forward differentiable in ``x``, its backward
aclnnMoeInitRoutingV2Grad.

Imported only when asked for (``import pyacl_moe.torch`` or ``pm.torch``): torch stays an
optional dependency of the package. Two operators, registered with ``torch.library`` under the
``pyacl_moe`` namespace, each with a fake implementation (so that ``torch.compile`` traces
through them) and a derivative::

    import pyacl_moe.torch as pmt
    r = pmt.moe_init_routing_v2(x, expert_idx, expert_num=E)        # torch tensors
    loss = (r.expanded_x * w).sum()
    loss.backward()            # x.grad by aclnnMoeInitRoutingV2Grad on grad(expanded_x)

    grad_x = pmt.moe_init_routing_v2_grad(g, expanded_row_idx, top_k)   # the backward alone

Where they run follows the tensors: CPU tensors through the host path (copy in, run on the
device, copy out: CANN on an Ascend host, the emulator elsewhere), torch_npu tensors in place,
on torch_npu's current stream, in order with torch's own kernels (``pm.from_torch``,
``pm.Stream.from_handle``), the outputs allocated by torch on the tensors' device.

The derivative of the forward in ``x`` is the backward op on the incoming gradient of
``expanded_x``, with the forward's ``expanded_row_idx`` and the scenario its attributes make
(dropless, active or drop/pad), in the gradient's dtype. The backward op has a derivative too
(a gather, in torch), so second derivatives go through.
"""

import threading
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import _args, _contract
from .array import from_torch
from .device import chip as device_chip
from .errors import InvalidArgument
from .op.moe_init_routing_v2 import RoutingResult, output_shapes
from .op.moe_init_routing_v2 import moe_init_routing_v2 as _routing
from .op.moe_init_routing_v2_grad import moe_init_routing_v2_grad as _routing_grad
from .stream import Stream

__all__ = ["RoutingTensors", "moe_init_routing_v2", "moe_init_routing_v2_grad"]

if not hasattr(torch.library, "custom_op") or not hasattr(torch.library, "register_autograd"):
    raise ImportError(f"pyacl_moe.torch needs torch 2.4 or later (torch.library.custom_op and register_autograd); "
                      f"this is torch {torch.__version__}")


class RoutingTensors(NamedTuple):
    """The forward's outputs as torch tensors, the fields of :class:`pyacl_moe.RoutingResult`
    (the two optional ones None unless the scenario switches them on)."""

    expanded_x: Tensor
    expanded_row_idx: Tensor
    expert_tokens_count_or_cumsum: Optional[Tensor]
    expert_tokens_before_capacity: Optional[Tensor]


# The borrowed wrappers of torch_npu's streams, one per (device, aclrtStream): a wrapper holds
# the stream's workspace and executor cache, and one that died would be closed, which waits
# for its stream; so each is made once and kept. torch_npu takes its streams from a fixed pool
# per device, which bounds the dict. Guarded by _streams_lock.
_streams: dict[tuple[int, int], Stream] = {}
_streams_lock = threading.Lock()


def _npu_stream(t: Tensor) -> Stream:
    """torch_npu's current stream on ``t``'s device, borrowed: the op queues where torch's
    kernels are, so nothing has to synchronize in between."""
    import torch_npu  # type: ignore[import-not-found]  # present: the tensor is on an NPU

    index = t.device.index if t.device.index is not None else torch_npu.npu.current_device()
    key = (int(index), int(torch_npu.npu.current_stream(index).npu_stream))
    with _streams_lock:
        stream = _streams.get(key)
    if stream is None or stream.closed:
        made = Stream.from_handle(key[1], device=key[0])  # outside the lock: it may reach CANN
        with _streams_lock:
            stream = _streams.setdefault(key, made)
            if stream.closed:
                stream = _streams[key] = made
    return stream


def _on_npu(t: Tensor) -> bool:
    return t.device.type == "npu"


# A custom op's schema has no optional outputs: an output the scenario does not write is an
# empty int32 tensor inside the operator and None outside it.
def _absent(like: Tensor) -> Tensor:
    return like.new_empty((0,), dtype=torch.int32)


def _new(like: Tensor, shape: Optional[tuple[int, ...]], dtype: torch.dtype) -> Tensor:
    return _absent(like) if shape is None else like.new_empty(shape, dtype=dtype)


def _routing_outputs(x: Tensor, expert_idx: Tensor,
                     attrs: tuple[int, int, int, int, int, bool]) -> tuple[list[Tensor], RoutingResult]:
    """New outputs for the forward (an empty int32 tensor where none is written), and their shapes."""
    shapes = output_shapes(tuple(x.shape), tuple(expert_idx.shape), *attrs)
    return [_new(x, shape, x.dtype if name == "expanded_x" else torch.int32)
            for name, shape in zip(RoutingResult._fields, shapes)], shapes


_INT32 = (-(2**31), 2**31 - 1)


def _ids_the_op_takes(expert_idx: Tensor) -> Tensor:
    """``expert_idx`` as the chip's op takes it: int64 ids (what ``torch.topk`` returns) as they
    are where the forward takes int64 (the Ascend950), else checked to fit int32 and converted,
    once; anything else as it is, for the op's own checks to name. Inside the operator, on real
    tensors: the range check reads their values, which a traced (fake) tensor has not."""
    if expert_idx.dtype != torch.int64 or device_chip().forward_relaxed:
        return expert_idx
    if expert_idx.numel():
        low, high = int(expert_idx.min()), int(expert_idx.max())
        if low < _INT32[0] or high > _INT32[1]:
            c = device_chip()
            bad = high if high > _INT32[1] else low
            raise InvalidArgument("expert_idx", f"int64 ids must fit in int32 on {c.soc} ({c.family}), whose op "
                                                f"takes int32 (they are converted once), got {bad}")
    return expert_idx.to(torch.int32)


@torch.library.custom_op("pyacl_moe::moe_init_routing_v2", mutates_args=())
def _forward_op(x: Tensor, expert_idx: Tensor, active_num: int, expert_capacity: int, expert_num: int,
                drop_pad_mode: int, expert_tokens_count_or_cumsum_flag: int,
                expert_tokens_before_capacity_flag: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    attrs = (active_num, expert_capacity, expert_num, drop_pad_mode, expert_tokens_count_or_cumsum_flag,
             expert_tokens_before_capacity_flag)
    expert_idx = _ids_the_op_takes(expert_idx)
    if _on_npu(x):
        outs, shapes = _routing_outputs(x, expert_idx, attrs)
        given = RoutingResult(*(None if shape is None else from_torch(o) for o, shape in zip(outs, shapes)))
        _routing(from_torch(x), from_torch(expert_idx), *attrs, out=given, stream=_npu_stream(x))
        return outs[0], outs[1], outs[2], outs[3]
    r = _routing(x, expert_idx, *attrs)  # CPU tensors: the host path gives CPU tensors back
    a, b = r.expert_tokens_count_or_cumsum, r.expert_tokens_before_capacity
    return (r.expanded_x, r.expanded_row_idx, _absent(x) if a is None else a, _absent(x) if b is None else b)


@_forward_op.register_fake
def _forward_fake(x: Tensor, expert_idx: Tensor, active_num: int, expert_capacity: int, expert_num: int,
                  drop_pad_mode: int, expert_tokens_count_or_cumsum_flag: int,
                  expert_tokens_before_capacity_flag: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    outs, _ = _routing_outputs(x, expert_idx, (active_num, expert_capacity, expert_num, drop_pad_mode,
                                            expert_tokens_count_or_cumsum_flag, expert_tokens_before_capacity_flag))
    return outs[0], outs[1], outs[2], outs[3]


def _grad_attrs(expert_idx_shape: tuple[int, ...], active_num: int, drop_pad_mode: int) -> tuple[int, int, int]:
    """(top_k, drop_pad_mode, active_num) of the backward for a forward with these: its
    active_num is the forward's rows (min(active_num, N*K)), and 0 in drop/pad mode."""
    n, k = expert_idx_shape
    return k, drop_pad_mode, 0 if drop_pad_mode == 1 or active_num <= 0 else min(active_num, n * k)


def _forward_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[object, ...],
                   output: tuple[Tensor, ...]) -> None:
    expert_idx, active_num, drop_pad_mode = inputs[1], inputs[2], inputs[5]
    assert isinstance(expert_idx, Tensor) and isinstance(active_num, int) and isinstance(drop_pad_mode, int)
    ctx.save_for_backward(output[1])
    ctx.grad_attrs = _grad_attrs(tuple(expert_idx.shape), active_num, drop_pad_mode)  # type: ignore[attr-defined]


def _forward_backward(ctx: torch.autograd.function.FunctionCtx, grad_expanded_x: Optional[Tensor],
                      *unused: object) -> tuple[Optional[Tensor], ...]:
    none = (None,) * 7  # expert_idx and the attributes have no gradient
    if grad_expanded_x is None:  # expanded_x took no part in the loss
        return (None, *none)
    (expanded_row_idx,) = ctx.saved_tensors  # type: ignore[attr-defined]
    grad_x = _grad_op(grad_expanded_x.contiguous(), expanded_row_idx, *ctx.grad_attrs)  # type: ignore[attr-defined]
    return (grad_x, *none)


_forward_op.register_autograd(_forward_backward, setup_context=_forward_setup)


@torch.library.custom_op("pyacl_moe::moe_init_routing_v2_grad", mutates_args=())
def _grad_op(grad_expanded_x: Tensor, expanded_row_idx: Tensor, top_k: int, drop_pad_mode: int,
             active_num: int) -> Tensor:
    if _on_npu(grad_expanded_x):
        out = _new_grad_x(grad_expanded_x, expanded_row_idx, top_k)
        _routing_grad(from_torch(grad_expanded_x), from_torch(expanded_row_idx), top_k, drop_pad_mode, active_num,
                      out=from_torch(out), stream=_npu_stream(grad_expanded_x))
        return out
    out = _routing_grad(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num)
    assert isinstance(out, Tensor)
    return out


def _new_grad_x(grad_expanded_x: Tensor, expanded_row_idx: Tensor, top_k: int) -> Tensor:
    """A new [N, H] result, N = len(expanded_row_idx) / top_k."""
    return grad_expanded_x.new_empty((expanded_row_idx.shape[0] // top_k, grad_expanded_x.shape[-1]))


@_grad_op.register_fake
def _grad_fake(grad_expanded_x: Tensor, expanded_row_idx: Tensor, top_k: int, drop_pad_mode: int,
               active_num: int) -> Tensor:
    return _new_grad_x(grad_expanded_x, expanded_row_idx, top_k)


def _grad_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[object, ...], output: Tensor) -> None:
    grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num = inputs
    assert isinstance(grad_expanded_x, Tensor) and isinstance(expanded_row_idx, Tensor)
    ctx.save_for_backward(expanded_row_idx)
    ctx.attrs = (top_k, drop_pad_mode, active_num, tuple(grad_expanded_x.shape))  # type: ignore[attr-defined]


def _grad_backward(ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
    # out[i] sums rows idx[i*K + t] of the input: the input's gradient gathers grad_out back
    # to those rows (added up where a row is named twice, outside the documented contract).
    # A skipped slot is sent to one spare row past the end, cut off after: no data-dependent
    # shape, so torch.compile traces it.
    (idx,) = ctx.saved_tensors  # type: ignore[attr-defined]
    top_k, drop_pad_mode, active_num, shape = ctx.attrs  # type: ignore[attr-defined]
    rows = 1
    for d in shape[:-1]:
        rows *= d
    idx = idx.long()
    if drop_pad_mode == 1:
        keep = idx >= 0
    elif active_num > 0:
        keep = idx < active_num
    else:
        keep = torch.ones_like(idx, dtype=torch.bool)
    target = torch.where(keep, idx, torch.full_like(idx, rows))
    token = torch.arange(idx.shape[0], device=idx.device) // top_k
    grad = grad_out.new_zeros((rows + 1, shape[-1])).index_add_(0, target, grad_out.index_select(0, token))
    return grad[:rows].reshape(shape), None, None, None, None


_grad_op.register_autograd(_grad_backward, setup_context=_grad_setup)


def moe_init_routing_v2(x: Tensor, expert_idx: Tensor, active_num: int = 0, expert_capacity: int = 0,
                        expert_num: int = 0, drop_pad_mode: int = 0, expert_tokens_count_or_cumsum_flag: int = 0,
                        expert_tokens_before_capacity_flag: bool = False) -> RoutingTensors:
    """:func:`pyacl_moe.moe_init_routing_v2` on torch tensors (CPU or torch_npu), the same
    parameters and result fields, differentiable in ``x``: the gradient of ``expanded_x``
    flows back to ``x`` through aclnnMoeInitRoutingV2Grad. The contract is checked as the
    NumPy function checks it, and refused with :class:`pyacl_moe.InvalidArgument`, except
    that int64 ``expert_idx`` (what ``torch.topk`` returns) is taken on every chip: where the
    op takes only int32 the ids are checked to fit and converted, once."""
    _args.instance("x", x, Tensor, "a torch tensor")
    _args.instance("expert_idx", expert_idx, Tensor, "a torch tensor")
    attrs = (_args.int64("active_num", active_num), _args.int64("expert_capacity", expert_capacity),
             _args.int64("expert_num", expert_num), _args.int64("drop_pad_mode", drop_pad_mode),
             _args.int64("expert_tokens_count_or_cumsum_flag", expert_tokens_count_or_cumsum_flag),
             _args.boolean("expert_tokens_before_capacity_flag", expert_tokens_before_capacity_flag))
    outs = _forward_op(x, expert_idx, *attrs)
    written = output_shapes(tuple(x.shape), tuple(expert_idx.shape), *attrs)
    return RoutingTensors(outs[0], outs[1], outs[2] if written[2] is not None else None,
                          outs[3] if written[3] is not None else None)


def moe_init_routing_v2_grad(grad_expanded_x: Tensor, expanded_row_idx: Tensor, top_k: int, drop_pad_mode: int = 0,
                             active_num: int = 0) -> Tensor:
    """:func:`pyacl_moe.moe_init_routing_v2_grad` as a torch operator (CPU or torch_npu
    tensors), for routings made by something else: ``[N, H]`` in the gradient's dtype,
    itself differentiable in ``grad_expanded_x``."""
    _args.instance("grad_expanded_x", grad_expanded_x, Tensor, "a torch tensor")
    _args.instance("expanded_row_idx", expanded_row_idx, Tensor, "a torch tensor")
    top_k, drop_pad_mode, active_num = _contract.check_attributes(top_k, drop_pad_mode, active_num)
    return _grad_op(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode,  # type: ignore[no-any-return]
                    active_num)
