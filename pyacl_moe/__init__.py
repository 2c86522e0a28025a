"""pyacl-moe: Python binding to CANN's aclnnMoeInitRoutingV2Grad (the backward of MoE token
routing), through the real C ABI, with NumPy in and out.

Importing the package loads nothing. The first call that needs CANN loads libascendcl.so,
libnnopbase.so and libopapi.so from the installed toolkit (see :func:`load`), or the bundled
emulator after :func:`use_emulator` / ``PYACL_MOE_EMULATOR=1``.
"""

from __future__ import annotations

from . import emulator, reference
from ._ffi import LibraryInfo, library_info, load, loaded_info, use_emulator
from .errors import (
    AclError,
    AclnnError,
    AclRuntimeError,
    CannNotFoundError,
    InvalidArgument,
    PyaclMoeError,
    status_name,
)
from .memory import DeviceArray, bfloat16, empty, memory_stats, to_device, zeros
from .ops import Executor, MoeInitRoutingV2Grad, empty_cache, execute, get_workspace_size, moe_init_routing_v2_grad
from .runtime import Device, Event, Stream, acl_version, current_device, device_count, soc_name
from .tensor import AclTensor

__version__ = "0.1.0"

__all__ = [
    "AclError",
    "AclRuntimeError",
    "AclTensor",
    "AclnnError",
    "CannNotFoundError",
    "Device",
    "DeviceArray",
    "Event",
    "Executor",
    "InvalidArgument",
    "LibraryInfo",
    "MoeInitRoutingV2Grad",
    "PyaclMoeError",
    "Stream",
    "__version__",
    "acl_version",
    "bfloat16",
    "current_device",
    "device_count",
    "emulator",
    "empty",
    "empty_cache",
    "execute",
    "get_workspace_size",
    "library_info",
    "load",
    "loaded_info",
    "memory_stats",
    "moe_init_routing_v2_grad",
    "reference",
    "soc_name",
    "status_name",
    "to_device",
    "use_emulator",
    "zeros",
]
