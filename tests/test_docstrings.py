"""Every public name, property and method of the package says what it is."""

from __future__ import annotations

import inspect

import pyacl_moe as pm


def test_every_public_property_and_method_has_a_docstring():
    missing = []
    for name in pm.__all__:
        obj = getattr(pm, name)
        if inspect.ismodule(obj):
            continue
        if not (getattr(obj, "__doc__", None) or "").strip():
            missing.append(name)
        if not inspect.isclass(obj):
            continue
        for klass in obj.__mro__:
            if not klass.__module__.startswith("pyacl_moe"):
                continue
            for attr, value in vars(klass).items():
                if attr.startswith("_"):
                    continue
                if isinstance(value, property) or inspect.isfunction(value) or isinstance(value, classmethod):
                    fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
                    if not (fn.__doc__ or "").strip():
                        missing.append(f"{name}.{attr}")
    assert not missing, f"no docstring: {sorted(set(missing))}"
