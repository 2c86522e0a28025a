"""The one helper for raw cffi access to the emulated libraries.

Declared from headers/ and the emulator's aclemu.h by an FFI object of its own, not through the
binding; the libraries are the same loaded objects the binding uses (dlopen returns the loaded
copy), so direct tests work in deltas.
"""

from __future__ import annotations

from pathlib import Path

import cffi

from pyacl_moe import emulator as emulator_mod

ROOT = Path(__file__).resolve().parent.parent
HEADER_FILES = (
    "acl_base.h", "acl_rt.h", "acl.h", "acl_meta.h", "aclnn_moe_init_routing_v2_grad.h",
    "aclnn_moe_init_routing_v2.h",
)


class Emu:
    """Direct cffi access to the emulated libraries."""

    SUCCESS = 0

    def __init__(self) -> None:
        self.home = emulator_mod.build()
        self.ffi = cffi.FFI()
        for name in HEADER_FILES:
            self.ffi.cdef((ROOT / "headers" / name).read_text())
        self.ffi.cdef((ROOT / "pyacl_moe" / "emulator" / "src" / "aclemu.h").read_text())
        self.ffi.cdef("void free(void *);")
        # In load order: a library finds its dependencies already loaded (they have no RUNPATH).
        self.libraries = dict(emulator_mod.library_paths())
        handles = {name: self.ffi.dlopen(path) for name, path in self.libraries.items()}
        self.acl, self.nn, self.op = handles["ascendcl"], handles["nnopbase"], handles["op"]
        self._keep = handles
        self.libc = self.ffi.dlopen(None)
        self.NULL = self.ffi.NULL

    # -- conveniences

    def msg(self) -> str:
        p = self.acl.aclGetRecentErrMsg()
        return self.ffi.string(p).decode() if p != self.NULL else ""

    def ok(self, status: int) -> None:
        assert status == 0, f"status {status}: {self.msg()}"

    def stats(self) -> dict[str, int]:
        s = self.ffi.new("aclemuStats *")
        self.acl.aclemuGetStats(s)
        return {n: int(getattr(s, n)) for n, _ in self.ffi.typeof("aclemuStats").fields}

    def malloc(self, size: int) -> object:
        p = self.ffi.new("void **")
        self.ok(self.acl.aclrtMalloc(p, size, 0))
        return p[0]

    # Empty copies are skipped: up to 9.0 CANN refuses a copy of 0 bytes (107000).
    def h2d(self, dev: object, data: bytes | bytearray | memoryview) -> None:
        buf = self.ffi.from_buffer(data)
        if len(buf):
            self.ok(self.acl.aclrtMemcpy(dev, len(buf), buf, len(buf), 1))

    def d2h(self, dev: object, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        cbuf = self.ffi.from_buffer(buf)
        if nbytes:
            self.ok(self.acl.aclrtMemcpy(cbuf, nbytes, dev, nbytes, 2))
        return bytes(buf)

    def tensor(self, shape, dtype: int, dev: object, strides=None, offset: int = 0, storage=None, fmt: int = 2):
        shape = list(shape)
        if strides is None:
            strides, acc = [], 1
            for n in reversed(shape):
                strides.insert(0, acc)
                acc *= n
        storage = list(storage) if storage is not None else shape
        t = self.nn.aclCreateTensor(
            self.ffi.new("int64_t[]", shape or [0]), len(shape), dtype,
            self.ffi.new("int64_t[]", list(strides) or [0]), offset, fmt,
            self.ffi.new("int64_t[]", storage or [0]), len(storage), dev,
        )
        assert t != self.NULL, self.msg()
        return t
