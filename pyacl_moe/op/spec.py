"""What the op layer needs to know of an operator: its API stem and its first phase's
parameters in C order, each an input tensor, an output tensor or an attribute. That table is
the single description of the operator's slots: aclSetInputTensorAddr/aclSetOutputTensorAddr
indices, what a launch reads and writes, and the first phase's argument list all come from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import _args

__all__ = ["OpSpec", "Param"]


@dataclass(frozen=True)
class Param:
    """One parameter of the first phase: ``kind`` is "input", "output" or "attr"; ``c_name`` is
    the vendor's name for it in the C prototype (for a reader matching the table against the
    vendor's header); ``convert`` an attribute's check of its C type
    (``convert(name, value)``, raising InvalidArgument by name)."""

    name: str
    kind: str
    c_name: str
    convert: Callable[[str, Any], Any] = _args.int64


@dataclass(frozen=True)
class OpSpec:
    """An aclnn operator: ``api`` is the stem (``<api>GetWorkspaceSize`` and ``<api>``)."""

    api: str
    params: tuple[Param, ...]
    inputs: tuple[str, ...] = field(init=False)
    outputs: tuple[str, ...] = field(init=False)
    attrs: tuple[str, ...] = field(init=False)
    tensors: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        for kind in ("input", "output", "attr"):  # the fields inputs, outputs and attrs
            object.__setattr__(self, kind + "s", tuple(p.name for p in self.params if p.kind == kind))
        object.__setattr__(self, "tensors", self.inputs + self.outputs)

    def attr_values(self, *values: Any) -> dict[str, Any]:
        """The attributes' ``values`` (in ``attrs`` order) in their C types, each refused by
        name."""
        return {p.name: p.convert(p.name, v) for p, v in zip([p for p in self.params if p.kind == "attr"], values)}

    def slot(self, name: str) -> tuple[str, int]:
        """("input" or "output", index) of a tensor parameter, as aclSet*TensorAddr take it: its
        place among the op's tensors of its kind, an optional one passed as a null pointer
        included (nnopbase keeps a slot for it, marked null)."""
        kind = "input" if name in self.inputs else "output"
        return kind, getattr(self, kind + "s").index(name)
