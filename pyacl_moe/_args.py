"""Argument checks shared by every public entry point.

Each refuses a wrong type or an out-of-range value with :class:`InvalidArgument` naming the
parameter and the rule, before anything reaches CANN, so that a caller never sees an
AttributeError, an OverflowError or a raw cffi error for a bad argument. Pure Python.
"""

from __future__ import annotations

import operator
from typing import Any, TypeVar

import numpy as np

from .errors import InvalidArgument

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT64 = (0, 2**64 - 1)
# What a size in bytes may be: CANN's size_t and uint64_t, but also offsets computed from it
# in int64 arithmetic, so the smaller range.
MAX_BYTES = 2**63 - 1

T = TypeVar("T")


def integer(name: str, value: Any, lo: int, hi: int) -> int:
    """``value`` as an int in [lo, hi]: Python and NumPy integers pass, bools, floats and
    strings do not (a float is never truncated)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise InvalidArgument(name, f"must be an int, got bool {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidArgument(name, f"must be an int, got {type(value).__name__} {value!r}") from None
    if not lo <= v <= hi:
        raise InvalidArgument(name, f"must be an int in [{lo}, {hi}], got {v}")
    return v


def int32(name: str, value: Any, lo: int = INT32[0]) -> int:
    return integer(name, value, lo, INT32[1])


def int64(name: str, value: Any, lo: int = INT64[0]) -> int:
    return integer(name, value, lo, INT64[1])


def uint64(name: str, value: Any) -> int:
    return integer(name, value, *UINT64)


def boolean(name: str, value: Any) -> bool:
    """``value`` as a bool: Python's and NumPy's bools pass, nothing else does (1 is not
    True: an int where a flag belongs is more likely a mistake than a choice)."""
    t = type(value)
    if t is bool or (t.__module__ == "numpy" and t.__name__ in ("bool", "bool_")):
        return bool(value)
    raise InvalidArgument(name, f"must be a bool, got {t.__name__} {value!r}")


def instance(name: str, value: Any, cls: type[T], what: str | None = None) -> T:
    """``value`` itself if it is a ``cls``; InvalidArgument otherwise."""
    if not isinstance(value, cls):
        raise InvalidArgument(name, f"must be {what or 'a ' + cls.__name__}, got {type(value).__name__}")
    return value


def dtype(name: str, value: Any) -> np.dtype:
    """A NumPy dtype from anything ``np.dtype`` takes."""
    try:
        return np.dtype(value)  # type: ignore[no-any-return]  # np.dtype() of Any is typed Any
    except TypeError:
        raise InvalidArgument(name, f"{value!r} is not a numpy dtype") from None


def shape(name: str, value: Any) -> tuple[int, ...]:
    """A shape: an int or a sequence of ints, each in [0, 2**63) (a string is not a shape)."""
    if isinstance(value, (str, bytes, bytearray)):
        raise InvalidArgument(name, f"must be an int or a sequence of ints, got {type(value).__name__} {value!r}")
    if hasattr(value, "__index__"):
        value = (value,)
    try:
        items = list(value)
    except TypeError:
        raise InvalidArgument(
            name, f"must be an int or a sequence of ints, got {type(value).__name__} {value!r}"
        ) from None
    return tuple(integer(f"{name}[{i}]", n, 0, INT64[1]) for i, n in enumerate(items))


def nbytes(name: str, dims: tuple[int, ...], itemsize: int, makes: str = "") -> int:
    """The bytes a C-contiguous array of ``dims`` needs, refused when it cannot be addressed
    (a product past int64 would otherwise wrap around to a tiny allocation). ``makes``: the
    array's name when ``name`` is a parameter that sizes it."""
    total = itemsize
    for n in dims:
        total *= n
    if total > MAX_BYTES:
        raise InvalidArgument(
            name, (f"makes {makes} " if makes else "")
            + f"{dims} of {itemsize}-byte items, {total} bytes: more than {MAX_BYTES} cannot be addressed"
        )
    return total
