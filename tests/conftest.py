"""Shared test setup: the pooled gloo clusters of wf_mesh.testing live for the whole session."""

import pytest

from wf_mesh.testing import shutdown_clusters


@pytest.fixture(scope="session", autouse=True)
def _stop_clusters_at_end():
    yield
    shutdown_clusters()
