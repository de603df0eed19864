"""Two "nodes" of two processes each on loopback, joined by torchrun's multi-node c10d rendezvous, run the demo.

Each node is ``wf-mesh demo --nproc 2 --nnodes 2 --node-rank R --rdzv-endpoint 127.0.0.1:PORT --tp 2 --cp 2``,
i.e. ``python -m torch.distributed.run --nnodes 2 --node-rank R --rdzv-backend c10d --rdzv-endpoint ... --rdzv-id
... --nproc-per-node 2 -m wf_mesh.demo ...``: the path users take on a real cluster. The c10d rendezvous numbers
the nodes in the order they join, so either node may hold global rank 0 and print the summary.
"""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

TIMEOUT = 240  # seconds for both nodes together (each starts an agent and two workers that import torch)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(node_rank: int, endpoint: str, rdzv_id: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "wf_mesh.cli", "demo", "--nproc", "2", "--nnodes", "2", "--node-rank", str(node_rank),
        "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id, "--tp", "2", "--cp", "2",
    ]  # fmt: skip
    # a session of its own: on timeout the whole node (launcher, agent, workers) is killed at once
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


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
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv_id = f"wf-mesh-test-{uuid.uuid4().hex[:8]}"
    nodes = [start_node(rank, endpoint, rdzv_id) for rank in (0, 1)]
    results = wait_all(nodes, TIMEOUT)
    report = "\n".join(f"--- node {i}: rc={rc}\n{out}\n{err}" for i, (rc, out, err) in enumerate(results))
    assert [node.returncode for node in nodes] == [0, 0], report
    summaries = [out for _, out, _ in results if "demo OK" in out]
    assert len(summaries) == 1, report  # printed once, by the node that got global rank 0
    out = summaries[0]
    assert "wf-mesh demo: 4 ranks (2 nodes x 2 processes) on gloo/cpu" in out, report
    assert "demo OK: 4 ranks, 4 checks passed, 1 skipped" in out, report
    assert "FAIL" not in out and "ok   fsdp2 + ema:" in out, report
