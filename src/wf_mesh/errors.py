"""The exceptions wf_mesh raises beyond Python's own (pure: importing this module imports nothing else).

Several inherit from two built-in types on purpose (a precise type, and the built-in type callers already
catch there). None is an ``AssertionError``: the legacy functions, whose contract is one, raise the subclasses
of :mod:`wf_mesh.legacy.errors`.
"""

from __future__ import annotations

__all__ = [
    "CollectiveTimeoutError",
    "DegreeError",
    "DisagreementError",
    "IndivisibleSequenceError",
    "NotInitializedError",
    "ShapeMismatchError",
    "StateError",
]


class DegreeError(ValueError, RuntimeError):
    """Parallel degrees that do not fit each other or the world size (``tp*cp*pp*dp != world_size``, a bad
    order, ``cp_ulysses`` not dividing cp, ...). A ValueError, and a RuntimeError as Megatron raises there."""


class CollectiveTimeoutError(TimeoutError, RuntimeError):
    """A wf_mesh collective waited the group's whole timeout for a peer that did not answer (a stuck or too
    slow rank, not a killed one). A TimeoutError, and a RuntimeError as the backends raise there."""


class DisagreementError(RuntimeError, ValueError):
    """Ranks passed different values for something a collective call needs them to agree on (``seq_dim``,
    ``seq_len``, the mesh, a bucket size, ...). Raised on EVERY rank of the group, before any data moves,
    naming each rank's value."""


class ShapeMismatchError(DisagreementError):
    """Ranks disagree about a tensor's shape or dtype (raised on every rank, before any data moves).

    A RuntimeError (what legacy callers catch around a failed gather) and a ValueError (what it is).
    """


class IndivisibleSequenceError(ValueError):
    """A length that must divide evenly does not."""


class StateError(RuntimeError):
    """wf_mesh state used out of order: before initialization, or initialized twice."""


class NotInitializedError(StateError):
    """Model parallel (the mesh) is used before it was initialized."""
