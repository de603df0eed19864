"""The CUDA path of KV-cache decoding without a GPU (tests/fake_cuda.py): fake CUDA tensors at the sizes of a
video world model (bf16, 16 query heads over 4 kv heads, head dim 128, chunks of 4096 tokens, cp 4) on torch's
``fake`` process group, this process as rank 0 of 4. No value is computed: these tests pin WHICH kernel a layer
call runs (flash), that it makes no host sync, and that nothing ``chunk x cache`` sized is allocated. The
per-chunk agreement is an exchange of real CPU tensors (it cannot run on fake ones): checks are off here, so
``next_chunk`` runs its local validation only.
"""

from __future__ import annotations

import collections

import pytest
import torch
from fake_cuda import fake_cuda, fake_process_group
from torch.distributed.device_mesh import init_device_mesh

import wf_mesh
from wf_mesh import agreement
from wf_mesh.testing import host_syncs

CP, CHUNK, HEADS, KV_HEADS, HEAD_DIM, CHUNKS = 4, 4096, 16, 4, 128, 3
FLASH = "aten._scaled_dot_product_flash_attention.default"


@pytest.fixture(scope="module")
def mesh():
    with fake_process_group(CP):
        yield init_device_mesh("cpu", (CP,), mesh_dim_names=("cp",))


@pytest.fixture
def checks_off():
    agreement.set_checks(False)
    yield
    agreement.set_checks(None)


def test_a_layer_call_runs_the_flash_kernel_with_no_host_sync(mesh, checks_off):
    cache = wf_mesh.KVCache(
        mesh=mesh, layers=2, batch=1, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16,
        device="cuda", capacity=CHUNKS * CHUNK // CP,
    )  # fmt: skip
    syncs = collections.Counter()
    with fake_cuda() as recorder:
        for _ in range(CHUNKS):
            step = cache.next_chunk(CHUNK)
            s = step.local_len
            q = torch.empty(1, HEADS, s, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
            k = torch.empty(1, KV_HEADS, s, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
            with host_syncs(lambda what: syncs.update([what])):
                outs = [step.attend(layer, q, k, k) for layer in range(2)]
    assert all((o.shape, o.dtype, o.device.type) == (q.shape, q.dtype, "cuda") for o in outs)
    assert recorder.names("attention") == {FLASH}
    assert syncs == {}
    assert recorder.names("_local_scalar_dense") == set()
    assert recorder.quadratic(CHUNK // CP) == []  # no (chunk queries x cached keys) scores
    assert cache.lengths == (CHUNKS * CHUNK // CP,) * CP and cache.reallocations == 2  # one allocation per layer
