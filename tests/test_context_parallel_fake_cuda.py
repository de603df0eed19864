"""The CUDA path of gather_sequence without a GPU (tests/fake_cuda.py): fake CUDA tensors on torch's ``fake``
process group, this process as rank 0 of 4, an uneven sequence (4093 tokens: shards 1024, 1023, 1023, 1023).
Pinned: the one all-gather forward, the output's shape / dtype / device, and the backward of both grad rules
(called directly: autograd on fake CUDA tensors aborts a CPU-only build): "replicate" is a local slice (no
collective), "partial" one reduce-scatter. The agreement is an exchange of real CPU tensors: checks are off.
"""

from __future__ import annotations

import types

import pytest
import torch
from fake_cuda import fake_cuda, fake_process_group
from torch.distributed.device_mesh import init_device_mesh

import wf_mesh
from wf_mesh import agreement
from wf_mesh.context_parallel import _Gather, _Layout
from wf_mesh.sizing import chunk_sizes

CP, SEQ = 4, 4093


@pytest.fixture(scope="module")
def mesh():
    with fake_process_group(CP):
        agreement.set_checks(False)
        try:
            yield init_device_mesh("cpu", (CP,), mesh_dim_names=("cp",))
        finally:
            agreement.set_checks(None)


def test_gather_runs_one_all_gather_on_cuda_tensors(mesh):
    with fake_cuda() as recorder:
        x = torch.empty(2, chunk_sizes(SEQ, CP)[0], 64, dtype=torch.bfloat16, device="cuda")
        y = wf_mesh.gather_sequence(x, 1, mesh=mesh, seq_len=SEQ)
    assert (tuple(y.shape), y.dtype, y.device.type) == ((2, SEQ, 64), torch.bfloat16, "cuda")
    assert recorder.names("c10d") == {"c10d._allgather_base_.default"}


@pytest.mark.parametrize(("rule", "collectives"), [("replicate", set()), ("partial", {"reduce_scatter"})])
def test_gather_backward_on_cuda_tensors(mesh, rule, collectives):
    layout = _Layout(mesh.get_group(), 1, tuple(chunk_sizes(SEQ, CP)), 0)
    with fake_cuda() as recorder:
        grad = torch.empty(2, SEQ, 64, dtype=torch.bfloat16, device="cuda")
        mine, *_ = _Gather.backward(types.SimpleNamespace(layout=layout, rule=rule), grad)
    assert (tuple(mine.shape), mine.dtype, mine.device.type) == ((2, 1024, 64), torch.bfloat16, "cuda")
    assert {n for n in recorder.names("c10d") if "reduce_scatter" in n} == (
        {"c10d._reduce_scatter_base_.default"} if collectives else set()
    )
