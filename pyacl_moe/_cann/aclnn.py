"""Thin wrappers of aclnn/acl_meta.h (aclTensor, executors) and of any operator's two phases.

An operator is named by its API stem (``"aclnnMoeInitRoutingV2Grad"``): the first phase is
``<stem>GetWorkspaceSize(<its parameters>, uint64_t *workspaceSize, aclOpExecutor **executor)``
and the second ``<stem>(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
aclrtStream stream)``, as for every aclnn operator; the op layer says which parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from . import declare, loader
from .acl import Handle, StreamHandle, interrupts_deferred, raw, void
from .errcheck import check, null_result

__all__ = ["ExecutorHandle", "TensorHandle", "create_tensor", "get_workspace_size",
           "launch", "second_phase", "set_input_addr", "set_output_addr", "set_repeatable", "tensor_query"]

_ffi = declare.ffi
_NULL = declare.NULL


# ---------------------------------------------------------------------------- aclTensor

class TensorHandle(Handle):
    __slots__ = ()
    SLOT_TYPE, LIBRARY, API = "aclTensor **", "nn", "aclDestroyTensor"


def create_tensor(h: TensorHandle, shape: Sequence[int], dtype: int, strides: Sequence[int], offset: int,
                  storage_size: int, addr: int, fmt: int) -> None:
    """aclCreateTensor of a view (element strides and offset, over ``storage_size`` elements)
    of device memory at ``addr`` into ``h`` (``fmt``: an aclFormat)."""
    fn, arr = loader.libs().nn.aclCreateTensor, declare.ctype("int64_t[]")
    dims, steps = _ffi.new(arr, list(shape) or [0]), _ffi.new(arr, list(strides) or [0])
    with interrupts_deferred():  # the pointer it returns is stored before anything is raised
        h._slot[0] = fn(dims, len(shape), dtype, steps, offset, fmt, _ffi.new(arr, [storage_size]), 1, void(addr))
    if not h:
        raise null_result("aclCreateTensor")


# aclGet<what>: the C type it fills (None: an int64 array CANN allocates, the caller frees).
_GETTERS = {"ViewShape": None, "ViewStrides": None, "StorageShape": None, "ViewOffset": "int64_t *",
            "DataType": "aclDataType *", "Format": "aclFormat *", "RawTensorAddr": "void **"}


def tensor_query(h: TensorHandle, what: str) -> Any:
    """``aclGet<what>`` of a tensor (``what``: a key of the table above), as Python ints."""
    api = "aclGet" + what
    fn, ctype = getattr(loader.libs().nn, api), _GETTERS[what]
    if ctype is not None:
        v = _ffi.new(declare.ctype(ctype))
        check(fn(h._slot[0], v), api)
        return int(_ffi.cast(declare.ctype("uintptr_t"), v[0])) if what == "RawTensorAddr" else int(v[0])
    arr, n = _ffi.new(declare.ctype("int64_t **")), _ffi.new(declare.ctype("uint64_t *"))
    check(fn(h._slot[0], arr, n), api)
    try:
        return tuple(int(arr[0][i]) for i in range(n[0]))
    finally:
        declare.process().free(arr[0])  # CANN hands the array to the caller; the C library's free releases it


# ---------------------------------------------------------------------------- executors

class ExecutorHandle(Handle):
    __slots__ = ()
    SLOT_TYPE, LIBRARY, API = "aclOpExecutor **", "nn", "aclDestroyAclOpExecutor"


def set_repeatable(ex: ExecutorHandle) -> None:
    check(loader.libs().nn.aclSetAclOpExecutorRepeatable(ex._slot[0]), "aclSetAclOpExecutorRepeatable")


def set_input_addr(ex: ExecutorHandle, index: int, tensor: TensorHandle, addr: int) -> None:
    check(loader.libs().nn.aclSetInputTensorAddr(ex._slot[0], index, tensor._slot[0], void(addr)),
          "aclSetInputTensorAddr")


def set_output_addr(ex: ExecutorHandle, index: int, tensor: TensorHandle, addr: int) -> None:
    check(loader.libs().nn.aclSetOutputTensorAddr(ex._slot[0], index, tensor._slot[0], void(addr)),
          "aclSetOutputTensorAddr")


# ---------------------------------------------------------------------------- an operator's two phases

def get_workspace_size(api: str, args: Sequence[TensorHandle | int | bool | None], executor: ExecutorHandle) -> int:
    """``<api>GetWorkspaceSize(*args, &size, &executor)``: the executor lands in ``executor``;
    returns the workspace size. ``args`` are the operator's own parameters in C order: tensor
    handles (None for a null pointer) and attribute values."""
    fn = getattr(loader.libs().op, api + "GetWorkspaceSize")
    cargs = [a._slot[0] if isinstance(a, TensorHandle) else (_NULL if a is None else a) for a in args]
    size = _ffi.new(declare.ctype("uint64_t *"))
    check(fn(*cargs, size, executor._slot), api + "GetWorkspaceSize")
    return int(size[0])


def launch(api: str, workspace: int, size: int, executor: ExecutorHandle, consumes: bool,
           stream: StreamHandle | None) -> None:
    """``<api>(workspace, size, executor, stream)``: queue the kernel (the stream last, as a
    stream's enqueue passes it). With ``consumes`` (a
    one-shot executor) the executor is CANN's from this call on, whatever it returns: nnopbase
    recycles a one-shot executor once past its argument checks (null executor, a null
    workspace for a non-zero size, a size below the executor's), which the caller has made.
    The handle is forgotten with the call, interrupts held back between the two."""
    fn = getattr(loader.libs().op, api)
    ws, st, ex = void(workspace), raw(stream), executor._slot[0]
    if not consumes:
        check(fn(ws, size, ex, st), api)
        return
    with interrupts_deferred():
        status = fn(ws, size, ex, st)
        executor.forget()
    check(status, api)


def second_phase(api: str) -> Callable[..., int]:
    """``<api>`` itself, for the launches that bind their arguments once (:func:`raw` and
    :func:`void` give them): ``fn(workspace, size, executor, stream)`` is one foreign call that
    returns the raw status (the caller checks it, and keeps the executor, stream and workspace
    alive as long as it may make the call)."""
    return getattr(loader.libs().op, api)  # type: ignore[no-any-return]
