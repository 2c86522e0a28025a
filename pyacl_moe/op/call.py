"""The one call of any operator, driven by its :class:`OneCall` description: the same path, the
same ``out`` and ``workspace`` rules, for both ops.

On DeviceArrays (:func:`run_device`): with ``validate`` the contract is checked once per layout
(a bounded memo), given outputs must have the shapes and dtypes it implies (and be written in
the scenario), outputs must share no memory with another tensor, a caller's workspace none
with any. The launch goes through the stream's cached executor for the memo entry (built on a
miss: :class:`_Cached`), whose steady state is one foreign call under the stream's lock.
Without ``validate`` the vendor's first phase runs on every call, over what was given.

On host arrays (:func:`run_host`): each input is viewed and made native and C-contiguous once,
its values checked (with ``validate``); its device memory and the outputs' are taken at once,
the copies in, the launch and the copies out queued on the stream, then one wait, and the
blocks go straight back to the cache.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _args
from .._cann import acl, aclnn, declare
from .._cann.errcheck import check
from ..array import DeviceArray, contiguous_layout, empty_from, host_array, wait_for
from ..device import Allocation, Device, collect, current_device
from ..errors import InvalidArgument
from ..host import TORCH, host_view, in_family
from ..stream import Stream, StreamState, resolve_stream, thread_current, written
from ..tensor import TensorCore
from .executor import build, check_output_layout, checked_workspace, device_of, fits
from .plan import Plan, check_no_overlap, check_workspace_apart
from .spec import OpSpec

__all__ = ["OneCall", "Outputs", "one_call", "run_device", "run_host"]

# output name -> (shape, dtype) it must have, or None when the scenario does not write it
Outputs = dict[str, "tuple[tuple[int, ...], np.dtype] | None"]


class _Memo:
    """Calls that passed the contract, by the layouts of their arrays (a given output's too)
    and their attribute values: the outputs to make (their contiguous_layouts), and a token
    naming the entry (an object of its own: no other entry's while anything holds it), the key
    of the streams' executor caches (see :func:`run_device`). A call that passed once passes
    again. Bounded (it starts over when full). ``checked`` and ``host`` are published whole:
    readers take them without a lock and see a complete dict; a writer copies one under
    ``lock`` (a miss, rare), adds, and publishes the copy. ``apart`` likewise (a stale read
    only checks again)."""

    SIZE = 256

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.checked: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self.host: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # the NumPy call's: by shapes, dtypes and values
        # (entry token, first addresses) of the last call whose given outputs were checked apart
        self.apart: tuple[object, list[int] | None] = (None, None)

    def put(self, table: str, key: tuple[Any, ...], entry: tuple[Any, ...]) -> tuple[Any, ...]:
        """Record a call that passed in ``table`` (``checked`` or ``host``), published whole."""
        with self.lock:
            old = getattr(self, table)
            setattr(self, table, {**(old if len(old) < self.SIZE else {}), key: entry})
        return entry


_thread = acl.thread_state  # the calling thread's current context (read only)


@dataclass(frozen=True)
class OneCall:
    """An operator's one call (its attributes' values converted by ``spec.attr_values``).
    ``check(layouts, attrs)``: the contract on the inputs' (shape, dtype), raising
    InvalidArgument, returning the outputs;
    ``sizes(arrays, attrs)``: the outputs as the attributes size them, unchecked
    (validate=False); ``check_values(host inputs, attrs)``: the contract on host input values.
    ``memo``: its calls that passed the contract."""

    spec: OpSpec
    check: Callable[[Mapping[str, tuple[tuple[int, ...], np.dtype]], Mapping[str, Any]], Outputs]
    sizes: Callable[[Mapping[str, Any], Mapping[str, Any]], Outputs]
    check_values: Callable[[Mapping[str, np.ndarray], Mapping[str, Any]], None]
    memo: _Memo = field(default_factory=_Memo, compare=False)

    def outputs(self, arrays: Sequence[Any], values: tuple[Any, ...],
                validate: bool) -> tuple[dict[str, Any], Outputs, list[int], list[tuple[Any, ...]]]:
        """The attributes in their C types and the outputs of a call on ``arrays`` (every tensor
        in ``spec.tensors`` order, None for an output to make): by the contract, given outputs
        fitted to it (with ``validate``), else as the attributes size them. With them the
        positions of the outputs to make and their contiguous_layouts, each refused when its
        bytes cannot be addressed."""
        spec = self.spec
        attrs = spec.attr_values(*values)
        inputs = dict(zip(spec.inputs, arrays))
        wanted = self.check({n: (a.shape, a.dtype) for n, a in inputs.items()}, attrs) if validate else \
            self.sizes(inputs, attrs)
        at, makes = [], []
        for i, name in enumerate(spec.outputs, len(spec.inputs)):
            a, want = arrays[i], wanted[name]
            if a is not None and (validate or not isinstance(a, DeviceArray)):
                # (a host output, validated or not, is copied back from the one made on the
                # device, of the shape and dtype wanted: it must be that; it is written densely)
                fits(name, want, a.shape, a.dtype)
                if isinstance(a, DeviceArray):
                    check_output_layout(name, a)
            elif a is None and want is not None:
                _args.nbytes(name, want[0], want[1].itemsize)
                at.append(i)
                makes.append(contiguous_layout(*want))
        return attrs, wanted, at, makes


class _Cached:
    """A repeatable executor for one memo entry on one stream (in the stream's ``executors``,
    used only under its lock): the first-element addresses it is bound to now, and its second
    phase, launched as ``fn(workspace, size, ex, stream)``."""

    __slots__ = ("core", "tensors", "offsets", "bound", "fn", "ex", "size")
    SIZE = 8  # entries per stream

    def __init__(self, spec: OpSpec, device: Device, arrays: Sequence[DeviceArray | None],
                 attrs: Mapping[str, Any]) -> None:
        # A cache must not keep a caller's memory alive (keep False): each launch holds its own arrays.
        self.tensors = [None if a is None else TensorCore(a, declare.const("ACL_FORMAT_ND"), False) for a in arrays]
        self.core = build(spec, device, {n: t for n, t in zip(spec.tensors, self.tensors) if t is not None}, attrs)
        self.core.set_repeatable()
        self.size = self.core.workspace_size
        self.offsets = [0 if a is None else a.offset * a.itemsize for a in arrays]
        self.bound = [0 if a is None else a.span[0] for a in arrays]  # first-element addresses bound now ([]: none)
        self.fn, self.ex = aclnn.second_phase(spec.api), acl.raw(self.core.handle)

    def rebind(self, spec: OpSpec, firsts: Sequence[int]) -> None:
        """Point the executor at views whose first elements are at ``firsts`` (the stream's
        lock held). Until every address is set the entry claims none, so that an interrupt
        half-way leaves the next call to set them all."""
        bound, self.bound = self.bound, []
        for i, (addr, tensor) in enumerate(zip(firsts, self.tensors)):
            if tensor is not None and (not bound or addr != bound[i]):
                kind, index = spec.slot(spec.tensors[i])
                setter = aclnn.set_input_addr if kind == "input" else aclnn.set_output_addr
                setter(self.core.handle, index, tensor.handle, addr - self.offsets[i])
        self.bound = list(firsts)

    def destroy(self) -> None:
        self.core.destroy()


def one_call(op: OneCall, inputs: list[Any], values: tuple[Any, ...], out: list[Any], names: list[str],
             stream: Stream | None, workspace: DeviceArray | None, validate: bool) -> list[Any]:
    """An op's one-call function, its arguments checked by name (``names``: the outputs'):
    on DeviceArrays (:func:`run_device`) or on host arrays (:func:`run_host`)."""
    spec = op.spec
    on_device = isinstance(inputs[0], DeviceArray)
    for name, a in zip(spec.inputs[1:], inputs[1:]):
        if isinstance(a, DeviceArray) != on_device:
            raise InvalidArgument(name, f"must be a DeviceArray when {spec.inputs[0]} is one, and a host array "
                                        "otherwise")
    for name, o in zip(names, out):
        if on_device and o is not None:
            _args.instance(name, o, DeviceArray, "a DeviceArray or None when the inputs are DeviceArrays")
        elif isinstance(o, DeviceArray):
            raise InvalidArgument(name, "must be a host array or None when the inputs are host arrays, got a "
                                        "DeviceArray")
    if stream is not None:
        _args.instance("stream", stream, Stream, "a Stream or None")
    if workspace is not None:
        _args.instance("workspace", workspace, DeviceArray, "a DeviceArray or None")
    validate = _args.boolean("validate", validate)
    return (run_device(op, [*inputs, *out], values, stream, workspace, validate) if on_device else
            run_host(op, inputs, values, out, stream, workspace, validate))


def run_device(op: OneCall, arrays: list[DeviceArray | None], values: tuple[Any, ...], stream: Stream | None,
               workspace: DeviceArray | None, validate: bool) -> list[DeviceArray | None]:
    """The one call on DeviceArrays (see the module docstring). ``arrays``: every tensor in
    ``spec.tensors`` order, an output None to be made (or passed as a null pointer where the
    scenario writes none); ``values``: the attributes in ``spec.attrs`` order. Returns the
    outputs in ``spec.outputs`` order. The list is the caller's to give away: it is filled in."""
    spec = op.spec
    first = arrays[0].alloc  # type: ignore[union-attr]  # (an input: never a null pointer)
    ctx = first.context if first is not None else None
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
        if alloc is None or alloc.context is not ctx:
            ctx = None  # device_of below raises, naming the array
        key.append(a.layout_id)
        allocs.append(alloc)
        firsts.append(a.span[0])
    dev = first.device if first is not None and ctx is not None and ctx.open and workspace is None else device_of(
        {n: a for n, a in zip((*spec.tensors, "workspace"), (*arrays, workspace)) if a is not None})
    if stream is None:
        cur = thread_current.stream
        state = cur.state if cur is not None and cur.state.device is dev else dev.default_stream.state
    else:
        state = stream.state
        if state.device is not dev:
            resolve_stream(stream, dev)  # raises, naming the devices
    if not validate:
        with _Unchecked(op, arrays, values) as plan:
            outs = plan(stream, workspace)
        return [outs.get(name) for name in spec.outputs]
    # The values with their types: the key tells True from 1, and a NumPy integer from an int.
    key.extend(values)
    key.extend(map(type, values))
    memo = op.memo
    try:
        entry = memo.checked.get(tuple(key))
    except TypeError:  # a value that cannot be a key (a list, an array): the checks name it
        spec.attr_values(*values)
        raise
    n_in = len(spec.inputs)
    if entry is None:
        # A miss: the contract on the inputs and attributes, given outputs fit it. The entry: the
        # positions of the outputs to make, a token naming it (a new object: no counter to
        # share), their layouts and sizes in bytes, whether an output was given.
        _, _, at, makes = op.outputs(arrays, values, True)
        entry = memo.put("checked", tuple(key), (tuple(at), object(), tuple(makes), tuple(m[1] for m in makes),
                                                 any(a is not None for a in arrays[n_in:])))
    at, number, makes, sizes, given = entry
    if makes:
        # The outputs it makes are homed on its stream, which is their writer from the start:
        # the launch neither holds them nor marks them (their allocs stay None).
        for i, new in zip(at, empty_from(makes, sizes, dev, state)):
            arrays[i], firsts[i] = new, new.span[0]
    if given:
        # A given output must share no memory with another tensor. The outcome depends only on
        # the layouts and the addresses, so the last pair that passed is not checked again.
        apart = memo.apart
        if apart[0] != number or apart[1] != firsts:
            # (check_no_overlap runs only when a given output's bytes meet another array's)
            spans = [a.span for a in arrays if a is not None]
            if any(o is not None and sum(1 for lo, hi in spans if lo <= o.span[1] and o.span[0] <= hi) > 1  # (itself)
                   for o in arrays[n_in:]):
                check_no_overlap(spec, dict(zip(spec.tensors, arrays)))
            with memo.lock:
                memo.apart = (number, firsts)
    held: Any = allocs  # what the launch keeps alive
    ws_arg = None
    if workspace is not None:
        # A caller's workspace, apart from the call's arrays and held: its address as passed and
        # its bytes (the checks of one too small or of another device are made on a miss).
        check_workspace_apart(workspace, dict(zip(spec.tensors, arrays)))
        alloc = workspace.allocation("workspace")
        held, ws_arg = (held, alloc), acl.void(workspace.address)
        ws_size = workspace.nbytes if workspace.is_contiguous and alloc.device is dev else -1
    while True:
        if ctx.open and dev.fault is None:  # type: ignore[union-attr]
            # The stream's executor for this entry, launched with the stream's workspace.
            with state.lock:
                e = state.executors.get(number)
                if e is not None and not state.closing and e.size <= (state.ws_size if ws_arg is None else ws_size):
                    if _thread.context is not state.ctx:
                        acl.use_context(state.ctx)
                    if firsts != e.bound:
                        e.rebind(spec, firsts)
                    state.point += 1  # (StreamState.hold and written, inline: the steady state's frames)
                    state.holds.append((state.point, held))
                    if given:  # (the outputs it made have this stream for writer already)
                        if len(allocs) == n_in + 1:
                            allocs[n_in].writer = state  # type: ignore[union-attr]  # (given: not None)
                        else:
                            written(allocs[n_in:], state)
                    st = e.fn(state.ws_arg if ws_arg is None else ws_arg, e.size, e.ex, state.arg)
                    if st:
                        check(st, spec.api)
                    # What the fence shows done is dropped at the return, outside the lock.
                    done = state.fenced() if state.point >= state.next_fence else None  # noqa: F841
                    return arrays[n_in:]
        _cache(op, number, arrays, values, state, workspace)


def _cache(op: OneCall, number: object, arrays: list[DeviceArray | None], values: tuple[Any, ...], state: StreamState,
           workspace: DeviceArray | None) -> None:
    """A miss: the stream's executor for entry ``number`` (built here, outside the lock: another
    thread may add one meanwhile; the oldest evicted past the cache's size) and, for its
    workspace, the stream's (or the caller's, checked). Raises what the device's state
    refuses (closed, faulted)."""
    spec, dev = op.spec, state.device
    dev.check()
    collect()
    with state.lock:
        state.check_open()
        cached = state.executors.get(number)
    e = cached or _Cached(spec, dev, arrays, spec.attr_values(*values))
    if workspace is not None:
        checked_workspace(workspace, e.size, dev, "stream")
    elif e.size:
        state.ensure_workspace(e.size)
    if cached is not None:
        # Only its workspace was missing. It is not put back: empty_cache may have taken and
        # destroyed it meanwhile, and the next lookup builds another if so.
        return
    with state.lock:
        state.check_open()
        extra = [e] if state.executors.setdefault(number, e) is not e else _evict(state.executors)
    for old in extra:
        old.destroy()


def _evict(entries: collections.OrderedDict[Any, _Cached]) -> list[_Cached]:
    # (the stream's lock held; a loop under a lock is a function of its own: ARCHITECTURE.md)
    return [entries.popitem(last=False)[1] for _ in range(len(entries) - _Cached.SIZE)]


class _Unchecked(Plan):
    """validate=False: a one-shot plan, CANN judging everything through the vendor's first
    phase on every call. A launch returns the plan's arrays by name."""

    _result_of = dict

    def __init__(self, op: OneCall, arrays: list[DeviceArray | None], values: tuple[Any, ...]) -> None:
        self._op = op
        self._build(arrays, values, False, False)


def run_host(op: OneCall, inputs: list[Any], values: tuple[Any, ...], out: list[Any], stream: Stream | None,
             workspace: DeviceArray | None, validate: bool) -> list[Any]:
    """The one call on host arrays (``inputs`` in ``spec.inputs`` order, ``out`` in
    ``spec.outputs`` order, None for an output to make): the outputs, new arrays in the family
    of the first input, or the host arrays given in ``out``, written in place."""
    spec = op.spec
    raw: list[np.ndarray] = []
    family: Any = None
    # The host memo's key: the values with their types, then each array's (shape, dtype).
    key: list[Any] = [values, tuple(map(type, values)), validate]
    for name, value in zip(spec.inputs, inputs):  # (loops, not comprehensions: no frame of their own on CPython 3.11)
        view, fam = host_view(value, name)
        raw.append(view)
        key.append((view.shape, view.dtype))
        family = family or fam
    given: list[np.ndarray | None] = []
    for name, value in zip(spec.outputs, out):
        if value is not None:
            if not isinstance(value, np.ndarray) and family != TORCH:
                raise InvalidArgument(name, f"must be a NumPy array when the inputs are host arrays, got "
                                            f"{type(value).__name__}")
            value = host_view(value, name)[0]  # a torch tensor's own memory, written in place
            if not value.flags.writeable:
                raise InvalidArgument(name, "must be writable")
        given.append(value)
        key.append(None if value is None else (value.shape, value.dtype))
    try:
        entry = op.memo.host.get(tuple(key))
    except TypeError:  # a value that cannot be a key (a list, an array): the checks name it
        op.spec.attr_values(*values)
        raise
    if entry is None:
        entry = op.memo.put("host", tuple(key), _host_checked(op, raw, given, values, validate))
    attrs, layouts, sizes, outs = entry
    views = []
    for name, v in zip(spec.inputs, raw):
        views.append(v if v.flags.c_contiguous and v.dtype.isnative else host_array(v, name))
    if validate:
        op.check_values(dict(zip(spec.inputs, views)), attrs)
    dev = stream.device if stream is not None else current_device()
    state = resolve_stream(stream, dev)
    # Device memory for the inputs and the outputs at once; the copies in, the launch and the
    # copies out queued on the stream, then one wait: the blocks are idle again after it.
    arrays = empty_from(layouts, sizes, dev, state)
    n_in = len(spec.inputs)
    state.enqueue(views, _copies(arrays, views, True))
    # The made outputs, each copied back into a host array: the caller's where it fits (native
    # and C-contiguous), else a new one.
    made = arrays[n_in:]
    hosts: list[np.ndarray] = []
    tensors: list[DeviceArray | None] = arrays[:n_in]  # type: ignore[assignment]
    for w, target in zip(outs, given):
        tensors.append(None if w is None else made[len(hosts)])
        if w is not None:
            fit = target is not None and target.flags.c_contiguous and target.dtype.isnative
            hosts.append(target if fit else np.empty(w[0], w[1]))  # type: ignore[arg-type]
    run_device(op, tensors, values, stream, workspace, validate)
    state.enqueue(hosts, _copies(made, hosts, False))
    wait_for(state)
    # Each output: a new array in the inputs' family, or the caller's (returned as given).
    results, back = [], iter(hosts)
    for w, target, mine in zip(outs, given, out):
        host = None if w is None else next(back)
        if host is not None and target is not None and host is not target:
            target[...] = host
        results.append(host if host is None else in_family(host, family) if target is None else mine)
    return results


def _host_checked(op: OneCall, raw: list[np.ndarray], given: list[np.ndarray | None], values: tuple[Any, ...],
                  validate: bool) -> tuple[Any, ...]:
    """A host memo miss: the attributes, the contract (or, without ``validate``, the sizes the
    attributes give), the given outputs fitted to it; the device layouts of the inputs and the
    outputs to write and their sizes in bytes, and each output's (shape, dtype) or None."""
    spec = op.spec
    natives = [np.empty((0,), v.dtype.newbyteorder("=")) for v in raw]  # (only their dtypes are read)
    # (arrays of the inputs' shapes and native dtypes that hold no memory: what the contract and the sizes read)
    shaped = [np.broadcast_to(np.empty((), d.dtype), v.shape) for v, d in zip(raw, natives)]
    # The contract first: its messages name the rule an input breaks. Every output is made on
    # the device, a given one too (it is copied back into the host array, which must fit it).
    attrs, wanted, _, _ = op.outputs([*shaped, *given], values, validate)
    outs = [wanted[n] for n in spec.outputs]
    # (host_array: a dtype CANN has no type for, object's too, is refused here, input by input)
    layouts = [contiguous_layout(v.shape, host_array(d, n).dtype) for n, v, d in zip(spec.inputs, raw, natives)]
    layouts += [contiguous_layout(*w) for w in outs if w is not None]
    return attrs, layouts, [m[1] for m in layouts], outs


def _copies(arrays: list[DeviceArray], hosts: list[np.ndarray], inward: bool) -> list[tuple[Any, tuple[Any, ...]]]:
    """The copies between DeviceArrays and the host arrays of the same bytes, as queued calls."""
    out = []
    for a, h in zip(arrays, hosts):
        n = h.nbytes
        if n:
            args = (a.span[0], n, h.ctypes.data, n, _H2D) if inward else (h.ctypes.data, n, a.span[0], n, _D2H)
            out.append((acl.memcpy_async, args))
    return out


_H2D, _D2H = "ACL_MEMCPY_HOST_TO_DEVICE", "ACL_MEMCPY_DEVICE_TO_HOST"
