"""The golden reference: aclnnMoeInitRoutingV2Grad in NumPy, a bit-exact model of the vendor's
device kernel.

``gradX[i] = sum over t < top_k of grad_expanded_x[expanded_row_idx[i*top_k + t]]``, skipping
-1 in drop/pad mode and indices >= active_num in active mode. The terms are widened to
float32 exactly, added in float32 in the kernel's own order, and the sum is rounded once to
the output dtype, to nearest even. With the kernel's order the result is the device's bit
for bit (NaN bits aside, below; subnormals are kept, as IEEE has them), not merely close to it.

NaN: every NaN of the result is the positive canonical quiet NaN of the output dtype (float32
0x7FC00000, float16 0x7E00, bfloat16 0x7FC0), whatever the signs and payloads of the NaN
terms: the emulator's rule (docs/emulator.md, "NaN results"), which this model shares bit for
bit. The device's own NaN bits are not known (unverified), which is why conformance lets any NaN
match any NaN.

The kernel's order, as read from the vendor's source (github:repo-mirror-test/ops-transformer,
moe/moe_init_routing_v2_grad/op_host/moe_init_routing_v2_grad_tiling.cpp for the buffer count,
op_kernel/moe_init_routing_v2_grad_with_dropless.h, _with_activate.h and
_with_pos_drop_and_pad_zero.h for the steps, op_kernel/moe_init_routing_v2_grad_base.h for the
casts). For one token, with terms x[0..K-1] in index order (t is the position within the
token's K slots, not the row it names):

- Buffer count. ``B = 2**e`` float32 partial buffers with ``e = max(0, floor(log2 K) - 1)``
  for K < 128, and ``B = 64`` (e = 6) from K = 128 on: K = 1..3 -> 1, 4..7 -> 2, 8..15 -> 4,
  16..31 -> 8, 32..63 -> 16, 64..127 -> 32. B never exceeds ceil(K/2), so every buffer is
  filled in the first step.
- Term t belongs to buffer ``(t // 2) % B``: pairs of neighbouring slots share a buffer, and
  the pairs go round the buffers.
- Step 1: buffer b is set to x[2b] (a copy, no addition), for b < B.
- Step 2: the remaining even slots, t = 2B, 2B+2, ... in increasing order, are added to their
  buffer.
- Step 3: the odd slots, t = 1, 3, 5, ... in increasing order, are added to their buffer.
  So in each buffer every even term comes before every odd one.
- Step 4: a pairwise tree over the buffers, e levels: at stride s = 1, 2, 4, ..., B/2,
  buffer j - s += buffer j for j = s, 3s, 5s, ... < B. Buffer 0 holds the sum.
- One rounding: float16 and bfloat16 results are cast from float32 with round to nearest
  even (the kernel's CAST_RINT); float32 results are stored as they are. Inputs are widened
  to float32 exactly (CAST_NONE) before any addition.
- Skipped terms (-1 in drop/pad mode, index >= activeNum in active mode): a skipped slot of
  step 1 sets its buffer to +0.0; a skipped slot of steps 2 and 3 adds nothing, which is not
  the same as adding +0.0 (-0.0 + +0.0 is +0.0). A token whose every slot is skipped gives
  +0.0. Nothing else is skipped: a negative index in active mode, or any index below -1 in
  drop/pad mode, is read by the kernel from outside the input (validation refuses them here;
  with ``validate=False`` a negative index counts from the end, and one beyond the rows
  raises IndexError).

The split of the hidden dimension into copies that fit the kernel's local buffer, the split
of tokens across cores and the token groups do not change any element's order, so the model
needs none of them. This is the kernel for Atlas A2 and A3 (Ascend910B, Ascend910_93).

**The Ascend950's kernel** (``chip=``; ops-transformer op_kernel/arch35/, from v9.0.0-beta.2)
is modelled as well, bit for bit: per element a float32 sum from +0.0; the terms in chunks
(below), and in each chunk every four consecutive terms added as ``acc + ((t0 + t1) + (t2 +
t3))`` (arch35/moe_init_routing_v2_grad_base.h:204-377, SequenceReduceSum), then the one to
three left one by one; the float32 sum carried exactly from chunk to chunk; one rounding to
nearest even at the end (CAST_RINT). A term the kernel reads as a zero row (the scenario's
marks, and from v9.1.0.pre every index outside the rows but one past them in drop/pad mode:
base.h:65-75) is a +0.0 in its place: the fours stay where they are. The chunks: all K terms
at once when the tiling picks its split-H template (K <= 64, N below the vector cores and
below H/512/dtype bytes: op_host/moe_init_routing_v2_grad_split_h_tiling_arch35.cpp:49-58) or
its full-load one ((2K+1) rows of H fit in the UB, else K <= 10:
..._full_load_tiling_arch35.cpp:104-137); else its general template's kUbFactor terms at a
time, ``(UB - (bytes+4)*Ha) // (2*bytes*Ha)`` (or 1) with Ha = H rounded up to 32 bytes
(..._tiling_arch35.cpp:100-129). So the 950's bits depend on its UB size, which
:class:`pyacl_moe._contract.Chip` carries.

The model works through tiles of tokens (and of columns when one token's buffers would not
fit), so its extra memory stays small whatever the input size.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import ml_dtypes
import numpy as np

from . import _args, _contract
from ._contract import Chip, chip_named
from .errors import InvalidArgument

__all__ = ["moe_init_routing_v2", "moe_init_routing_v2_grad"]

# Tiles of tokens (and columns) are sized so that their working set (the float32 buffers and
# the gathered rows) stays around 2 MiB, within a core's L2 and its share of L3: main memory
# then sees the input once and the output once, like a copy, and the extra memory is small
# whatever the input size. Smaller tiles pay NumPy's per-call cost too often.
_WORKING_SET_BYTES = 2 * 1024 * 1024

_BF16 = np.dtype(ml_dtypes.bfloat16)

# The NaN every NaN sum becomes before the rounding (the module's NaN rule). Its narrowing is
# the other types' canonical NaN, 0x7E00 and 0x7FC0: the casts keep a NaN's top mantissa bits.
_NAN32 = np.array(0x7FC00000, np.uint32).view(np.float32)

# The vendor's tiling: below this K the buffer count follows K; from it on it is fixed.
_K_FIXED_BUFFERS = 128
_MAX_BUFFERS = 64


def _buffer_count(k: int) -> int:
    """The kernel's number of float32 partial buffers for ``k`` terms (a power of two)."""
    if k >= _K_FIXED_BUFFERS:
        return _MAX_BUFFERS
    return 1 << max(0, k.bit_length() - 2)  # 2 ** (floor(log2 k) - 1), at least 1


@lru_cache(maxsize=64)
def _schedule(k: int) -> tuple[int, tuple[tuple[np.ndarray, bool], ...]]:
    """(B, rounds): each round is (slot positions, first) and touches buffers 0..len-1 at
    once. One buffer's additions happen in the order of the rounds, which is the kernel's
    order for that buffer; different buffers never mix before the tree, so doing a round's
    buffers together changes nothing."""
    b = _buffer_count(k)
    pairs = (k + 1) // 2  # slots 2m, one per pair m
    odd = k // 2  # slots 2m+1
    rounds: list[tuple[np.ndarray, bool]] = [(2 * np.arange(b), True)]
    rounds += [(2 * np.arange(m, min(m + b, pairs)), False) for m in range(b, pairs, b)]
    rounds += [(2 * np.arange(m, min(m + b, odd)) + 1, False) for m in range(0, odd, b)]
    return b, tuple(rounds)


def moe_init_routing_v2_grad(
    grad_expanded_x: Any,
    expanded_row_idx: Any,
    top_k: int,
    drop_pad_mode: int = 0,
    active_num: int = 0,
    *,
    out: np.ndarray | None = None,
    validate: bool = True,
    chip: Chip | str | None = None,
) -> np.ndarray:
    """Reference result for the op, as a NumPy array of shape (N, H).

    Same arguments as :func:`pyacl_moe.moe_init_routing_v2_grad` (NumPy arrays only).
    ``validate`` checks the contract, index values included, and raises InvalidArgument.
    ``chip``: whose kernel to model, a :class:`~pyacl_moe._contract.Chip` or a SoC or family name
    (its newest rules); None is the 910B's.
    """
    chip = _chip(chip)
    x = _contract.native(np.asarray(grad_expanded_x))
    idx = _contract.native(np.asarray(expanded_row_idx))
    if validate:
        geo = _contract.check_shapes(
            x.shape, x.dtype, idx.shape, idx.dtype, top_k, drop_pad_mode, active_num,
            None if out is None else out.shape, None if out is None else out.dtype,
        )
        _contract.check_indices(idx, geo, int(top_k), int(active_num), chip)
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
    if chip.summation in ("quads", "sequential"):
        zero = _contract.zero_rows(ids, geo, k, int(active_num), chip)
        if zero is not None:
            ids = np.where(zero, 0, ids)
        if not geo.rows:  # every slot a zero row (or outside an empty input)
            out[...] = 0
            return out
        if not validate and ids.size:
            _in_bounds(ids, geo.rows)
        with np.errstate(over="ignore", invalid="ignore"):
            chunk = 1 if chip.summation == "sequential" else arch35_tiling(chip, n, k, h, x.dtype.itemsize)[2]
            _quads(rows, ids, zero, out, k, chunk)
        return out
    if geo.scenario == "drop-pad":
        skip_all = ids == -1
    elif geo.scenario == "active":
        skip_all = ids >= int(active_num)
    else:
        skip_all = None
    if skip_all is not None and not skip_all.any():
        skip_all = None
    if skip_all is not None:
        ids = np.where(skip_all, 0, ids)  # any valid row; the term is replaced below
    if geo.rows == 0:  # every slot skipped: each buffer starts at +0.0 and nothing is added
        out[...] = 0
        return out
    if not validate and ids.size:
        _in_bounds(ids, geo.rows)

    is_bf16 = rows.dtype == _BF16
    # bfloat16 rows are gathered as their bits, then widened to float32 without rounding.
    src = rows.view(np.uint16) if is_bf16 else rows
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN are values here, as on the device
        _accumulate(src, ids, skip_all, out, k, is_bf16)
    return out


def _chip(chip: Chip | str | None) -> Chip:
    if chip is None or isinstance(chip, Chip):
        return chip or _A2
    if not isinstance(chip, str):
        raise InvalidArgument("chip", f"must be a Chip, a SoC or family name, or None, got {type(chip).__name__}")
    return chip_named(chip)


_A2 = chip_named(None)


def _in_bounds(ids: np.ndarray, rows: int) -> None:
    # The gathers use mode="wrap", which takes no copy of its output but would wrap an index
    # that NumPy's indexing refuses; refuse those here, as np.take would.
    lo, hi = int(ids.min()), int(ids.max())
    if lo < -rows or hi >= rows:
        bad = lo if lo < -rows else hi
        raise IndexError(f"index {bad} is out of bounds for axis 0 with size {rows}")


ARCH35_TEMPLATES = {"split-h": 20000, "full-load": 30000, "general": 40000}


def arch35_tiling(chip: Chip, n: int, k: int, h: int, itemsize: int,
                  scenario: str = "dropless") -> tuple[str, int, int]:
    """The Ascend950's tiling of the backward (see the module docstring): the template its
    registry picks, the tiling key (op_kernel/moe_init_routing_v2_grad_apt.cpp:22-30: the
    template's number * 10 + 1 dropless, 2 drop/pad, 3 active) and how many of a token's K terms
    one pass sums (K, or the general template's kUbFactor, which the UB size sets)."""
    ts, ub = itemsize, chip.ub_bytes
    key = {"dropless": 1, "drop-pad": 2, "active": 3}[scenario]
    if k <= 64 and n < chip.vector_cores and n < (h // 512) // ts:
        template, chunk = "split-h", k  # split_h_tiling_arch35.cpp:49-58
    else:
        h_align = -(-(h * ts) // 32) * 32 // ts
        if (2 * k + 1) * ts * h_align <= ub or k <= 10:
            template, chunk = "full-load", k  # full_load_tiling_arch35.cpp:104-137 (H split when K <= 10)
        elif (3 * ts + 4) * h_align <= ub:
            template, chunk = "general", min((ub - (ts + 4) * h_align) // (2 * ts * h_align), 65535)
        else:
            template, chunk = "general", 1  # tiling_arch35.cpp:100-129: H split, one term a pass
    return template, ARCH35_TEMPLATES[template] * 10 + key, chunk


def _term(tile: tuple[Any, ...], t: int) -> np.ndarray:
    """Term t of a tile's tokens, widened to float32 exactly; a zero row +0.0."""
    part, ids, zero, values = tile
    g = np.take(part, ids[:, t], axis=0, mode="wrap").view(values).astype(np.float32)
    if zero is not None and zero[:, t].any():
        g[zero[:, t]] = 0.0
    return g  # type: ignore[no-any-return]


def _quads(rows: np.ndarray, ids: np.ndarray, zero: np.ndarray | None, out: np.ndarray, k: int, chunk: int) -> None:
    """The Ascend950's sum (module docstring), tile by tile of tokens and columns."""
    n, h = out.shape
    is_bf16 = rows.dtype == _BF16
    src = rows.view(np.uint16) if is_bf16 else rows
    values = _BF16 if is_bf16 else src.dtype
    cols = max(1, min(h, _WORKING_SET_BYTES // (6 * 4)))
    tokens = max(1, min(n, _WORKING_SET_BYTES // (6 * 4 * cols)))
    for c0 in range(0, h, cols):
        c1 = min(h, c0 + cols)
        part = src if (c0, c1) == (0, h) else src[:, c0:c1]
        for t0 in range(0, n, tokens):
            t1 = min(n, t0 + tokens)
            tile = (part, ids[t0:t1], None if zero is None else zero[t0:t1], values)
            acc = np.zeros((t1 - t0, c1 - c0), np.float32)
            for k0 in range(0, k, chunk):
                length, j = min(chunk, k - k0), 0
                while j + 3 < length:
                    a = _term(tile, k0 + j) + _term(tile, k0 + j + 1)
                    b = _term(tile, k0 + j + 2) + _term(tile, k0 + j + 3)
                    acc += a + b
                    j += 4
                while j < length:
                    acc += _term(tile, k0 + j)
                    j += 1
            nan = np.isnan(acc)
            if nan.any():
                acc[nan] = _NAN32
            out[t0:t1, c0:c1] = acc


def _accumulate(src: np.ndarray, ids: np.ndarray, skip_all: np.ndarray | None, out: np.ndarray,
                k: int, is_bf16: bool) -> None:
    n, h = out.shape
    b, rounds = _schedule(k)
    values = _BF16 if is_bf16 else src.dtype  # what the gathered bits mean
    widen = values != np.float32
    # A term that adds nothing, not even to the sign of a zero: -0.0, as the gathered bits.
    nothing = np.array(-0.0, np.float32).astype(values).view(src.dtype)
    # Per element of a token's row: b float32 buffers and up to b gathered terms.
    per_element = b * (4 + src.dtype.itemsize)
    cols = max(1, min(h, _WORKING_SET_BYTES // per_element))
    tokens = max(1, min(n, _WORKING_SET_BYTES // (per_element * cols)))
    tiles: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    for c0 in range(0, h, cols):
        c1 = min(h, c0 + cols)
        part = src if (c0, c1) == (0, h) else src[:, c0:c1]
        for t0 in range(0, n, tokens):
            t1 = min(n, t0 + tokens)
            shape = (t1 - t0, c1 - c0)
            if shape not in tiles:  # the full tile, and at most a few smaller ones at the edges
                tiles[shape] = (np.empty((b, *shape), np.float32), np.empty((b, *shape), src.dtype))
            acc, gathered = tiles[shape]
            tile_ids = ids[t0:t1]
            tile_skip = None if skip_all is None else skip_all[t0:t1]
            for slots, first in rounds:
                nb = slots.size
                sel = tile_ids[:, slots].T  # (nb, tokens): buffer j of the round, token i
                skip = None if tile_skip is None else tile_skip[:, slots].T
                if skip is not None and not skip.any():
                    skip = None
                # mode="wrap" writes straight into the buffer ("raise" gathers into a temporary
                # and copies it, half again the time); every index is known to be in range.
                if first and not widen:
                    np.take(part, sel, axis=0, out=acc[:nb], mode="wrap")
                else:
                    g = gathered[:nb]
                    np.take(part, sel, axis=0, out=g, mode="wrap")
                if first:
                    if widen:
                        # ml_dtypes widens bfloat16 by moving the bits (exact for all 65536
                        # patterns, NaN payloads included: tests/test_reference.py checks it).
                        np.copyto(acc[:nb], g.view(values), casting="unsafe")
                    if skip is not None:
                        acc[:nb][skip] = 0.0  # what the kernel writes for a skipped first slot
                else:
                    if skip is not None:
                        g[skip] = nothing  # the kernel adds nothing for a skipped slot
                    # Widened inside the addition (exactly, in NumPy's small cast buffers):
                    # no float32 copy of the terms goes through memory.
                    np.add(acc[:nb], g.view(values), out=acc[:nb], dtype=np.float32)
            stride = 1
            while stride < b:
                step = 2 * stride
                np.add(acc[0:b:step], acc[stride:b:step], out=acc[0:b:step])
                stride = step
            # Which sums are NaN does not depend on the order of the additions, but their sign
            # and payload do (NumPy's loops, like the host's compiler, pick the operand order):
            # the rule replaces them all.
            nan = np.isnan(acc[0])
            if nan.any():
                acc[0][nan] = _NAN32
            out[t0:t1, c0:c1] = acc[0]  # the one rounding to the output dtype (nearest even)


# ---------------------------------------------------------------------------- the forward op

def moe_init_routing_v2(
    x: Any,
    expert_idx: Any,
    active_num: int = 0,
    expert_capacity: int = 0,
    expert_num: int = 0,
    drop_pad_mode: int = 0,
    expert_tokens_count_or_cumsum_flag: int = 0,
    expert_tokens_before_capacity_flag: bool = False,
    *,
    chip: Chip | str | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """aclnnMoeInitRoutingV2 (MoE token routing, forward) in NumPy: (expanded_x,
    expanded_row_idx, expert_tokens_count_or_cumsum or None, expert_tokens_before_capacity or
    None), as the vendor documents them (github:repo-mirror-test/ops-transformer,
    moe/moe_init_routing_v2/docs and op_kernel).

    The N*K slots (token i's t-th expert at flattened position i*K + t) are sorted by expert id;
    equal ids keep the order of their positions, as the vendor's sort does.
    ``expanded_row_idx[p]`` is where slot p went. Dropless/active (mode 0): row j of
    expanded_x is x[token of the j-th sorted slot], for the first N*K rows (activeNum 0) or the
    first min(activeNum, N*K). Drop/pad (mode 1): expert e keeps its first expert_capacity
    slots at [e, rank], the others get -1, and rows nobody fills are zero. The count output
    (mode 0, flag 1: cumulative sum, 2: count per expert) and the before-capacity output (mode
    1, flag set: count per expert before dropping) have expert_num entries. Rows are copied,
    never computed: the results are exact. ``chip``: whose rules (an Ascend950 takes INT64
    and 1-D ids, K = 1, and an active_num <= 0, N*K + active_num rows); None is the 910B's.
    """
    chip = _chip(chip)
    xs = _contract.native(np.asarray(x))
    ids = np.asarray(expert_idx)
    # The binding's own argument rules: "3" or 2.5 where an int belongs is refused, not converted.
    mode = _args.int64("drop_pad_mode", drop_pad_mode)
    flag = _args.int64("expert_tokens_count_or_cumsum_flag", expert_tokens_count_or_cumsum_flag)
    active, cap = _args.int64("active_num", active_num), _args.int64("expert_capacity", expert_capacity)
    num = _args.int64("expert_num", expert_num)
    before_flag = _args.boolean("expert_tokens_before_capacity_flag", expert_tokens_before_capacity_flag)
    _contract.check_routing(xs.shape, xs.dtype, ids.shape, ids.dtype, active, cap, num, mode, flag, chip)
    _contract.check_expert_ids(ids, num, mode, flag)
    n, k = ids.shape[0], _contract.top_k_of(ids.shape)
    h = xs.shape[1]
    total = n * k
    flat = ids.reshape(-1).astype(np.int64)
    counted = mode == 1 or flag != 0
    order = np.argsort(flat, kind="stable")  # equal ids keep the order of their positions
    row_idx = np.empty(total, np.int32)
    if mode == 0:
        rows = _contract.routing_outputs(n, k, h, xs.dtype, active, cap, num, mode, flag, False)["expanded_x"][0][0]
        row_idx[order] = np.arange(total, dtype=np.int32)
        expanded = np.take(xs, order[:rows] // k, axis=0) if h else np.zeros((rows, h), xs.dtype)
    else:
        sorted_ids = flat[order]
        rank = np.arange(total) - np.searchsorted(sorted_ids, sorted_ids, side="left")
        keep = rank < cap
        row_idx[order] = np.where(keep, sorted_ids * cap + rank, -1).astype(np.int32)
        expanded = np.zeros((num, cap, h), xs.dtype)
        expanded.reshape(num * cap, h)[sorted_ids[keep] * cap + rank[keep]] = xs[order[keep] // k]
    hist = np.bincount(flat, minlength=num)[:num].astype(np.int32) if counted and num else np.zeros(num, np.int32)
    count = None
    if mode == 0 and flag:
        count = np.cumsum(hist, dtype=np.int32) if flag == 1 else hist
    before = hist if mode == 1 and before_flag else None
    return expanded, row_idx, count, before
