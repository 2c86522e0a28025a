"""The golden reference: aclnnMoeInitRoutingV2Grad in NumPy.

``gradX[i] = sum over t < top_k of grad_expanded_x[expanded_row_idx[i*top_k + t]]``, skipping
-1 in drop/pad mode and indices >= active_num in active mode; accumulated in float32 and
rounded once to the output dtype (round to nearest even), as the device kernel does.

It works through the tokens in chunks, so its extra memory stays bounded (about 64 MiB)
whatever the input size.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from . import _contract
from .errors import InvalidArgument

__all__ = ["moe_init_routing_v2_grad"]

# Tokens are processed in chunks whose float32 working set (accumulator and one term) stays
# around 2 MiB, within a core's L2 and its share of L3: main memory then sees the input once
# and the output once, like a copy, and the extra memory is small whatever the input size.
# Smaller chunks pay NumPy's per-call cost too often (at 512 KiB and H=4096, 16 rows a chunk,
# the reference took 1.6 times as long on a 2-core EPYC).
_WORKING_SET_BYTES = 2 * 1024 * 1024

_BF16 = np.dtype(ml_dtypes.bfloat16)


def moe_init_routing_v2_grad(
    grad_expanded_x: Any,
    expanded_row_idx: Any,
    top_k: int,
    drop_pad_mode: int = 0,
    active_num: int = 0,
    *,
    out: np.ndarray | None = None,
    validate: bool = True,
) -> np.ndarray:
    """Reference result for the op, as a NumPy array of shape (N, H).

    Same arguments as :func:`pyacl_moe.moe_init_routing_v2_grad` (NumPy arrays only).
    ``validate`` checks the contract, index values included, and raises InvalidArgument.
    """
    x = _contract.native(np.asarray(grad_expanded_x))
    idx = _contract.native(np.asarray(expanded_row_idx))
    if validate:
        geo = _contract.check_shapes(
            x.shape, x.dtype, idx.shape, idx.dtype, top_k, drop_pad_mode, active_num,
            None if out is None else out.shape, None if out is None else out.dtype,
        )
        _contract.check_indices(idx, geo, int(top_k), int(active_num))
    else:
        geo = _contract.Geometry(
            idx.shape[0] // int(top_k), x.shape[-1],
            int(np.prod(x.shape[:-1])), _contract.scenario(int(drop_pad_mode), int(active_num)),
        )
    k = int(top_k)
    n, h = geo.tokens, geo.hidden
    if out is None:
        out = np.empty((n, h), dtype=x.dtype)
    elif not out.flags.writeable:
        raise InvalidArgument("out", "must be writable")
    rows = np.ascontiguousarray(x).reshape(geo.rows, h)
    ids = idx.reshape(n, k)
    if geo.scenario == "drop-pad":
        skip_all = ids == -1
    elif geo.scenario == "active":
        skip_all = ids >= int(active_num)
    else:
        skip_all = None
    if skip_all is not None and not skip_all.any():
        skip_all = None
    if skip_all is not None:
        ids = np.where(skip_all, 0, ids)  # any valid row; the term is zeroed below
    if geo.rows == 0:
        out[...] = 0
        return out

    chunk = max(1, min(n, _WORKING_SET_BYTES // (8 * h)))
    is_bf16 = rows.dtype == _BF16
    # bfloat16 rows are gathered as their bits, then widened to float32 without rounding.
    src = rows.view(np.uint16) if is_bf16 else rows
    with np.errstate(over="ignore"):  # sums beyond the dtype's range are inf, as on the device
        _accumulate(src, ids, skip_all, out, n, k, chunk, h, is_bf16)
    return out


def _accumulate(src: np.ndarray, ids: np.ndarray, skip_all: np.ndarray | None, out: np.ndarray,
                n: int, k: int, chunk: int, h: int, is_bf16: bool) -> None:
    gathered = np.empty((chunk, h), dtype=src.dtype)
    term = np.empty((chunk, h), dtype=np.float32)
    acc = np.empty((chunk, h), dtype=np.float32)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        c = stop - start
        g, tm, a = gathered[:c], term[:c], acc[:c]
        for t in range(k):
            np.take(src, ids[start:stop, t], axis=0, out=g)
            if is_bf16:
                # ml_dtypes widens by moving the bits (exact for all 65536 patterns, NaN
                # payloads included: tests/test_reference.py checks it), twice as fast here
                # as a shift into a uint32 view.
                np.copyto(tm, g.view(_BF16), casting="unsafe")
            elif src.dtype != np.float32:
                np.copyto(tm, g, casting="unsafe")
            else:
                tm = g
            if skip_all is not None:
                skip = skip_all[start:stop, t]
                if skip.any():
                    if tm is g:
                        tm = term[:c]
                        np.copyto(tm, g)
                    tm[skip] = 0.0
            if t == 0:
                np.copyto(a, tm)
            else:
                np.add(a, tm, out=a)
            tm = term[:c]
        out[start:stop] = a  # the one rounding to the output dtype (nearest even)
