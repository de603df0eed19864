"""The examples in the library's docstrings run and show what they say (``>>>`` blocks, via doctest)."""

import doctest
import importlib

import pytest

MODULES = ["wf_mesh.topology", "wf_mesh.sizing", "wf_mesh.masks", "wf_mesh.viz", "wf_mesh.legacy.context_parallel"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, result


def test_every_module_with_examples_is_listed():
    from pathlib import Path

    src = Path(importlib.import_module("wf_mesh").__file__).parent
    with_examples = {
        "wf_mesh." + ".".join(p.relative_to(src).with_suffix("").parts)
        for p in src.rglob("*.py")
        if ">>>" in p.read_text()
    }
    assert with_examples == set(MODULES)
