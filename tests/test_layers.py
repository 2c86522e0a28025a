"""The layers of docs/ARCHITECTURE.md: every import of a package module (at module level or
inside a function) goes to a row below its own, or within its own package row."""

from __future__ import annotations

import ast
import pathlib

import pyacl_moe

PKG = pathlib.Path(pyacl_moe.__file__).parent

# Top to bottom, as ARCHITECTURE.md draws them. A name ending in "." is a package row, whose
# modules may import each other.
ROWS = [
    {"__init__", "cli"},
    {"torch", "tools."},
    {"emulator."},  # beside the stack, at the tools' height: it imports device and _cann only
    {"routing"},
    {"op."},
    {"tensor"},
    {"array"},
    {"host"},
    {"stream"},
    {"device"},
    {"_lifetime"},
    {"release"},
    {"_cann."},
    {"reference"},
    {"_contract"},
    {"_args"},
    {"errors"},
    {"_status", "_paths"},
]


def _row(module: str) -> tuple[int, str]:
    for i, row in enumerate(ROWS):
        for name in row:
            if module == name or (name.endswith(".") and (module + ".").startswith(name)):
                return i, name
    raise AssertionError(f"{module} is in no row of ARCHITECTURE.md")


def _imports(path: pathlib.Path, module: str) -> set[str]:
    """The package modules ``module`` imports (names relative to the package)."""
    out = set()
    package = module.split(".")[:-1]  # (for a package's __init__, the package itself)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                target = [*base, *(node.module.split(".") if node.module else [])]
                names = [[*target, a.name] for a in node.names] if node.module is None else [target]
            elif node.module and node.module.split(".")[0] == "pyacl_moe":
                names = [node.module.split(".")[1:]]
            else:
                continue
            for n in names:
                if n:
                    out.add(".".join(n))
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith("pyacl_moe.")}
    return out


def _resolve(name: str) -> str | None:
    """The module ``name`` is (a name imported from a package may be one of its modules)."""
    parts = name.split(".")
    while parts:
        p = PKG.joinpath(*parts)
        if p.with_suffix(".py").is_file():
            return ".".join(parts)
        if (p / "__init__.py").is_file():
            return ".".join(parts) + ".__init__" if parts else "__init__"
        parts = parts[:-1]
    return None


def test_every_import_goes_down_the_layers():
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        module = ".".join(rel.parts)
        mine, my_row = _row(module if module != "__init__" else "__init__")
        for name in _imports(path, module):
            target = _resolve(name)
            if target is None or target == "__init__":
                if target == "__init__" and my_row not in ("__init__", "cli"):
                    wrong.append(f"{module} imports the package's top")
                continue
            theirs, their_row = _row(target.removesuffix(".__init__"))
            if theirs < mine or (theirs == mine and their_row != my_row) or (
                    theirs == mine and not my_row.endswith(".") and target != module):
                wrong.append(f"{module} (row {mine}) imports {target} (row {theirs})")
    assert not wrong, "\n".join(wrong)
