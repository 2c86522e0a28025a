"""The bindings layer: the only code that touches cffi.

- :mod:`.declare` - the FFI object, fed from headers/; constants read back from it.
- :mod:`.loader` - the library search, dlopen, providers (the emulator registers one).
- :mod:`.errcheck` - the one status check.
- :mod:`.handles` - owned handles and their exactly-once release.
- :mod:`.acl`, :mod:`.aclnn`, :mod:`.aclemu` - thin wrappers, grouped by header.

Everything above this package passes and receives plain Python values (ints for addresses) and
the handle objects defined here, which it never looks into.
"""
