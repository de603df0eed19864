"""HSDP view of the mesh (rank layout against a pure computation, errors, destroy cycles) and the bucketed
broadcast of model states over a replicate axis (FSDP2 replicas started from different seeds end identical)."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import wf_mesh
from wf_mesh import get_local_tensor_if_dtensor
from wf_mesh.errors import DisagreementError
from wf_mesh.mesh import hsdp_rank_grid
from wf_mesh.state_sync import broadcast_dtensor_model_states, plan_buckets
from wf_mesh.testing import run_distributed

from helpers import raised_everywhere


# ---- HSDP view: rank layout ------------------------------------------------------------------------------
def expected_hsdp(dims, dp_replicate, rank):
    """Brute force from coordinates: (2-D mesh, replicate group, shard group) of ``rank``."""
    dp_shard = dims.dp // dp_replicate
    c = dims.coords(rank)
    rep, sh = divmod(c["dp"], dp_shard)
    cp_first = dims.axis_order.index("cp") < dims.axis_order.index("dp")

    def shard_group(r):
        at = {"tp": c["tp"], "pp": c["pp"]}
        if cp_first:  # cp varies fastest inside the group
            return [dims.rank_of(**at, cp=k, dp=r * dp_shard + j) for j in range(dp_shard) for k in range(dims.cp)]
        return [dims.rank_of(**at, cp=k, dp=r * dp_shard + j) for k in range(dims.cp) for j in range(dp_shard)]

    replicate = [dims.rank_of(tp=c["tp"], pp=c["pp"], cp=c["cp"], dp=r * dp_shard + sh) for r in range(dp_replicate)]
    return [shard_group(r) for r in range(dp_replicate)], replicate, shard_group(rep)


PURE_CONFIGS = [
    (16, dict(tp=2, cp=2, pp=2), 2),
    (32, dict(tp=2, cp=2), 4),
    (32, dict(cp=2, pp=2, order="dp-cp-tp-pp"), 2),
    (24, dict(cp=3, order="pp-dp-cp-tp"), 2),
    (8, dict(), 8),
    (8, dict(cp=2), 1),
]


@pytest.mark.parametrize("world, kw, rep", PURE_CONFIGS)
def test_hsdp_rank_grid_is_the_documented_layout(world, kw, rep):
    dims = wf_mesh.ParallelDims(**kw).resolve(world)
    grid = hsdp_rank_grid(dims, rep)
    assert grid.shape == (dims.tp * dims.pp, rep, dims.dp // rep * dims.cp)
    assert sorted(grid.flatten().tolist()) == list(range(world))
    views = {tuple(map(tuple, view)) for view in grid.tolist()}
    for rank in range(world):
        mesh, _, shard = expected_hsdp(dims, rep, rank)
        assert tuple(map(tuple, mesh)) in views
        if rep == 1:
            assert shard == dims.group_of("dp_cp", rank)  # no replicas: the shard axis is exactly dp_cp


def hsdp_report(kw, rep):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(**kw), dp_replicate=rep)
    hsdp = pm.hsdp_mesh()
    out = {
        "mesh": hsdp.mesh.tolist(),
        "names": hsdp.mesh_dim_names,
        "enabled": pm.hsdp_enabled,
        "fsdp_is_dp_cp": pm.fsdp_mesh() is pm["dp_cp"],
        "replicate": pm.ranks("replicate"),
        "shard": pm.ranks("shard"),
    }
    for axis in ("replicate", "shard"):
        total = torch.tensor([dist.get_rank()])
        dist.all_reduce(total, group=hsdp.get_group(axis))  # the groups are real
        out[f"{axis}_sum"] = total.item()
        out[f"{axis}_pg"] = dist.get_process_group_ranks(hsdp.get_group(axis))
        out[f"{axis}_same"] = hsdp[axis].mesh.tolist() == pm.ranks(axis)
    return out


DIST_CONFIGS = [
    (4, dict(cp=2), 2),
    (4, dict(), 2),
    (4, dict(tp=2), 2),
    (4, dict(cp=2, order="dp-tp-cp-pp"), 1),
    (8, dict(cp=2), 2),
    (8, dict(cp=2, order="dp-cp-tp-pp"), 2),
]


@pytest.mark.parametrize("world, kw, rep", DIST_CONFIGS)
def test_hsdp_view_on_gloo_matches_pure_layout(world, kw, rep):
    dims = wf_mesh.ParallelDims(**kw).resolve(world)
    for rank, out in enumerate(run_distributed(world, hsdp_report, kw, rep)):
        mesh, replicate, shard = expected_hsdp(dims, rep, rank)
        assert out["names"] == ("replicate", "shard") and out["enabled"] and out["fsdp_is_dp_cp"]
        assert out["mesh"] == mesh, (rank, out["mesh"], mesh)
        assert out["replicate"] == replicate and out["shard"] == shard
        assert out["replicate_pg"] == sorted(replicate) and out["shard_pg"] == sorted(shard)
        assert out["replicate_sum"] == sum(replicate) and out["shard_sum"] == sum(shard)
        assert out["replicate_same"] and out["shard_same"]


def hsdp_errors():
    out = {}
    for bad in (3, 0):
        try:
            wf_mesh.init_parallel(dp_replicate=bad)
        except ValueError as e:
            out[bad] = str(e)
    pm = wf_mesh.init_parallel()
    out["enabled"] = pm.hsdp_enabled
    try:
        pm.hsdp_mesh()
    except RuntimeError as e:
        out["no_view"] = str(e)
    pm.destroy()
    try:
        pm.hsdp_mesh()
    except RuntimeError as e:
        out["destroyed"] = str(e)
    return out


def test_hsdp_errors():
    for out in run_distributed(4, hsdp_errors):
        assert out[3] == (
            "init_parallel: dp_replicate=3 does not divide dp=4 (tp=1, cp=1, pp=1, dp=4); HSDP needs dp = "
            "dp_replicate * dp_shard"
        )
        assert out[0] == "init_parallel: dp_replicate=0 must be >= 1"
        assert out["enabled"] is False
        assert "has no HSDP view: build it with init_parallel(dims, dp_replicate=R), R dividing dp" in out["no_view"]
        assert "was destroyed; initialize a new one" in out["destroyed"]


def hsdp_cycles(cycles):
    fds = []
    for _ in range(cycles):
        pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2), dp_replicate=2)
        dist.all_reduce(torch.ones(1), group=pm.group("replicate"))
        pm.destroy()
        fds.append(len(os.listdir("/proc/self/fd")))
    return fds


@pytest.mark.slow
def test_hsdp_init_destroy_cycles_leak_nothing():
    for fds in run_distributed(4, hsdp_cycles, 20):
        assert fds[-1] == fds[3], fds


# ---- bucketed broadcast ----------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 9), nn.Linear(9, 6)])
        self.head = nn.Linear(6, 3)
        self.register_buffer("running", torch.randn(5))
        self.register_buffer("steps", torch.randint(0, 100, (2,)))
        self.register_buffer("mask", torch.rand(4) > 0.5)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_net(seed):
    torch.manual_seed(seed)
    return Net()


def chunk(full, shards, index):
    pieces = torch.chunk(full, shards, dim=0)
    return pieces[index] if index < len(pieces) else full[:0]


def states(model):
    return {
        n: get_local_tensor_if_dtensor(t).detach().clone()
        for n, t in [*model.named_parameters(), *model.named_buffers()]
    }


def broadcast_fsdp(mesh_kind, bucket_bytes):
    """Each rank builds its model from its OWN seed, then shards it (HSDP) and broadcasts over the replicas."""
    if mesh_kind == "legacy":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        target, replicate = mesh, dist.get_process_group_ranks(mesh.get_group("replicate"))
    else:
        pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2), dp_replicate=2)
        mesh, replicate = pm.hsdp_mesh(), pm.ranks("replicate")
        target = mesh if mesh_kind == "view" else pm
    model = make_net(1000 + dist.get_rank())
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    before = states(model)
    count = broadcast_dtensor_model_states(model, target, bucket_bytes=bucket_bytes)
    return {
        "states": states(model),
        "before": before,
        "count": count,
        "source": min(replicate),
        "shard": mesh.get_local_rank("shard"),
        "shards": mesh.size(1),
    }


@pytest.mark.parametrize("mesh_kind, bucket_bytes", [("view", 2**20), ("parallel_mesh", 64), ("legacy", 100)])
def test_broadcast_makes_fsdp2_replicas_identical(mesh_kind, bucket_bytes):
    results = run_distributed(4, broadcast_fsdp, mesh_kind, bucket_bytes)
    assert [r["source"] for r in results] == [0, 1, 0, 1]  # replicate groups [0, 2] and [1, 3]
    for rank, out in enumerate(results):
        reference = make_net(1000 + out["source"])  # single process: the source rank's own model
        for name, full in [*reference.named_parameters(), *reference.named_buffers()]:
            expected = (
                full.detach() if name in dict(reference.named_buffers()) else chunk(full.detach(), 2, out["shard"])
            )
            assert torch.equal(out["states"][name], expected), (rank, name)
        peer = results[out["source"]]
        assert all(torch.equal(out["states"][n], peer["states"][n]) for n in out["states"])  # replicas identical
        if rank != out["source"]:
            assert not torch.equal(out["before"]["blocks.0.weight"], out["states"]["blocks.0.weight"])
        expected_buckets = len(plan_buckets(list(out["states"].values()), bucket_bytes))
        assert out["count"] == expected_buckets
    if bucket_bytes == 2**20:
        assert results[0]["count"] == 3  # float32, int64, bool: one broadcast per dtype


def broadcast_edge_cases():
    out = {}
    rank = dist.get_rank()
    no_replicas = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    model = nn.Linear(3, 2)
    before = model.weight.detach().clone()
    out["size1"] = broadcast_dtensor_model_states(model, no_replicas)
    out["size1_unchanged"] = torch.equal(model.weight, before)
    named = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_rep",))
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    out["keyword_axis"] = broadcast_dtensor_model_states(model, named, replicate_axis="dp_rep", bucket_bytes=8)
    out["weights"] = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(0)
    out["reference"] = [p.detach().clone() for p in nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)).parameters()]
    fsdp_mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    net = make_net(rank)
    fully_shard(net.blocks[0], mesh=fsdp_mesh)
    fully_shard(net, mesh=fsdp_mesh)  # the root owns blocks.1 and head: unsharded after forward
    net(torch.randn(2, 6))
    out["after_forward"] = broadcast_dtensor_model_states(net, fsdp_mesh)  # resharded first, then broadcast
    out["net"] = {n: get_local_tensor_if_dtensor(p).detach().clone() for n, p in net.named_parameters()}
    return out


def test_broadcast_edge_cases():
    results = run_distributed(2, broadcast_edge_cases)
    for out in results:
        assert out["size1"] == 0 and out["size1_unchanged"]
        assert out["keyword_axis"] == 4  # 8-byte buckets: (6) (2) (4) (2) floats -> 24/8/16/8 bytes, one each
        assert all(torch.equal(w, r) for w, r in zip(out["weights"], out["reference"]))  # rank 0's seed won
        assert out["after_forward"] == 3
        assert all(torch.equal(v, results[0]["net"][n]) for n, v in out["net"].items())


def broadcast_misuse(case):
    rank = dist.get_rank()
    named = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_rep",))
    if case == "no_axis":
        return broadcast_dtensor_model_states(nn.Linear(3, 2), named)
    if case == "bucket_zero":
        return broadcast_dtensor_model_states(nn.Linear(3, 2), named, replicate_axis="dp_rep", bucket_bytes=0)
    if case == "bucket_differs":
        return broadcast_dtensor_model_states(nn.Linear(3, 2), named, replicate_axis="dp_rep", bucket_bytes=8 + rank)
    if case == "layout_differs":
        return broadcast_dtensor_model_states(nn.Linear(3, 2 + rank), named, replicate_axis="dp_rep")
    # the README's old mistake: shard over the 1-D FSDP axis (dp x cp), then broadcast over the HSDP view's
    # replicate axis, whose ranks hold DIFFERENT shards of every parameter
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2), dp_replicate=2)
    model = make_net(rank)
    fully_shard(model, mesh=pm.fsdp_mesh() if case == "fsdp_then_hsdp" else pm.hsdp_mesh())
    if case == "fsdp_then_hsdp":
        return broadcast_dtensor_model_states(model, pm.hsdp_mesh())
    if case == "hsdp_over_shard_axis":  # the neighbour: the right model, the wrong axis named as replicate
        return broadcast_dtensor_model_states(model, pm.hsdp_mesh(), replicate_axis="shard")


MISUSE = {
    "no_axis": (
        ValueError,
        r"^broadcast_dtensor_model_states: the mesh has no axis 'replicate' \(axes: \['dp_rep'\]\)",
    ),
    "bucket_zero": (ValueError, r"^broadcast_dtensor_model_states: bucket_bytes=0 must be >= 1$"),
    "bucket_differs": (DisagreementError, r"ranks disagree on bucket_bytes \(rank 0: 8; rank 1: 9\)"),
    "layout_differs": (
        DisagreementError,
        r"ranks disagree on the model layout \(tensors, elements, crc of names/dtypes/shapes\) \(rank 0: \(2, 8, '[0-9a-f]+'\); rank 1: \(2, 12, ",
    ),
    "fsdp_then_hsdp": (
        ValueError,
        r"parameter or buffer 'scale' is a DTensor with placements \(Shard\(dim=0\),\) on DeviceMesh\(\(dp_cp=4\).*replicate group ranks \[2\] of \[0, 2\]|replicate group ranks \[0\] of \[0, 2\]|ranks \[3\] of \[1, 3\]|ranks \[1\] of \[1, 3\]",
    ),
    "hsdp_over_shard_axis": (
        ValueError,
        r"placements \(Replicate\(\), Shard\(dim=0\)\) on DeviceMesh\(\(replicate=2, shard=2\).*hold other data for it",
    ),
}


@pytest.mark.parametrize("case", list(MISUSE))
def test_broadcast_misuse_raises_on_every_rank_before_data_moves(case):
    error, match = MISUSE[case]
    world = 2 if case in ("no_axis", "bucket_zero", "bucket_differs", "layout_differs") else 4
    raised_everywhere(run_distributed(world, broadcast_misuse, case, return_exceptions=True), error, match)


def test_plan_buckets_pure():
    t = [
        torch.zeros(10),
        torch.zeros(10),
        torch.zeros(3, dtype=torch.int64),
        torch.zeros(30),
        torch.zeros(5, dtype=torch.bool),
        torch.zeros(0),
        torch.zeros(1),
    ]
    assert plan_buckets(t, 80) == [[0, 1], [2], [3], [4], [6]]
    assert plan_buckets(t, 2**20) == [[0, 1, 3, 6], [2], [4]]
    assert plan_buckets(t, 1) == [[0], [1], [2], [3], [4], [6]]
    with pytest.raises(ValueError, match=r"bucket_bytes=0 must be >= 1"):
        plan_buckets(t, 0)


def test_broadcast_takes_a_mesh():
    with pytest.raises(
        TypeError, match=r"broadcast_dtensor_model_states: mesh must be a DeviceMesh or a ParallelMesh, got NoneType"
    ):
        broadcast_dtensor_model_states(nn.Linear(2, 2), None)
