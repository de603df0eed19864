"""Two "nodes" on loopback joined by torchrun's multi-node c10d rendezvous run the demo; a node alone gives up.

Each node is ``wf-mesh demo --nproc 1 --nnodes 2 --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID --cp 2``, i.e.
torchrun with ``--nnodes 2 --rdzv-backend c10d --rdzv-endpoint ... --rdzv-id ...``: the path users take on a real
cluster. The c10d rendezvous numbers the nodes in the order they join, so either node may hold global rank 0
and print the summary.
"""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from helpers import MARKER, marked

pytestmark = pytest.mark.slow  # every test here starts processes of its own

TIMEOUT = 240  # seconds for both nodes together (each starts an agent and a worker that import torch)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(endpoint: str, rdzv_id: str, marker: str, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "wf_mesh.cli",
        "demo",
        "--nproc",
        "1",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        rdzv_id,
        "--cp",
        "2",
        *extra,
    ]
    # a session of its own: on timeout the whole node (front, launcher, worker) is killed at once
    env = {**os.environ, MARKER: marker}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env
    )


def wait_all(nodes: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    deadline = time.monotonic() + timeout
    try:
        outputs = [node.communicate(timeout=max(1.0, deadline - time.monotonic())) for node in nodes]
        return [(node.returncode, out, err) for node, (out, err) in zip(nodes, outputs)]
    except subprocess.TimeoutExpired:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
        outputs = [node.communicate() for node in nodes]
        raise AssertionError(f"the nodes did not finish within {timeout} s; output: {outputs}") from None


def test_demo_on_two_nodes_over_c10d_rendezvous():
    endpoint, rdzv_id, marker = f"127.0.0.1:{free_port()}", f"wf-mesh-test-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    nodes = [start_node(endpoint, rdzv_id, marker) for _ in range(2)]
    results = wait_all(nodes, TIMEOUT)
    report = "\n".join(f"--- node {i}: rc={rc}\n{out}\n{err}" for i, (rc, out, err) in enumerate(results))
    assert [rc for rc, _, _ in results] == [0, 0], report
    assert [err for _, _, err in results] == ["", ""], report
    for _, out, _ in results:
        assert out.startswith(
            "wf-mesh demo: launching 1 CPU process on this node of 2 (2 ranks in all) with "
            "torchrun: ParallelDims(tp=1, cp=2, pp=1, dp=1, order='tp-cp-pp-dp')\n"
        ), report
    summaries = [out for _, out, _ in results if "demo OK" in out]
    assert len(summaries) == 1, report  # printed once, by the node that got global rank 0
    out = summaries[0]
    assert "wf-mesh demo: 2 ranks (2 nodes x 1 process) on gloo/cpu" in out, report
    assert "demo OK: 2 ranks, 4 of 5 checks passed, 1 skipped (pipeline ring)" in out, report
    assert "FAIL" not in out and "ok   cp video split: (2, 4, 4, 8, 6) latent over cp=2" in out, report
    assert marked(marker) == []


def test_a_node_alone_says_what_it_waits_for_and_gives_up_after_the_rdzv_timeout():
    endpoint, marker = f"127.0.0.1:{free_port()}", uuid.uuid4().hex
    node = start_node(endpoint, "wf-mesh-test-alone", marker, "--rdzv-timeout", "4")
    ((rc, out, err),) = wait_all([node], TIMEOUT)
    waiting = (
        f"waiting for 2 nodes to join the c10d rendezvous at {endpoint} (id wf-mesh-test-alone); "
        "giving up after 4 s (--rdzv-timeout)"
    )
    lines = out.splitlines()
    assert rc == 1, out + err
    assert lines[0].startswith("wf-mesh demo: launching 1 CPU process on this node of 2")
    assert len(lines) >= 2 and all(line.startswith("wf-mesh demo: [") and line.endswith(waiting) for line in lines[1:])
    assert err == (
        f"wf-mesh demo: error: gave up after 4 s waiting for 2 nodes to join the c10d rendezvous at {endpoint} "
        "(id wf-mesh-test-alone); is it running on every node, with the same --rdzv-endpoint and --rdzv-id?\n"
    )
    assert marked(marker) == []  # the launcher it started is gone too
