"""Shared test setup: the pooled gloo clusters of wf_mesh.testing live for the whole session."""

import os
import shutil
import tempfile

import pytest

from wf_mesh.testing import shutdown_clusters

# Inductor's on-disk caches key a graph by its inputs, not by a custom op's fake kernel: a graph compiled
# before a change to wf_mesh's op strides would be reused and fail its stride asserts. Each session (and the
# processes it starts, which inherit the environment: cluster workers, and pytest-xdist's workers, which share
# the directory the controller made) compiles into a fresh directory; the process that made it removes it.
_INDUCTOR_CACHE = None if "TORCHINDUCTOR_CACHE_DIR" in os.environ else tempfile.mkdtemp(prefix="wf_mesh-inductor-")
if _INDUCTOR_CACHE:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE


@pytest.fixture(scope="session", autouse=True)
def _stop_clusters_at_end():
    yield
    shutdown_clusters()


def pytest_unconfigure(config):
    # here, not in the session fixture: under xdist the controller, which made the directory, runs no tests
    if _INDUCTOR_CACHE:
        shutil.rmtree(_INDUCTOR_CACHE, ignore_errors=True)
