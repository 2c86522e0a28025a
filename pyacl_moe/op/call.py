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

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _args, _contract
from ..array import DeviceArray, copy_in_native, empty, host_array
from ..device import Device, current_device
from ..errors import InvalidArgument
from ..host import TORCH, host_view, in_family
from ..pool import workspace_for
from ..stream import Stream, StreamState, current_stream, resolve_stream, thread_current
from .executor import check_output_layout, checked_workspace, device_of, first_phase, launch, mark_uses, output_tracks
from .plan import check_no_overlap, check_workspace_apart, launch_cached
from .spec import OpSpec

__all__ = ["OneCall", "Outputs", "run_device", "run_host"]

# output name -> (shape, dtype) it must have, or None when the scenario does not write it
Outputs = dict[str, "tuple[tuple[int, ...], np.dtype] | None"]


@dataclass(frozen=True)
class OneCall:
    """An operator's one call. ``check(layouts, attrs)``: the contract on the inputs'
    (shape, dtype), raising InvalidArgument, returning the outputs; ``sizes(arrays, attrs)``:
    the outputs as the attributes size them, unchecked (validate=False); ``check_values(host
    inputs, attrs)``: the contract on host input values."""

    spec: OpSpec
    check: Callable[[Mapping[str, tuple[tuple[int, ...], np.dtype]], Mapping[str, Any]], Outputs]
    sizes: Callable[[Mapping[str, DeviceArray], Mapping[str, Any]], Outputs]
    check_values: Callable[[Mapping[str, np.ndarray], Mapping[str, Any]], None]


class _Memo:
    """Layouts that passed the contract, and the outputs they imply: a layout that passed once
    passes again. Bounded (it starts over when full); ``lock`` guards ``checked``."""

    SIZE = 256

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.checked: dict[tuple[Any, ...], Outputs] = {}

    def outputs(self, op: OneCall, key: tuple[Any, ...], inputs: Mapping[str, DeviceArray],
                attrs: Mapping[str, Any]) -> Outputs:
        with self.lock:
            got = self.checked.get(key)
        if got is None:
            got = op.check({n: (a.shape, a.dtype) for n, a in inputs.items()}, attrs)
            with self.lock:
                if len(self.checked) >= self.SIZE:
                    self.checked.clear()
                self.checked[key] = got
        return got


_memos: dict[str, _Memo] = {}
_memos_lock = threading.Lock()  # guards _memos


def _memo(spec: OpSpec) -> _Memo:
    with _memos_lock:
        m = _memos.get(spec.api)
        if m is None:
            m = _memos[spec.api] = _Memo()
        return m


def _attr_key(attrs: Mapping[str, Any]) -> tuple[Any, ...]:
    # The types go in too: True and 1 must not share an entry.
    return tuple((type(v), v) for v in attrs.values())


def _fits(name: str, want: tuple[tuple[int, ...], np.dtype] | None, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """A given output must be what the contract says the inputs make."""
    if want is None:
        raise InvalidArgument(name, "is not written in this scenario: pass None")
    if shape != want[0] or dtype != want[1]:
        what = _contract.dtype_name
        raise InvalidArgument(name, f"must have shape {want[0]} and dtype {what(want[1])} (what the inputs make), "
                                    f"got shape {shape} and dtype {what(dtype)}")


def _given(spec: OpSpec, wanted: Outputs, given: Mapping[str, DeviceArray]) -> None:
    """Given outputs must be what the contract says, writable the way the release writes."""
    for name, a in given.items():
        _fits(name, wanted[name], a.shape, a.dtype)
        check_output_layout(name, a)


def _ranges_meet(arrays: list[DeviceArray | None], outputs: tuple[int, ...]) -> bool:
    for i in outputs:
        o = arrays[i]
        if o is None:
            continue
        olo, ohi = o.span
        for j, a in enumerate(arrays):
            if j != i and a is not None and a.span[0] <= ohi and olo <= a.span[1]:
                return True
    return False


def run_device(op: OneCall, inputs: Mapping[str, DeviceArray], given: Mapping[str, DeviceArray],
               attrs: Mapping[str, Any], stream: Stream | None, workspace: DeviceArray | None,
               validate: bool) -> dict[str, DeviceArray | None]:
    """The one call on DeviceArrays (see the module docstring): the outputs, given or made,
    by name (None: not written in this scenario)."""
    spec = op.spec
    every = {**inputs, **given}
    dev = device_of({**every, "workspace": workspace} if workspace is not None else every)
    if stream is None:
        cur = thread_current.stream
        state: StreamState = cur.state if cur is not None and cur.state.device is dev else dev.default_stream.state
    else:
        state = resolve_stream(stream, dev)
    if not validate:
        return _run_unchecked(op, inputs, given, attrs, state, workspace, dev)
    key = (*(a.layout_id for a in inputs.values()), _attr_key(attrs))
    wanted = _memo(spec).outputs(op, key, inputs, attrs)
    if given:
        _given(spec, wanted, given)
    outs = {n: given[n] if n in given else None if w is None else empty(w[0], w[1], dev) for n, w in wanted.items()}
    arrays = [inputs[n] if n in inputs else outs[n] for n in spec.tensors]
    if given and _ranges_meet(arrays, spec.output_positions):
        check_no_overlap(spec, dict(zip(spec.tensors, arrays)))  # the exact check, where two byte ranges meet
    if workspace is not None:
        check_workspace_apart(workspace, dict(zip(spec.tensors, arrays)))
    cache_key = (*(-1 if a is None else a.layout_id for a in arrays), key[-1])
    launch_cached(spec, cache_key, arrays, tuple(None if a is None else a.allocation(n) for n, a in
                                                 zip(spec.tensors, arrays)),
                  tuple(0 if a is None else a.span[0] for a in arrays), tuple(attrs.values()), state, workspace)
    return outs


def _run_unchecked(op: OneCall, inputs: Mapping[str, DeviceArray], given: Mapping[str, DeviceArray],
                   attrs: Mapping[str, Any], state: StreamState, workspace: DeviceArray | None,
                   dev: Device) -> dict[str, DeviceArray | None]:
    """validate=False: CANN judges everything, through the vendor's first phase each call."""
    outs: dict[str, DeviceArray | None] = {}
    for name, want in op.sizes(inputs, attrs).items():
        if name in given:
            outs[name] = given[name]
        elif want is not None:
            _args.nbytes(name, want[0], want[1].itemsize)  # what the attributes size must be addressable
            outs[name] = empty(want[0], want[1], dev)
        else:
            outs[name] = None
    size, executor = first_phase(op.spec, {**inputs, **outs}, attrs, dev)
    try:
        core = executor.core()
        if workspace is not None:
            block: Any = checked_workspace(workspace, size, dev, "executor")
            ws = workspace.address
        else:
            block = workspace_for(state, size) if size else None
            ws = block.ptr if block is not None else 0
        mark_uses(core, state)
        held = (block, *(a.allocation(n) for n, a in {**inputs, **outs}.items() if a is not None))
        launch(core, state, ws, size, held, output_tracks(core))
    finally:
        executor.close()
    return outs


def run_host(op: OneCall, inputs: Mapping[str, Any], attrs: Mapping[str, Any], out: Mapping[str, Any] | None,
             stream: Stream | None, workspace: DeviceArray | None, validate: bool) -> dict[str, Any]:
    """The one call on host arrays: the outputs by name, in the family of the first input (or
    the arrays given in ``out``, written in place)."""
    raw, family = {}, None
    for name, value in inputs.items():
        raw[name], fam = host_view(value, name)
        family = family or fam
    given: dict[str, np.ndarray] = {}
    for name, value in (out or {}).items():
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
    device_inputs = {n: copy_in_native(v, dev, state) for n, v in views.items()}
    outs = run_device(op, device_inputs, {}, attrs, s, workspace, validate)
    result: dict[str, Any] = {}
    for name, dout in outs.items():
        if dout is None:
            result[name] = None
            continue
        host = dout.to_host(s)
        if name in given:
            given[name][...] = host
            result[name] = out[name]  # type: ignore[index]
        else:
            result[name] = in_family(host, family)  # type: ignore[arg-type]
    return result
