"""Register a package under another import name (``sys.modules``), for code bases that cannot edit their
imports: after ``install_alias("worldfoundry.core.distributed", "wf_mesh.compat.worldfoundry")``,
``import worldfoundry.core.distributed.context_parallel`` gives ``wf_mesh.compat.worldfoundry.context_parallel``
(the same module object).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import pkgutil
import sys
import types

__all__ = ["install_alias"]

ALIAS_MARK = "__wf_mesh_alias_of__"
"""Attribute of the empty parent packages install_alias creates: the package the alias stands for."""


def _tree(alias: str, package: str) -> dict[str, types.ModuleType]:
    """``{alias name: module}`` for ``package`` and every module under it (all imported)."""
    root = importlib.import_module(package)
    tree = {alias: root}
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        tree[alias + info.name[len(package) :]] = importlib.import_module(info.name)
    return tree


def _refuse_foreign(tree: dict[str, types.ModuleType], package: str) -> None:
    for name, module in tree.items():
        present = sys.modules.get(name)
        if present is not None and present is not module:
            where = getattr(present, "__file__", None) or f"{present!r} (no file)"
            raise ImportError(
                f"install(): {name!r} is already imported from {where}, which is not {module.__name__!r}; "
                f"{package!r} cannot take its place. Call install() before anything imports {name!r}, or "
                "uninstall the original package",
                name=name,
                path=getattr(present, "__file__", None),
            )


def _parent(name: str, package: str) -> types.ModuleType:
    """The parent package ``name``: already imported, else the real one if there is one, else an empty one."""
    if name in sys.modules:
        return sys.modules[name]
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:  # its own parent is not a package
        spec = None
    if spec is not None:
        return importlib.import_module(name)
    module = types.ModuleType(name, f"Empty parent package of the alias of {package!r} (wf_mesh install()).")
    module.__path__ = []
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    setattr(module, ALIAS_MARK, package)
    sys.modules[name] = module
    return module


def install_alias(alias: str, package: str) -> types.ModuleType:
    """Make ``alias`` and ``alias.<sub>`` import ``package`` and ``package.<sub>`` (every module under it).

    Parent packages of ``alias`` that are not imported yet are imported when they exist, else created
    empty. Idempotent.

    Returns:
        The package.

    Raises:
        ImportError: (naming the module and its file) a different module is already imported under one of
            the names; nothing is registered then.
    """
    tree = _tree(alias, package)
    _refuse_foreign(tree, package)
    parts = alias.split(".")
    for i in range(1, len(parts)):
        _parent(".".join(parts[:i]), package)
    _refuse_foreign(tree, package)  # importing a real parent package may have imported the original
    for name in sorted(tree, key=lambda n: n.count(".")):
        sys.modules[name] = tree[name]
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, tree[name])
    for i in range(2, len(parts)):  # link the parent packages to each other
        setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], sys.modules[".".join(parts[:i])])
    return tree[alias]
