"""The emulator package's errors, apart so that the builder and the environment check both
use them without importing each other."""

from __future__ import annotations

__all__ = ["EmulatorBuildError"]


class EmulatorBuildError(RuntimeError):
    """The emulator could not be compiled: no compiler, or the compiler failed."""
