"""pyacl-moe: Python binding to CANN's aclnnMoeInitRoutingV2Grad (the backward of MoE token
routing), through the real C ABI, with NumPy in and out.

Importing the package loads nothing. The first call that needs CANN loads libascendcl.so,
libnnopbase.so and the op's library (libopapi_transformer.so from 8.5, libopapi.so before) from
the installed CANN (see :func:`load`), or the bundled emulator after :func:`use_emulator` /
``PYACL_MOE_EMULATOR=1``; :func:`cann_version` says which release it is.

The public API, re-exported here; see docs/ARCHITECTURE.md for the layers behind it.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import reference, release, routing
from ._cann import loader as _loader
from ._cann.loader import LibraryInfo, library_info, load, loaded_info
from .array import DeviceArray, bfloat16, empty, from_pointer, from_torch, to_device, zeros
from .device import (
    Device,
    acl_version,
    current_device,
    device_count,
    empty_cache,
    memory_stats,
    pinned_empty,
    set_caching,
    soc_name,
)
from .errors import (
    AclError,
    AclnnError,
    AclRuntimeError,
    CannNotFoundError,
    ClosedError,
    InvalidArgument,
    PyaclMoeError,
    status_name,
)
from .op.executor import Executor, execute
from .op.moe_init_routing_v2 import MoeInitRoutingV2, RoutingResult, moe_init_routing_v2
from .op.moe_init_routing_v2_grad import MoeInitRoutingV2Grad, get_workspace_size, moe_init_routing_v2_grad
from .release import CannVersion, cann_version
from .stream import Event, Stream, current_stream
from .tensor import AclTensor

__version__ = "0.2.0"

# The loader finds the bundled emulator, when asked for it, through this registration: its
# home imports the emulator's package (which adds its declarations) and builds it, then only.
_loader.register_provider(_loader.Provider(_loader.EMULATOR,
                                           lambda: importlib.import_module(".emulator", __name__).build()))


def use_emulator() -> None:
    """Bind this process to the bundled emulator (see :func:`pyacl_moe.emulator.use_emulator`)."""
    from . import emulator  # imported only when asked for: its declarations join the FFI then

    emulator.use_emulator()


def __getattr__(name: str) -> Any:
    # ``pm.emulator`` imports the emulator package on first use (PEP 562): importing pyacl_moe
    # itself neither builds it nor declares its extras.
    # ``pm.torch`` likewise imports torch and registers the operators only when asked for.
    if name in ("emulator", "torch"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "AclError",
    "AclRuntimeError",
    "AclTensor",
    "AclnnError",
    "CannNotFoundError",
    "CannVersion",
    "ClosedError",
    "Device",
    "DeviceArray",
    "Event",
    "Executor",
    "InvalidArgument",
    "LibraryInfo",
    "MoeInitRoutingV2",
    "MoeInitRoutingV2Grad",
    "PyaclMoeError",
    "Stream",
    "__version__",
    "acl_version",
    "bfloat16",
    "cann_version",
    "current_device",
    "current_stream",
    "device_count",
    "emulator",
    "empty",
    "empty_cache",
    "execute",
    "from_pointer",
    "from_torch",
    "get_workspace_size",
    "library_info",
    "load",
    "loaded_info",
    "memory_stats",
    "pinned_empty",
    "moe_init_routing_v2_grad",
    "RoutingResult",
    "moe_init_routing_v2",
    "reference",
    "release",
    "routing",
    "set_caching",
    "soc_name",
    "status_name",
    "to_device",
    "use_emulator",
    "zeros",
]
