"""The one call of any operator, driven by its :class:`OneCall` description: the same path, the
same ``out`` and ``workspace`` rules, for both ops.

On DeviceArrays (:func:`run_device`): with ``validate`` the contract is checked once per layout
(a bounded memo), given outputs must have the shapes and dtypes it implies (and be written in
the scenario), outputs must share no memory with another tensor, a caller's workspace none
with any; the launch goes through the stream's executor cache (:func:`.plan.launch_cached`),
whose steady state is one foreign call under the stream's lock. Without ``validate`` the
vendor's first phase runs on every call, over what was given.

On host arrays (:func:`run_host`): each input is viewed and made native and C-contiguous once,
its values checked (with ``validate``), copied in, run, synchronized, and copied out into new
arrays of the inputs' family, or into the host arrays given as ``out``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _args, _contract
from ..allocator import Allocation
from ..array import DeviceArray, contiguous_layout, copy_in_native, empty_from, host_array, new_empty
from ..device import Device, current_device
from ..errors import InvalidArgument
from ..host import TORCH, host_view, in_family
from ..pool import workspace_for
from ..stream import Stream, StreamState, current_stream, resolve_stream, thread_current
from .executor import check_output_layout, checked_workspace, device_of, first_phase, launch, mark_uses, output_tracks
from .plan import check_no_overlap, check_workspace_apart, launch_cached, relaunch
from .spec import OpSpec

__all__ = ["OneCall", "Outputs", "run_device", "run_host"]

# output name -> (shape, dtype) it must have, or None when the scenario does not write it
Outputs = dict[str, "tuple[tuple[int, ...], np.dtype] | None"]


class _Memo:
    """Calls that passed the contract, by the layouts of their arrays (a given output's too)
    and their attribute values: what to make of each output (its contiguous_layout; None when
    given or not written), and a number naming the entry, never reused: the key of the
    streams' executor caches (the outputs it makes have the layouts it says, so one number
    names every layout and value of the launch). A call that passed once passes again.
    Bounded (it starts over when full). ``checked`` is published whole: readers take it
    without a lock and see a complete dict; a writer copies it under ``lock`` (a miss, rare),
    adds, and publishes the copy."""

    SIZE = 256

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.checked: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        # (entry number, first addresses) of the last call whose given outputs were checked apart
        # from its other tensors; published whole (a stale read only checks again).
        self.apart: tuple[Any, ...] = ()

    def put(self, key: tuple[Any, ...], made: tuple[Any, ...], given: bool) -> tuple[Any, ...]:
        """Record a call that passed: (made, its number, whether it makes an output, whether
        it was given one)."""
        with self.lock:
            new = dict(self.checked) if len(self.checked) < self.SIZE else {}
            entry = new[key] = (made, next(_entry_numbers), any(m is not None for m in made), given)
            self.checked = new
            return entry


_entry_numbers = itertools.count()  # (next() on a count is one C call: taken under a memo's lock)


@dataclass(frozen=True)
class OneCall:
    """An operator's one call. ``attrs(values)``: the attribute values (``spec.attrs`` order)
    converted to their C types, raising InvalidArgument by name; ``check(layouts, attrs)``: the
    contract on the inputs' (shape, dtype), raising InvalidArgument, returning the outputs;
    ``sizes(arrays, attrs)``: the outputs as the attributes size them, unchecked
    (validate=False); ``check_values(host inputs, attrs)``: the contract on host input values.
    ``memo``: its calls that passed the contract."""

    spec: OpSpec
    attrs: Callable[..., dict[str, Any]]
    check: Callable[[Mapping[str, tuple[tuple[int, ...], np.dtype]], Mapping[str, Any]], Outputs]
    sizes: Callable[[Mapping[str, DeviceArray], Mapping[str, Any]], Outputs]
    check_values: Callable[[Mapping[str, np.ndarray], Mapping[str, Any]], None]
    memo: _Memo = field(default_factory=_Memo, compare=False)


def _fits(name: str, want: tuple[tuple[int, ...], np.dtype] | None, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """A given output must be what the contract says the inputs make."""
    if want is None:
        raise InvalidArgument(name, "is not written in this scenario: pass None")
    if shape != want[0] or dtype != want[1]:
        what = _contract.dtype_name
        raise InvalidArgument(name, f"must have shape {want[0]} and dtype {what(want[1])} (what the inputs make), "
                                    f"got shape {shape} and dtype {what(dtype)}")


def _checked(op: OneCall, arrays: list[DeviceArray | None], values: tuple[Any, ...]) -> tuple[Any, ...]:
    """A memo miss: the contract on the inputs and attributes, given outputs fit it; what to
    make of each output."""
    spec = op.spec
    attrs = op.attrs(*values)
    n_in = len(spec.inputs)
    layouts = {}
    for name, a in zip(spec.inputs, arrays):
        assert a is not None  # the op module passes every input
        layouts[name] = (a.shape, a.dtype)
    wanted = op.check(layouts, attrs)
    made = []
    for name, a in zip(spec.outputs, arrays[n_in:]):
        if a is None:
            want = wanted[name]
            made.append(None if want is None else contiguous_layout(*want))
        else:
            _fits(name, wanted[name], a.shape, a.dtype)
            check_output_layout(name, a)
            made.append(None)
    return tuple(made)


def run_device(op: OneCall, arrays: list[DeviceArray | None], values: tuple[Any, ...], stream: Stream | None,
               workspace: DeviceArray | None, validate: bool) -> list[DeviceArray | None]:
    """The one call on DeviceArrays (see the module docstring). ``arrays``: every tensor in
    ``spec.tensors`` order, an output None to be made (or passed as a null pointer where the
    scenario writes none); ``values``: the attributes in ``spec.attrs`` order. Returns the
    outputs in ``spec.outputs`` order. The list is the caller's to give away: it is filled in."""
    spec = op.spec
    first = arrays[0].alloc  # type: ignore[union-attr]  # (an input: never a null pointer)
    dev = first.device if first is not None else None
    # One pass over the arrays: the layout key, the allocations, the first elements' addresses.
    key: list[Any] = []
    allocs: list[Allocation | None] = []
    firsts: list[int] = []
    for a in arrays:
        if a is None:
            key.append(-1)
            allocs.append(None)
            firsts.append(0)
            continue
        alloc = a.alloc
        if alloc is None or alloc.device is not dev:
            _device_of(spec, arrays, workspace)  # raises, naming the array
        key.append(a.layout_id)
        allocs.append(alloc)
        firsts.append(a.span[0])
    if dev is None or workspace is not None:
        dev = _device_of(spec, arrays, workspace)
    if stream is None:
        cur = thread_current.stream
        state: StreamState = cur.state if cur is not None and cur.state.device is dev else dev.default_stream.state
    else:
        state = stream.state
        if state.device is not dev:
            resolve_stream(stream, dev)  # raises, naming the devices
    if not validate:
        return _run_unchecked(op, arrays, values, state, workspace, dev)
    # The values with their types: the key tells True from 1, and a NumPy integer from an int.
    key.append(values)
    key.append(tuple(map(type, values)))
    memo = op.memo
    try:
        entry = memo.checked.get(tuple(key))
    except TypeError:  # a value that cannot be a key (a list, an array): the checks name it
        op.attrs(*values)
        raise
    if entry is None:
        given = any(arrays[i] is not None for i in spec.output_positions)
        entry = memo.put(tuple(key), _checked(op, arrays, values), given)
    made, cache_key, makes, given = entry
    if makes:
        for i, want in zip(spec.output_positions, made):
            if want is not None:
                new = arrays[i] = empty_from(want, dev, state)
                allocs[i] = new.alloc
                firsts[i] = new.span[0]
    if given and memo.apart != (cache_key, firsts):
        # A given output must share no memory with another tensor. The outcome depends only on
        # the layouts and the addresses, so the last pair that passed is not checked again.
        _check_outputs_apart(spec, arrays)
        memo.apart = (cache_key, firsts)
    if workspace is not None:
        check_workspace_apart(workspace, dict(zip(spec.tensors, arrays)))
    if workspace is not None or not relaunch(spec, cache_key, firsts, allocs, arrays, state):
        launch_cached(spec, cache_key, arrays, tuple(allocs), tuple(firsts), values, state, workspace)
    return arrays[len(spec.inputs):]


def _check_outputs_apart(spec: OpSpec, arrays: list[DeviceArray | None]) -> None:
    """check_no_overlap, run only when a given output's bytes meet another array's."""
    spans = [a.span for a in arrays if a is not None]
    for i in spec.output_positions:
        out = arrays[i]
        if out is None:
            continue
        lo, hi = out.span
        if sum(1 for first, last in spans if first <= hi and lo <= last) > 1:  # (it meets itself)
            check_no_overlap(spec, dict(zip(spec.tensors, arrays)))
            return


def _device_of(spec: OpSpec, arrays: list[DeviceArray | None], workspace: DeviceArray | None) -> Device:
    every: dict[str, Any] = {n: a for n, a in zip(spec.tensors, arrays) if a is not None}
    if workspace is not None:
        every["workspace"] = workspace
    return device_of(every)


def _run_unchecked(op: OneCall, arrays: list[DeviceArray | None], values: tuple[Any, ...], state: StreamState,
                   workspace: DeviceArray | None, dev: Device) -> list[DeviceArray | None]:
    """validate=False: CANN judges everything, through the vendor's first phase each call."""
    spec = op.spec
    attrs = op.attrs(*values)
    n_in = len(spec.inputs)
    sizes = op.sizes(dict(zip(spec.inputs, arrays)), attrs)  # type: ignore[arg-type]
    for i, name in zip(spec.output_positions, spec.outputs):
        want = sizes[name]
        if arrays[i] is None and want is not None:
            _args.nbytes(name, want[0], want[1].itemsize)  # what the attributes size must be addressable
            arrays[i] = new_empty(want[0], want[1], dev)
    named = dict(zip(spec.tensors, arrays))
    size, executor = first_phase(spec, named, attrs, dev)
    try:
        core = executor.core()
        if workspace is not None:
            block: Any = checked_workspace(workspace, size, dev, "executor")
            ws = workspace.address
        else:
            block = workspace_for(state, size) if size else None
            ws = block.ptr if block is not None else 0
        mark_uses(core, state)
        held = (block, *(a.allocation(n) for n, a in named.items() if a is not None))
        launch(core, state, ws, size, held, output_tracks(core))
    finally:
        executor.close()
    return arrays[n_in:]


def run_host(op: OneCall, inputs: list[Any], values: tuple[Any, ...], out: list[Any], stream: Stream | None,
             workspace: DeviceArray | None, validate: bool) -> list[Any]:
    """The one call on host arrays (``inputs`` in ``spec.inputs`` order, ``out`` in
    ``spec.outputs`` order, None for an output to make): the outputs, new arrays in the family
    of the first input, or the host arrays given in ``out``, written in place."""
    spec = op.spec
    attrs = op.attrs(*values)
    raw, family = {}, None
    for name, value in zip(spec.inputs, inputs):
        raw[name], fam = host_view(value, name)
        family = family or fam
    given: dict[str, np.ndarray] = {}
    for name, value in zip(spec.outputs, out):
        if value is not None:
            if not isinstance(value, np.ndarray) and family is not TORCH:
                raise InvalidArgument(name, f"must be a NumPy array when the inputs are host arrays, got "
                                            f"{type(value).__name__}")
            given[name], _ = host_view(value, name)  # a torch tensor's own memory, written in place
            if not given[name].flags.writeable:
                raise InvalidArgument(name, "must be writable")
    if validate:  # the contract first: its messages name the rule an input breaks
        wanted = op.check({n: (v.shape, v.dtype.newbyteorder("=")) for n, v in raw.items()}, attrs)
        for name, host in given.items():
            _fits(name, wanted[name], host.shape, host.dtype)
    views = {n: host_array(v, n) for n, v in raw.items()}  # each input converted once
    if validate:
        op.check_values(views, attrs)
    dev = stream.device if stream is not None else current_device()
    s = stream if stream is not None else current_stream(dev)
    state = resolve_stream(s, dev)
    arrays: list[DeviceArray | None] = [copy_in_native(views[n], dev, state) for n in spec.inputs]
    arrays += [None] * len(spec.outputs)
    result: list[Any] = []
    for name, dout, mine in zip(spec.outputs, run_device(op, arrays, values, s, workspace, validate), out):
        if dout is None:
            result.append(None)
            continue
        host = dout.to_host(s)
        if name in given:
            given[name][...] = host
            result.append(mine)
        else:
            result.append(in_family(host, family))  # type: ignore[arg-type]
    return result
