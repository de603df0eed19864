"""The config keys ``dist_init`` reads, their accepted aliases, and the check that no distributed setting in a
config is silently ignored (pure: no torch).

A config (a dict, or any object with attributes: a dataclass, ``argparse.Namespace``, a pydantic model, a
module) may carry anything: real configs hold model and runtime fields beside the distributed ones (MAGI-1's
``EngineConfig`` has ``fp8_quant``, ``distill``, ``kv_offload``, ``enable_cuda_graph``), and those are left
alone. What is refused (:func:`check_keys`, one ValueError naming every such key):

- a **near-miss** of a key this module knows: the same name up to case and ``-`` / ``_`` (``CP_SIZE``,
  ``cp-size``), or one edit away (a letter added, dropped, changed or two swapped: ``cp_sizee``, ``cp_szie``;
  two edits for keys of 10 letters or more: ``dp_replicas``; none for names under 4 letters: ``c`` may be
  channels). An edit distance, not a similarity ratio: by
  ratio ``crop_size`` and ``step_size`` are as close to ``cp_size`` / ``tp_size`` as ``cp_szie`` is.
- **another framework's spelling** of a setting (:data:`FOREIGN`: torchtitan's ``*_degree``, xDiT's
  ``ulysses_degree``, vLLM's ``tensor_parallel_size``, ...) or a setting wf_mesh does not build
  (:data:`UNSUPPORTED`: expert parallelism, a virtual pipeline) set to anything but "off" (None or 1), naming
  the key to use.

Megatron's spellings (:data:`ALIASES`) are accepted: they are the keyword names of
:func:`wf_mesh.initialize_model_parallel` too. Both spellings of one setting with different values are an error
(:func:`read`). MAGI-1's ``cp_strategy`` and ``ulysses_overlap_degree`` (:data:`MAGI_ATTENTION`) are read and
checked but not applied: wf_mesh chooses the attention method per call (``cp_attention(method=...)``), not per
process (:func:`attention_note`).
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = [
    "ALIASES",
    "FOREIGN",
    "KEYS",
    "MAGI_ATTENTION",
    "MAGI_CP_STRATEGIES",
    "UNSUPPORTED",
    "attention_note",
    "check_keys",
    "config_entries",
    "near_misses",
    "read",
]

KEYS: dict[str, str] = {
    "distributed_backend": '"nccl", "gloo" or None (auto)',
    "distributed_timeout_minutes": "timeout of the default group and the subgroups (default 30)",
    "tp_size": "tensor-parallel degree",
    "cp_size": "context-parallel degree",
    "pp_size": "pipeline-parallel degree",
    "dp_size": "data-parallel degree (absent, None or -1: inferred)",
    "order": "rank order, fastest axis first",
    "cp_ulysses_size": "the Ulysses part of cp (USP attention)",
    "dp_replicate": "HSDP replicas",
}
"""The keys ``dist_init`` reads and applies."""

ALIASES: dict[str, str] = {
    "tensor_model_parallel_size": "tp_size",
    "context_parallel_size": "cp_size",
    "pipeline_model_parallel_size": "pp_size",
    "data_parallel_size": "dp_size",
}
"""Megatron's spellings, accepted for the key they name (as :func:`wf_mesh.initialize_model_parallel` accepts
them)."""

MAGI_CP_STRATEGIES = ("none", "cp_ulysses", "cp_shuffle_overlap")
"""MAGI-1's ``cp_strategy`` values."""

MAGI_ATTENTION: dict[str, str] = {
    "cp_strategy": f"MAGI-1's CP attention kernel ({', '.join(MAGI_CP_STRATEGIES)})",
    "ulysses_overlap_degree": "MAGI-1's compute/all-to-all overlap for cp_ulysses",
}
"""MAGI-1's attention settings: read and checked, not applied (wf_mesh chooses the method per call)."""

_VIRTUAL = "a virtual pipeline: use initialize_model_parallel(virtual_pipeline_model_parallel_size=...)"
UNSUPPORTED: dict[str, str] = {
    "ep_size": "expert parallelism, which wf_mesh does not shard",
    "expert_model_parallel_size": "expert parallelism, which wf_mesh does not shard",
    "virtual_pipeline_model_parallel_size": _VIRTUAL,
    "vpp_size": _VIRTUAL,
}
"""Settings ``dist_init`` does not build: allowed when off (None or 1), an error otherwise."""

_NO_CFG = "wf_mesh.init_from_env(ParallelDims(cfg=2)): dist_init builds no cfg axis"
FOREIGN: dict[str, str] = {
    "tp": "tp_size",
    "cp": "cp_size",
    "pp": "pp_size",
    "dp": "dp_size",
    "cp_ulysses": "cp_ulysses_size",
    "cfg": _NO_CFG,
    "tensor_parallel_size": "tp_size",
    "tensor_parallel_degree": "tp_size",
    "model_parallel_size": "tp_size",
    "mp_size": "tp_size",
    "context_parallel_degree": "cp_size",
    "sequence_parallel_size": "cp_size",
    "sp_size": "cp_size",
    "sp_degree": "cp_size",
    "ring_degree": "cp_size (= ring x ulysses) with cp_ulysses_size",
    "ulysses_degree": "cp_ulysses_size (with cp_size = ring x ulysses)",
    "pipeline_parallel_size": "pp_size",
    "pipeline_parallel_degree": "pp_size",
    "data_parallel_degree": "dp_size",
    "data_parallel_shard_degree": "dp_size (with dp_replicate)",
    "data_parallel_replicate_degree": "dp_replicate",
    "cfg_size": _NO_CFG,
    "cfg_degree": _NO_CFG,
    "cfg_parallel_size": _NO_CFG,
}
"""Other spellings (ParallelDims' own ``tp=``, ``cp=``, ...; torchtitan, xDiT, vLLM / SGLang, DeepSpeed) -> what to
use instead: allowed when off (None or 1; -1 too for the inferred data-parallel degrees), an error naming the key
otherwise."""

_INFERRED = ("dp", "data_parallel_degree", "data_parallel_shard_degree")
_KNOWN = (*KEYS, *ALIASES, *MAGI_ATTENTION, *UNSUPPORTED, *FOREIGN)


# ---- reading a config -------------------------------------------------------------------------------
def _has(config: Any, key: str) -> bool:
    return key in config if isinstance(config, dict) else hasattr(config, key)


def _get(config: Any, key: str) -> Any:
    return config[key] if isinstance(config, dict) else getattr(config, key)


def read(config: Any, key: str, default: Any) -> tuple[str, Any]:
    """The value of ``key`` (a :data:`KEYS` entry) in ``config``, under its name or its Megatron alias.

    Args:
        config: a dict or an object with attributes.
        key: the key to read.
        default: the value when neither spelling is there.

    Returns:
        ``(the name it was found under, its value)``; ``(key, default)`` when absent.

    Raises:
        ValueError: both spellings are given with different values.
    """
    names = [key, *(alias for alias, target in ALIASES.items() if target == key)]
    given = [(name, _get(config, name)) for name in names if _has(config, name)]
    if len(given) > 1 and any(value != given[0][1] for _, value in given[1:]):
        both = " and ".join(f"{name}={value!r}" for name, value in given)
        raise ValueError(f"dist_init: config {both} are two spellings of {key} with different values; give one")
    return given[0] if given else (key, default)


def config_entries(config: Any) -> Iterator[tuple[str, Any]]:
    """The settings a config holds: a dict's string keys, or an object's public data attributes (its instance
    attributes, and the class attributes of its type that are not methods, properties or other descriptors).

    Yields:
        ``(name, value)`` pairs, each name once.
    """
    if isinstance(config, dict):
        yield from ((k, v) for k, v in config.items() if isinstance(k, str))
        return
    seen: set[str] = set()
    instance = getattr(config, "__dict__", None)
    sources: list[Mapping[str, Any]] = [instance] if isinstance(instance, Mapping) else []
    owner = config if isinstance(config, type) else None if isinstance(config, types.ModuleType) else type(config)
    if owner is not None:  # class attributes are read by getattr too
        sources += [vars(cls) for cls in owner.__mro__ if cls is not object]
    for source in sources:
        for name, value in list(source.items()):
            if not isinstance(name, str) or name.startswith("_") or name in seen:
                continue
            seen.add(name)
            if callable(value) or hasattr(type(value), "__get__") or isinstance(value, types.ModuleType):
                continue  # methods, properties, classmethods, imported modules: not settings
            yield name, value


# ---- near-misses --------------------------------------------------------------------------------------
def _distance(a: str, b: str) -> int:
    """Optimal string alignment distance: insertions, deletions, substitutions, adjacent transpositions."""
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                current[j] = min(current[j], previous2[j - 2] + 1)
        previous2, previous = previous, current
    return previous[-1]


def _allowed_edits(known: str) -> int:
    """Edits a near-miss of ``known`` may be away: none for the short names (``cp``: ``c`` may be channels)."""
    return 0 if len(known) < 4 else 1 if len(known) < 10 else 2


def _normal(name: str) -> str:
    return name.lower().replace("-", "_")


def near_misses(name: str) -> list[str]:
    """The known keys ``name`` is a near-miss of (module docstring), closest first; [] for a known key.

    Args:
        name: a config key.

    Returns:
        The known keys it probably means.
    """
    if name in _KNOWN:
        return []
    normal = _normal(name)
    if normal in _KNOWN:
        return [normal]
    close = [(_distance(normal, known), known) for known in _KNOWN]
    close = [(d, known) for d, known in close if d <= _allowed_edits(known)]
    return [known for d, known in sorted(close) if d == close[0][0]] if close else []


# ---- the check ------------------------------------------------------------------------------------------
def _off(key: str, value: Any) -> bool:
    if value is None:
        return True
    if type(value) is not int:
        return False
    return value == 1 or (value == -1 and key in _INFERRED)


def _accepted() -> str:
    aliases = ", ".join(f"{alias} ({target})" for alias, target in ALIASES.items())
    return (
        f"dist_init reads {', '.join(KEYS)}; Megatron's {aliases}; MAGI-1's {', '.join(MAGI_ATTENTION)} "
        "(checked, not applied); other keys are ignored"
    )


def check_keys(config: Any) -> None:
    """Refuse the near-misses and the foreign or unsupported settings of ``config`` (module docstring).

    Args:
        config: a dict or an object with attributes (``dist_init``'s config, after ``engine_config``).

    Raises:
        ValueError: naming every such key, what to use instead, and the accepted names.
    """
    problems = []
    for name, value in config_entries(config):
        close = near_misses(name)
        if close:
            problems.append(f"{name!r} is not a key dist_init reads (did you mean {' or '.join(map(repr, close))}?)")
        elif name in FOREIGN and not _off(name, value):
            problems.append(f"{name}={value!r} is not read by dist_init: use {FOREIGN[name]}")
        elif name in UNSUPPORTED and not _off(name, value):
            problems.append(f"{name}={value!r} asks for {UNSUPPORTED[name]}; only None or 1 is accepted")
    if problems:
        raise ValueError(f"dist_init: config {'; '.join(problems)}. {_accepted()}")


def attention_note(cp_strategy: Any, overlap: Any) -> str | None:
    """Check MAGI-1's attention settings; say what wf_mesh does instead when one asks for something.

    Args:
        cp_strategy: ``cp_strategy`` (None when absent).
        overlap: ``ulysses_overlap_degree`` (None when absent).

    Returns:
        None when both are off (absent, ``"none"``, 1), else the sentence ``dist_init`` warns with.

    Raises:
        TypeError: ``cp_strategy`` is not a str, or ``ulysses_overlap_degree`` not an int.
        ValueError: ``ulysses_overlap_degree`` < 1.
    """
    if cp_strategy is not None and not isinstance(cp_strategy, str):
        raise TypeError(
            f"dist_init: config cp_strategy must be a str (one of {', '.join(MAGI_CP_STRATEGIES)}), got "
            f"{type(cp_strategy).__name__} {cp_strategy!r}"
        )
    if overlap is not None:
        if type(overlap) is not int:
            raise TypeError(
                f"dist_init: config ulysses_overlap_degree must be an int, got {type(overlap).__name__} {overlap!r}"
            )
        if overlap < 1:
            raise ValueError(f"dist_init: config ulysses_overlap_degree={overlap} must be >= 1")
    notes = []
    if cp_strategy not in (None, "none"):
        method = {"cp_ulysses": "'ulysses'", "cp_shuffle_overlap": "'ring' (the closest: overlapped K/V hops)"}
        instead = method.get(str(cp_strategy), "'ring', 'ulysses', 'usp' or 'allgather'")
        notes.append(f"cp_strategy={cp_strategy!r}: pass method={instead} to cp_attention / CPSelfAttention")
    if overlap not in (None, 1):
        notes.append(f"ulysses_overlap_degree={overlap}: wf_mesh has no such setting")
    if not notes:
        return None
    return (
        f"dist_init: MAGI-1's attention settings are not applied (wf_mesh chooses the CP attention method per "
        f"call): {'; '.join(notes)}"
    )
