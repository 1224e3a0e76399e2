"""Package attributes imported on first use (PEP 562 module ``__getattr__``): a package's public names without
importing their modules, and so JAX, until someone asks for one. No library does this for a plain mapping of names
to modules (``lazy_loader`` reads stub files), hence these few lines."""

from __future__ import annotations

import importlib


def lazy_exports(namespace: dict, exports: dict[str, str]):
    """(``__getattr__``, ``__dir__``) for a package whose ``namespace`` (its ``globals()``) exports each name of
    ``exports`` from the module it maps to; a name once looked up is kept in the namespace."""
    package = namespace["__name__"]

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
