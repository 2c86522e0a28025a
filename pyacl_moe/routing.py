"""Routing indices for the backward, from top-k expert ids.

The backward, :func:`~pyacl_moe.moe_init_routing_v2_grad`, takes the ``expanded_row_idx`` the
forward produced and the forward's scenario. The functions here give both, for each scenario, from
the top-k expert ids alone (``[N, K]`` int32, token i's t-th expert at ``[i, t]``)::

    r = pm.routing.dropless(expert_idx, expert_num)              # every slot kept
    r = pm.routing.active(expert_idx, expert_num, active_num)    # the first active_num rows kept
    r = pm.routing.drop_pad(expert_idx, expert_num, capacity)    # each expert keeps `capacity`
    grad_x = pm.moe_init_routing_v2_grad(g, r.expanded_row_idx, **r.grad_args)

Where they run follows the ids, as for the ops: host ids (NumPy, torch CPU tensors, anything
with DLPack or the buffer protocol) go through the NumPy reference and give host arrays, with
no device needed; DeviceArray ids go through the forward op on their device, queued on
``stream``, and give DeviceArrays at once. Both give the same values.

:func:`random_top_k` makes top-k ids as a gate does (distinct experts per token), for tests
and benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _args, _contract
from .array import DeviceArray, empty
from .errors import InvalidArgument
from .host import host_view, in_family
from .op.moe_init_routing_v2 import moe_init_routing_v2
from .reference import moe_init_routing_v2 as reference_routing
from .stream import Stream

__all__ = ["Routing", "active", "drop_pad", "dropless", "random_top_k"]

# What random_top_k draws at once: a block of tokens' scores for every expert, kept to a few
# MiB whatever N * expert_num is.
_SCORES_PER_BLOCK = 1 << 19


@dataclass(frozen=True, eq=False)  # arrays inside: == would be ambiguous
class Routing:
    """Where each (token, expert) slot's row is in the forward's expanded_x, and the scenario
    the backward must be told.

    ``expanded_row_idx`` ([N*K] int32): slot ``i*K + t`` (token i's t-th expert) is row
    ``expanded_row_idx[i*K + t]`` of expanded_x seen as rows; -1 for a slot dropped in drop/pad
    mode. ``expert_counts`` ([expert_num] int32): the slots routed to each expert, before any
    is dropped (the forward's count output in mode 0, its before-capacity output in mode 1).
    Both are host arrays or DeviceArrays, as the ids were.
    """

    expanded_row_idx: Any
    expert_counts: Any
    tokens: int
    top_k: int
    expert_num: int
    drop_pad_mode: int
    active_num: int
    expert_capacity: int

    @property
    def scenario(self) -> str:
        """'dropless', 'active' or 'drop-pad'."""
        return _contract.scenario(self.drop_pad_mode, self.active_num)

    @property
    def on_device(self) -> bool:
        """Whether the arrays are DeviceArrays (routed by the op) rather than host arrays."""
        return isinstance(self.expanded_row_idx, DeviceArray)

    @property
    def grad_args(self) -> dict[str, int]:
        """The backward's attributes for this routing, as keywords of
        :func:`~pyacl_moe.moe_init_routing_v2_grad` (and of its reference):
        ``top_k``, ``drop_pad_mode``, ``active_num``."""
        return {"top_k": self.top_k, "drop_pad_mode": self.drop_pad_mode, "active_num": self.active_num}

    @property
    def forward_args(self) -> dict[str, Any]:
        """The forward's attributes that give this routing, as keywords of
        :func:`~pyacl_moe.moe_init_routing_v2` (and of its reference), the per-expert count
        output switched on: ``pm.moe_init_routing_v2(x, expert_idx, **r.forward_args)``."""
        return _forward_args(self.expert_num, self.drop_pad_mode, self.active_num, self.expert_capacity)

    def expanded_shape(self, hidden: int) -> tuple[int, ...]:
        """The shape of the forward's expanded_x (so of the backward's grad_expanded_x) for
        rows of ``hidden`` elements: [N*K, H] dropless, [active_num, H] active, [E, C, H]
        drop/pad."""
        h = _args.int64("hidden", hidden)
        if h < 1:
            raise InvalidArgument("hidden", f"must be at least 1 (the backward refuses empty rows), got {h}")
        if self.drop_pad_mode == 1:
            return (self.expert_num, self.expert_capacity, h)
        return (self.active_num or self.tokens * self.top_k, h)

    def rows_per_expert(self) -> Any:
        """The rows of expanded_x each expert owns, in expert order ([expert_num] int32, host
        arrays only): expert e's rows follow experts 0..e-1's. Dropless: ``expert_counts``;
        active: what of it lies within the first active_num rows; drop/pad: at most the
        capacity (expert e's rows are then ``expanded_x[e, :rows[e]]``)."""
        if self.on_device:
            raise TypeError("rows_per_expert() needs the counts on the host: call to_host() first (it copies "
                            "from the device and waits)")
        counts, family = host_view(self.expert_counts, "expert_counts")
        if self.drop_pad_mode == 1:
            rows = np.minimum(counts, self.expert_capacity)
        elif self.active_num:
            ends = np.minimum(np.cumsum(counts, dtype=np.int64), self.active_num)
            rows = np.diff(ends, prepend=0)
        else:
            rows = counts
        return in_family(np.asarray(rows, dtype=np.int32), family)

    def to_host(self, stream: Stream | None = None) -> Routing:
        """This routing with host arrays: NumPy arrays copied from the device (on ``stream``,
        which is then waited for; without one, after the streams that wrote them), or itself
        when its arrays are already on the host."""
        if not self.on_device:
            return self
        return Routing(self.expanded_row_idx.to_host(stream), self.expert_counts.to_host(stream), self.tokens,
                       self.top_k, self.expert_num, self.drop_pad_mode, self.active_num, self.expert_capacity)


def dropless(expert_idx: Any, expert_num: int, *, stream: Stream | None = None) -> Routing:
    """Dropless routing (drop_pad_mode 0, active_num 0): every one of the N*K slots gets a row
    of expanded_x ([N*K, H]), in expert order; slots of one expert keep their order i*K + t.

    ``expert_idx``: [N, K] int32, ids in [0, expert_num). On the host the NumPy reference
    computes it; DeviceArray ids run the forward op on ``stream`` (see :func:`drop_pad`).
    """
    return _route(expert_idx, expert_num, 0, 0, 0, stream)


def active(expert_idx: Any, expert_num: int, active_num: int, *, stream: Stream | None = None) -> Routing:
    """Active routing (drop_pad_mode 0, active_num A > 0): the dropless order, of which only
    the first A rows exist ([A, H]); the backward skips slots whose row is A or more.

    An ``active_num`` above N*K keeps every slot: the result's ``active_num`` is then N*K, the
    rows the forward gives and the backward expects. Else as :func:`dropless`.
    """
    a = _args.int64("active_num", active_num)
    if a < 1:
        raise InvalidArgument("active_num", f"must be at least 1 (0 means dropless: use routing.dropless), got {a}")
    return _route(expert_idx, expert_num, a, 0, 0, stream)


def drop_pad(expert_idx: Any, expert_num: int, expert_capacity: int, *, stream: Stream | None = None) -> Routing:
    """Drop/pad routing (drop_pad_mode 1): expert e keeps its first ``expert_capacity`` slots
    (in the order i*K + t) at rows [e, 0..] of expanded_x ([expert_num, expert_capacity, H],
    rows nobody fills are zero); the other slots are dropped and get -1.

    ``expert_capacity`` is at most N, the op's rule. Host ids are routed by the NumPy
    reference with a zero-width x (the ids are all it reads). DeviceArray ids run the forward
    op on their device, queued on ``stream`` (default: the thread's current stream), with a
    scratch x of [N, 1] float16 since the op wants rows to copy; its expanded_x is dropped.
    The ids' values are checked on the host only: on the device, an id outside
    [0, expert_num) is the op's to meet.
    """
    c = _args.int64("expert_capacity", expert_capacity)
    if c < 1:
        raise InvalidArgument("expert_capacity", f"must be at least 1 in drop/pad mode, got {c}")
    return _route(expert_idx, expert_num, 0, c, 1, stream)


def _route(expert_idx: Any, expert_num: Any, active_num: int, capacity: int, mode: int,
           stream: Stream | None) -> Routing:
    num = _args.int64("expert_num", expert_num)
    if num < 1:
        raise InvalidArgument("expert_num", f"must be at least 1, got {num}")
    _args.nbytes("expert_num", (num,), 4)  # the per-expert counts, [expert_num] int32
    if stream is not None and not isinstance(stream, Stream):
        raise InvalidArgument("stream", f"must be a Stream or None, got {type(stream).__name__}")
    on_device = isinstance(expert_idx, DeviceArray)
    if on_device:
        shape, dtype = expert_idx.shape, expert_idx.dtype
    else:
        if stream is not None:
            raise InvalidArgument("stream", "applies to DeviceArray ids only: host ids are routed on the host by the "
                                            "NumPy reference (pass pm.to_device(expert_idx) to route on the device)")
        ids, family = host_view(expert_idx, "expert_idx")
        shape, dtype = ids.shape, ids.dtype
    if len(shape) != 2:
        raise InvalidArgument("expert_idx", f"must be 2-D [N, K] (each token's top-k expert ids), got shape {shape}")
    n, k = shape
    if n < 1 or k < 1:
        raise InvalidArgument("expert_idx", f"must have at least one token and one expert per token (the backward "
                                            f"refuses an empty expanded_row_idx), got shape {shape}")
    if dtype != np.int32:
        raise InvalidArgument("expert_idx", f"dtype must be int32 (the op's expertIdx), got {dtype}")
    if mode == 1 and capacity > n:
        raise InvalidArgument("expert_capacity", f"must be at most N = {n} (the op's rule), got {capacity}")
    # The forward's rows are min(active_num, N*K); the backward wants exactly that many.
    active_rows = min(active_num, n * k)
    attrs = _forward_args(num, mode, active_rows, capacity)
    if on_device:
        # The op copies rows of x into expanded_x: one column of the smallest dtype is all it
        # needs, and nothing reads it (its expanded_x is dropped), so it is left unset.
        scratch = empty((n, 1), np.float16, expert_idx.device)
        out = moe_init_routing_v2(scratch, expert_idx, **attrs, stream=stream)
        counts = out.expert_tokens_before_capacity if mode == 1 else out.expert_tokens_count_or_cumsum
        return Routing(out.expanded_row_idx, counts, n, k, num, mode, active_rows, capacity)
    # A zero-width x: the op's contract allows empty tensors, and the reference reads the ids only.
    _, row_idx, count, before = reference_routing(np.empty((n, 0), np.float16), ids, **attrs)
    counts = before if mode == 1 else count
    assert counts is not None  # forward_args switch the count output on in every scenario
    return Routing(in_family(row_idx, family), in_family(counts, family), n, k, num, mode, active_rows, capacity)


def _forward_args(expert_num: int, mode: int, active_num: int, capacity: int) -> dict[str, Any]:
    drop_pad = mode == 1
    # The per-expert counts come from the count output in mode 0 and the before-capacity
    # output in mode 1: the op gives each in one mode only.
    return {"active_num": active_num, "expert_capacity": capacity, "expert_num": expert_num,
            "drop_pad_mode": mode, "expert_tokens_count_or_cumsum_flag": 0 if drop_pad else 2,
            "expert_tokens_before_capacity_flag": drop_pad}


def random_top_k(n: int, k: int, expert_num: int, *, seed: Any = None, weights: Any = None) -> np.ndarray:
    """Top-k expert ids as a gate gives them: [n, k] int32, k distinct experts per token, in
    the order of their (random) scores.

    ``seed``: an int, None (fresh entropy) or a ``numpy.random.Generator`` (drawn from).
    ``weights``: optional [expert_num] non-negative popularity of each expert; each token's
    experts are then drawn without replacement with probabilities in proportion to them (for
    unbalanced loads, where drop/pad drops), else uniformly. At least k weights must be
    positive.
    """
    n_ = _args.int64("n", n)
    num = _args.int64("expert_num", expert_num)
    k_ = _args.int64("k", k)
    if n_ < 0:
        raise InvalidArgument("n", f"must not be negative, got {n_}")
    if num < 1:
        raise InvalidArgument("expert_num", f"must be at least 1, got {num}")
    if not 1 <= k_ <= num:
        raise InvalidArgument("k", f"must be in [1, expert_num = {num}] (distinct experts per token), got {k_}")
    # What is made whole: the ids, [n, k] int32, and a score per expert, float64.
    _args.nbytes("n", (n_, k_), 4)
    _args.nbytes("expert_num", (num,), 8)
    if seed is not None and not isinstance(seed, np.random.Generator):
        seed = _args.int64("seed", seed, lo=0)
    rng = np.random.default_rng(seed)
    log_w = np.zeros(num)
    if weights is not None:
        try:
            w = np.asarray(weights, dtype=np.float64) if not isinstance(weights, (str, bytes)) else None
        except (TypeError, ValueError):
            w = None
        if w is None or w.shape != (num,):
            raise InvalidArgument("weights", f"must be {num} numbers (one per expert), got {weights!r:.80}")
        if not np.isfinite(w).all() or (w < 0).any():
            raise InvalidArgument("weights", "must be finite and not negative")
        if np.count_nonzero(w) < k_:
            raise InvalidArgument("weights", f"needs at least k = {k_} positive entries (distinct experts per "
                                             f"token), got {np.count_nonzero(w)}")
        with np.errstate(divide="ignore"):
            log_w = np.log(w)  # a weight of 0 scores -inf: never drawn
    out = np.empty((n_, k_), np.int32)
    block = max(1, _SCORES_PER_BLOCK // num)
    for t0 in range(0, n_, block):
        t1 = min(n_, t0 + block)
        # Gumbel top-k: the k best of log(w) + Gumbel noise are a draw without replacement in
        # proportion to w, best first.
        scores = log_w + rng.gumbel(size=(t1 - t0, num))
        best = np.argpartition(-scores, k_ - 1, axis=1)[:, :k_]
        order = np.argsort(-np.take_along_axis(scores, best, axis=1), axis=1, kind="stable")
        out[t0:t1] = np.take_along_axis(best, order, axis=1)
    return out
