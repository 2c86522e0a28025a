"""Ascend chips: the family a SoC name belongs to, and where the families run this op pair
differently.

The vendor builds the ops for three families (ops-transformer
``moe/moe_init_routing_v2_grad/op_host/moe_init_routing_v2_grad_def.cpp:42-54``,
``moe/moe_init_routing_v2/op_host/moe_init_routing_v2_def.cpp:104-146``):

- **Ascend910B** (Atlas A2: Ascend910B1 to B4) and **Ascend910_93** (Atlas A3): the same kernels
  and the same rules (the 910B kernel; ``op_kernel/moe_init_routing_v2_grad.cpp``).
- **Ascend950** (arch35, NpuArch DAV_3510: Ascend950PR_9599, Ascend950DT; CANN 8.5 named it
  Ascend910_95): kernels of its own (``op_kernel/moe_init_routing_v2_grad_apt.cpp`` and
  ``op_kernel/arch35/``). Its backward sums a token's terms from +0.0 in groups of four,
  ``((a+b)+(c+d))``, the rest one by one, K in chunks its tiling sizes from the UB; from
  v9.1.0.pre it reads an index outside the rows as a zero row instead of reading outside the
  input. Its forward takes INT64 and 1-D expert ids and an active_num <= 0. docs/emulator.md,
  "Chips", cites each rule.

A :class:`Chip` is one family's rules as one release ships them (``pyacl_moe.release.chip_for``
picks them by release; :func:`chip_named` gives the newest) with the numbers the 950's tiling
reads: vector (AIV) cores and UB bytes, as its platform reports them. They are the vendor's
figures where the repository states them (the 950's 64 AIV and 253,952 bytes of UB, in other
ops' unit tests that quote its platform file) and stated assumptions otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["FAMILIES", "Chip", "chip_named", "family_of"]


@dataclass(frozen=True)
class Chip:
    """A chip family's rules for this op pair, and the numbers its tiling reads."""

    family: str  # "Ascend910B", "Ascend910_93" or "Ascend950"
    soc: str  # the SoC name as CANN reports it (aclrtGetSocName)
    vector_cores: int  # AIV cores, as GetCoreNumAiv reports them
    ub_bytes: int  # unified buffer per core, as GetCoreMemSize(UB) reports it
    # The backward's summation: "tree" (the 910B's partial buffers and pairwise tree), "quads"
    # (arch35: +0.0, then ((a+b)+(c+d)) per four terms and the rest one by one, K in chunks) or
    # "sequential" (arch35 before 9.0.0-beta.2: +0.0, then each term in turn).
    summation: str
    # A backward index outside the rows that the scenario does not mark (-1 in drop/pad, >=
    # activeNum in active): "fault" (read outside the input: the device faults) or "zero" (read
    # as a zero row, in its place among the terms).
    invalid_index: str
    # The forward takes INT64 and 1-D expert ids (K = 1) and active_num <= 0 (N*K + active_num rows).
    forward_relaxed: bool
    release: str | None = None  # the release whose rules these are (None: the newest known)

    @property
    def arch35(self) -> bool:
        return self.family == "Ascend950"

    def describe(self) -> str:
        """One line for reports: the SoC, its family and what sets it apart."""
        if self.arch35:
            rows = "invalid indices read as zero rows" if self.invalid_index == "zero" else "invalid indices fault"
            return (f"{self.soc} ({self.family}, arch35: {self.vector_cores} vector cores, {self.ub_bytes} bytes of "
                    f"UB; {rows})")
        return f"{self.soc} ({self.family})"


# family -> (SoC name prefixes, the default SoC, AIV cores, UB bytes, summation, invalid index, forward relaxed)
# Atlas A2/A3: 20 or 24 AI Cores of two vector units; 192 KiB of UB (the figures differ by SKU:
# 910B1/B2 and the A3 24 cores, 910B3/B4 20; only the forward's workspace, 8 bytes a core, reads
# them). Ascend 950PR: 64 AIV and 253,952 bytes of UB (ops-transformer's unit tests quoting its
# platform file: mamba/causal_conv1d/tests/ut/op_host/test_causal_conv1d_tiling.cpp:73); the
# 950DT is taken to be the same (nothing states its figures).
FAMILIES: dict[str, tuple[tuple[str, ...], str, int, int, str, str, bool]] = {
    "Ascend910B": (("Ascend910B",), "Ascend910B3", 40, 196608, "tree", "fault", False),
    "Ascend910_93": (("Ascend910_93",), "Ascend910_9391", 48, 196608, "tree", "fault", False),
    "Ascend950": (("Ascend950", "Ascend910_95"), "Ascend950PR_9599", 64, 253952, "quads", "zero", True),
}
_CORES = {"Ascend910B1": 48, "Ascend910B2": 48, "Ascend910B2C": 48}


def family_of(soc: str | None) -> str | None:
    """The family of a SoC name (None for a name no family of this op claims)."""
    for family, (prefixes, *_rest) in FAMILIES.items():
        if soc and soc.startswith(prefixes):
            return family
    return None


def chip_named(soc: str | None) -> Chip:
    """The newest rules of the family ``soc`` belongs to (a SoC name, or a family name). A name
    no family claims (or None) gets the 910B's: the chip the op was first written for."""
    family = family_of(soc) or "Ascend910B"
    prefixes, default, cores, ub, summation, invalid, relaxed = FAMILIES[family]
    name = soc if soc and family_of(soc) else default
    if name == family:
        name = default
    return Chip(family, name, _CORES.get(name, cores), ub, summation, invalid, relaxed)


def with_release(chip: Chip, release: str | None, **rules: object) -> Chip:
    """``chip`` with the rules of ``release`` (pyacl_moe.release's table)."""
    return replace(chip, release=release, **rules)  # type: ignore[arg-type]
