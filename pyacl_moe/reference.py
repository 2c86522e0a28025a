"""The golden reference: aclnnMoeInitRoutingV2Grad in NumPy.

``gradX[i] = sum over t < top_k of grad_expanded_x[expanded_row_idx[i*top_k + t]]``, skipping
-1 in drop/pad mode and indices >= active_num in active mode; accumulated in float32 and
rounded once to the output dtype (round to nearest even), as the device kernel does.

It works through the tokens in chunks, so its extra memory stays bounded (about 64 MiB)
whatever the input size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _validate
from .errors import InvalidArgument

__all__ = ["moe_init_routing_v2_grad"]

# Float32 working set per chunk: the accumulator plus one gathered term.
_CHUNK_BYTES = 16 * 1024 * 1024


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
    x = np.asarray(grad_expanded_x)
    idx = np.asarray(expanded_row_idx)
    if validate:
        geo = _validate.check_shapes(
            x.shape, x.dtype, idx.shape, idx.dtype, top_k, drop_pad_mode, active_num,
            None if out is None else out.shape, None if out is None else out.dtype,
        )
        _validate.check_indices(idx, geo, int(top_k), int(active_num))
    else:
        geo = _validate.Geometry(
            idx.shape[0] // int(top_k), x.shape[-1],
            int(np.prod(x.shape[:-1])), _validate.scenario(int(drop_pad_mode), int(active_num)),
        )
    k = int(top_k)
    n, h = geo.tokens, geo.hidden
    if out is None:
        out = np.empty((n, h), dtype=x.dtype)
    elif not out.flags.writeable:
        raise InvalidArgument("out", "must be writable")
    rows = x.reshape(geo.rows, h)
    ids = idx.reshape(n, k)
    droppad = geo.scenario == "drop-pad"
    active = int(active_num) if geo.scenario == "active" else 0
    chunk = max(1, _CHUNK_BYTES // (8 * h))
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        c = ids[start:stop]
        if droppad:
            skip = c == -1
        elif active:
            skip = c >= active
        else:
            skip = None
        safe = np.where(skip, 0, c) if skip is not None else c
        acc = np.zeros((stop - start, h), dtype=np.float32)
        term = np.empty_like(acc)
        for t in range(k):
            np.copyto(term, rows[safe[:, t]], casting="unsafe")
            if skip is not None and skip[:, t].any():
                term[skip[:, t]] = 0.0
            acc += term
        out[start:stop] = acc.astype(out.dtype)
    return out
