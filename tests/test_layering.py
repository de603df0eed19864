"""The one direction of dependencies (docs/design.md, "Layers"): a module imports only from its own layer or
the layers below it. Read from the source with ast, so the rule holds for imports inside functions too."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "wf_mesh"

# layer of each module (dotted name under wf_mesh); packages: every module inside takes the package's layer
LAYERS = {
    # pure: no torch.distributed (no torch at import time)
    0: ["errors", "sizing", "topology", "masks", "load_balance", "ring_schedule"],
    1: [
        "_compat",
        "waits",
        "p2p",
        "agreement",
        "faults",
    ],  # torch glue: private torch API, bounded waits, point-to-point transfers, the agreement exchange, fault containment
    2: ["mesh"],  # the one mesh
    3: [
        "context_parallel",
        "collectives",
        "video",
        "ema",
        "state_sync",
        "pipeline",
        "attention",
        "attention_ops",
        "attention_kernels",
        "attention_plan",
        "kv_cache",
        "log",
        "bootstrap",
        "guidance",
    ],
    4: ["legacy"],  # the legacy layer: legacy functions, lifecycle and state (never parallel_state)
    5: ["parallel_state"],  # Megatron's / MAGI-1's module face over legacy.model_parallel
    6: ["compat"],  # worldfoundry's module tree over legacy/* and parallel_state
    7: [
        "viz",
        "testing",
        "process_tree",
        "cli",
        "demo",
        "__init__",
        "__main__",
        "integrations",
        "integrations.diffusers",
    ],  # surface
}
LAYER = {name: layer for layer, names in LAYERS.items() for name in names}
PURE = set(LAYERS[0])


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def layer_of(name: str) -> int:
    top = name.split(".")[0]
    assert top in LAYER, f"wf_mesh.{name} is in no layer: add it to LAYERS (and to docs/design.md)"
    return LAYER[top]


def is_module(name: str) -> bool:
    return (SRC / f"{name}.py").is_file() or (SRC / name / "__init__.py").is_file()


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, wf_mesh module) for every import of a wf_mesh module in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "wf_mesh":
            base = node.module.removeprefix("wf_mesh").lstrip(".")
            targets = [base] if base else [a.name if is_module(a.name) else "__init__" for a in node.names]
            found += [(node.lineno, t) for t in targets]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "wf_mesh" or alias.name.startswith("wf_mesh."):
                    found.append((node.lineno, alias.name.removeprefix("wf_mesh").lstrip(".") or "__init__"))
    return found


MODULES = sorted(p for p in SRC.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[module_name(p) for p in MODULES])
def test_imports_point_down(path):
    source = module_name(path)
    mine = layer_of(source)
    for line, target in imports(path):
        if target.split(".")[0] == source.split(".")[0]:
            continue  # inside one module or package
        assert layer_of(target) <= mine, (
            f"wf_mesh.{source} (layer {mine}) imports wf_mesh.{target} (layer {layer_of(target)}) at line {line}"
        )


@pytest.mark.parametrize("name", sorted(PURE))
def test_pure_modules_do_not_import_torch(name):
    tree = ast.parse((SRC / f"{name}.py").read_text())
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top_level if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in top_level if isinstance(n, ast.ImportFrom) and n.module]
    assert not [n for n in names if n.split(".")[0] in ("torch", "numpy", "einops")], names
