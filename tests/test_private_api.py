"""Private torch API is touched in one module, src/wf_mesh/_compat.py (docs/design.md, "Style"): every other
Python file of src/, tests/, benchmarks/ and examples/ is read with ast and may not use it. Neither may it use a
public torch name that exists only in some of the supported releases (VERSION_GATED): _compat names it once, with
its fallback.

Private use is: importing a torch module or name whose path has a ``_private`` part (``torch.utils._python_dispatch``,
``from torch.distributed.tensor import _redistribute``), an underscore attribute of anything imported from
torch (``torch._foreach_add_``, ``dist.distributed_c10d._world``), or an attribute _compat itself reaches
into torch objects for (``module._parameters``, ``dtensor._local_tensor``). Code only: docstrings and comments
may name private API."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPAT = ROOT / "src" / "wf_mesh" / "_compat.py"
FOLDERS = ("src", "tests", "benchmarks", "examples")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _from_torch(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] == "torch"


def torch_names(tree: ast.AST) -> set[str]:
    """The names a module binds to torch modules and objects (``torch``, ``dist``, ``nn``, ``DTensor``, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if _from_torch(a.name)}
        elif isinstance(node, ast.ImportFrom) and _from_torch(node.module):
            names |= {a.asname or a.name for a in node.names}
    return names


def private_uses(source: str, internals: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """``(line, what)`` for every private torch API use in ``source``; ``internals``: attribute names that are
    private API on whatever object they are read from."""
    tree = ast.parse(source)
    roots = torch_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _from_torch(a.name) and _has_private_part(a.name)]
        elif isinstance(node, ast.ImportFrom) and _from_torch(node.module):
            if _has_private_part(node.module) or any(_private(a.name) for a in node.names):
                found.append((node.lineno, f"from {node.module} import {', '.join(a.name for a in node.names)}"))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = _root(node.value)
            if base in roots or (node.attr in internals and base not in ("self", "cls")):
                found.append((node.lineno, ast.unparse(node)))
    return found


def _has_private_part(dotted: str) -> bool:
    return any(_private(part) for part in dotted.split("."))


def compat_internals() -> frozenset[str]:
    """The private attributes _compat reads from torch objects (beyond ``torch.*`` paths): the known internals."""
    tree = ast.parse(COMPAT.read_text())
    return frozenset(n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _private(n.attr))


FILES = sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py") if p != COMPAT and ".venv" not in p.parts)


def test_compat_is_the_only_module_touching_private_torch_api():
    internals = compat_internals()
    assert {"_parameters", "_local_tensor", "_world", "_foreach_copy_"} <= internals  # what the scan knows
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in FILES
        for line, what in private_uses(path.read_text(), internals)
    ]
    assert not offenders, "private torch API outside src/wf_mesh/_compat.py:\n" + "\n".join(offenders)


# public torch names that some supported release lacks or renamed; each has a _compat shim of the same name
VERSION_GATED = frozenset(
    {"all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor"}
)


def version_gated_uses(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every version-gated torch name read from a torch module or object in ``source``."""
    tree = ast.parse(source)
    roots = torch_names(tree)
    found = [
        (node.lineno, ast.unparse(node))
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in VERSION_GATED and _root(node.value) in roots
    ]
    found += [
        (node.lineno, f"from {node.module} import {a.name}")
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and _from_torch(node.module)
        for a in node.names
        if a.name in VERSION_GATED
    ]
    return found


def test_version_gated_torch_names_go_through_compat():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in FILES
        for line, what in version_gated_uses(path.read_text())
    ]
    assert not offenders, "version-gated torch names outside src/wf_mesh/_compat.py:\n" + "\n".join(offenders)


def test_every_version_gated_name_has_its_compat_shim():
    from wf_mesh import _compat

    assert {"all_gather_single", "reduce_scatter_single"} <= set(_compat.__all__)
    assert version_gated_uses("import torch.distributed as dist\ndist.all_gather_single(o, i)\n")
    assert version_gated_uses("from torch.distributed import reduce_scatter_single\n")
    assert version_gated_uses("import torch\ntorch.distributed.all_gather_into_tensor(o, i)\n")
    assert not version_gated_uses("from wf_mesh import _compat\n_compat.all_gather_single(o, i)\n")


PLANTED = {
    "foreach": "import torch\ntorch._foreach_add_(xs, ys)\n",
    "c10d world": "import torch.distributed as dist\nn = len(dist.distributed_c10d._world.pg_map)\n",
    "module registry": "def f(module):\n    return module._parameters\n",
    "local shard": "def f(dtensor):\n    return dtensor._local_tensor.shape\n",
    "private module": "from torch.utils._python_dispatch import TorchDispatchMode\n",
    "private name": "from torch.distributed.tensor import _redistribute\n",
    "import of a private module": "import torch.testing._internal.distributed.fake_pg\n",
    "imported object": "from torch.distributed.device_mesh import DeviceMesh\nDeviceMesh._flatten(m, 'x')\n",
    "call chain": "import torch\ntorch.distributed.distributed_c10d._get_default_group()._get_backend(d)\n",
}


@pytest.mark.parametrize("case", list(PLANTED))
def test_the_scan_finds_a_planted_use(case):
    assert private_uses(PLANTED[case], compat_internals()), case


def test_the_scan_leaves_public_api_and_own_attributes_alone():
    clean = (
        '"""Docs may name torch._foreach_add_ and module._parameters."""\n'
        "import os\nimport torch\nimport torch.distributed as dist\n"
        "print(torch.__version__, dist.get_rank())\n"
        "class A:\n    def f(self):\n        return self._parameters, self._world\n"
        "os._exit(0)\n"
    )
    assert private_uses(clean, compat_internals()) == []
