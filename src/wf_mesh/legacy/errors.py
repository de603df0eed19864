"""The exceptions of the legacy contract: native wf_mesh errors that are also ``AssertionError``.

Megatron's ``parallel_state`` and the original ``worldfoundry`` package ``assert`` where wf_mesh raises a precise
type, and their callers catch ``AssertionError``. The native types (:mod:`wf_mesh.errors`) are not assertions;
the legacy functions raise these subclasses, which are both. :func:`asserting` turns a native error raised
below a legacy function into its legacy subclass (same message, same traceback).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from wf_mesh.errors import IndivisibleSequenceError, NotInitializedError, StateError

__all__ = [
    "LegacyIndivisibleSequenceError",
    "LegacyNotInitializedError",
    "LegacyStateError",
    "PipelineStateError",
    "asserting",
]


class LegacyStateError(StateError, AssertionError):
    """:class:`~wf_mesh.errors.StateError` (a RuntimeError) that is also the AssertionError legacy code expects."""


class LegacyNotInitializedError(NotInitializedError, LegacyStateError):
    """:class:`~wf_mesh.errors.NotInitializedError` that is also an AssertionError (Megatron asserts there)."""


class PipelineStateError(LegacyStateError):
    """The process-wide PP scheduler is used before :func:`~wf_mesh.init_pp_scheduler`, or created twice."""


class LegacyIndivisibleSequenceError(IndivisibleSequenceError, AssertionError):
    """:class:`~wf_mesh.errors.IndivisibleSequenceError` (a ValueError) that is also an AssertionError."""


# native type -> its legacy subclass; the most specific first
_LEGACY: tuple[tuple[type[Exception], type[Exception]], ...] = (
    (NotInitializedError, LegacyNotInitializedError),
    (StateError, LegacyStateError),
    (IndivisibleSequenceError, LegacyIndivisibleSequenceError),
)


@contextlib.contextmanager
def asserting() -> Iterator[None]:
    """Re-raise a native StateError / NotInitializedError / IndivisibleSequenceError from the block as its
    legacy subclass (also an AssertionError), with the same message and traceback.

    Raises:
        LegacyStateError: (or LegacyNotInitializedError, LegacyIndivisibleSequenceError) for the native error
            raised inside.
        AssertionError: one raised inside, unchanged (as is anything else).
    """
    try:
        yield
    except AssertionError:
        raise
    except (StateError, IndivisibleSequenceError) as exc:
        legacy = next(new for native, new in _LEGACY if isinstance(exc, native))
        raise legacy(*exc.args).with_traceback(exc.__traceback__) from None
