"""wf_mesh.compat.worldfoundry: the original module tree as thin aliases (every name IS the wf_mesh object it
stands for), real call patterns on 2 and 4 gloo ranks against single-process references, errors raised on
every rank, and install() under the original import name."""

import inspect
import json
import os
import pkgutil
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist
from loguru import logger
from torch.distributed.device_mesh import DeviceMesh

import wf_mesh
from wf_mesh import _compat, parallel_state
from wf_mesh.compat import worldfoundry as wfd
from wf_mesh.compat.worldfoundry import (
    context_parallel,
    device_mesh_collectives,
    fsdp_runtime,
    inference_runtime,
    megatron_compat,
    model_parallel_groups,
    pipeline_parallel,
    torch_process_group,
)
from wf_mesh.compat.worldfoundry import logging as wf_logging
from wf_mesh.errors import DisagreementError
from wf_mesh.legacy import context_parallel as legacy_cp
from wf_mesh.legacy import fsdp as legacy_fsdp
from wf_mesh.legacy import log as legacy_log
from wf_mesh.legacy import process as legacy_process
from wf_mesh.legacy import runtime as legacy_runtime
from wf_mesh.testing import process_group_counts, run_distributed
from wf_mesh.video import plan_video_split

from helpers import DataType, raised_everywhere, sample

SUBMODULES = [
    "context_parallel",
    "device_mesh_collectives",
    "fsdp_runtime",
    "inference_runtime",
    "logging",
    "megatron_compat",
    "model_parallel_groups",
    "pipeline_parallel",
    "torch_process_group",
]

PROCESS_HELPERS = "barrier device_with_rank get_rank get_world_size is_local_rank0 is_rank0 rank0_first rank0_only"
PROCESS_HELPERS = PROCESS_HELPERS.split()

# module -> {name: the wf_mesh object it must be}
ALIASES = {
    context_parallel: {
        "broadcast": wf_mesh.broadcast,
        "broadcast_split_tensor": wf_mesh.broadcast_split_tensor,
        "cat_outputs_cp": wf_mesh.cat_outputs_cp,
        "cat_outputs_cp_with_grad": wf_mesh.cat_outputs_cp_with_grad,
        "find_split": wf_mesh.find_split,
        "split_inputs_cp": wf_mesh.split_inputs_cp,
        "robust_broadcast": legacy_cp.robust_broadcast,
        "split_inputs_cp_object_list": legacy_cp.split_inputs_cp_object_list,
        "cat_outputs_cp_object_list": legacy_cp.cat_outputs_cp_object_list,
    },
    device_mesh_collectives: {
        "DTensorFastEmaModelUpdater": wf_mesh.DTensorFastEmaModelUpdater,
        "FastEmaModelUpdater": wf_mesh.DTensorFastEmaModelUpdater,
        "get_local_tensor_if_dtensor": wf_mesh.get_local_tensor_if_dtensor,
        "get_local_tensor_if_DTensor": wf_mesh.get_local_tensor_if_dtensor,
        "broadcast_dtensor_model_states": wf_mesh.broadcast_dtensor_model_states,
        "broadcast": device_mesh_collectives.broadcast,  # argument mapping: mesh -> its group (tested below)
        "broadcast_with_shape_check": device_mesh_collectives.broadcast,
    },
    model_parallel_groups: {name: getattr(parallel_state, name) for name in parallel_state.__all__},
    pipeline_parallel: {
        "PPScheduler": wf_mesh.PPScheduler,
        "init_pp_scheduler": wf_mesh.init_pp_scheduler,
        "pp_scheduler": wf_mesh.pp_scheduler,
    },
    inference_runtime: {
        "dist_init": wf_mesh.dist_init,
        "is_last_rank": wf_mesh.is_last_rank,
        "is_last_tp_cp_rank": wf_mesh.is_last_tp_cp_rank,
        "get_device": legacy_process.get_device,  # the original's get_device(local_rank=None)
    },
    wf_logging: {"print_rank_0": wf_mesh.print_rank_0, "print_per_rank": wf_mesh.print_per_rank, "log": legacy_log.log},
    megatron_compat: {"parallel_state": parallel_state, "mpu": parallel_state},
    torch_process_group: {name: getattr(legacy_process, name) for name in PROCESS_HELPERS},
    fsdp_runtime: {"hsdp_device_mesh": legacy_fsdp.hsdp_device_mesh},
}

LEGACY_20 = [
    "broadcast",
    "broadcast_dtensor_model_states",
    "broadcast_split_tensor",
    "cat_outputs_cp",
    "cat_outputs_cp_with_grad",
    "destroy_model_parallel",
    "dist_init",
    "DTensorFastEmaModelUpdater",
    "find_split",
    "get_local_tensor_if_dtensor",
    "init_pp_scheduler",
    "initialize_model_parallel",
    "is_last_rank",
    "is_last_tp_cp_rank",
    "model_parallel_is_initialized",
    "pp_scheduler",
    "PPScheduler",
    "print_per_rank",
    "print_rank_0",
    "split_inputs_cp",
]
ROOT_ACCESSORS = [
    "get_cp_group",
    "get_cp_rank",
    "get_cp_world_size",
    "get_dp_group",
    "get_dp_group_gloo",
    "get_dp_rank",
    "get_dp_world_size",
    "get_model_parallel_group",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "get_pp_group",
    "get_pp_rank",
    "get_pp_world_size",
    "get_tensor_model_parallel_last_rank",
    "get_tensor_model_parallel_ranks",
    "get_tensor_model_parallel_src_rank",
    "get_tp_group",
    "get_tp_rank",
    "get_tp_world_size",
]
ROOT_OTHERS = {
    "FastEmaModelUpdater": wf_mesh.DTensorFastEmaModelUpdater,
    "get_local_tensor_if_DTensor": wf_mesh.get_local_tensor_if_dtensor,
    "get_world_size": legacy_process.get_world_size,
    "get_global_rank": legacy_process.get_rank,
    "is_distributed_initialized": legacy_process.is_initialized,
    "get_distributed_device": legacy_process.get_device,
    "robust_broadcast": legacy_cp.robust_broadcast,
    "split_inputs_cp_object_list": legacy_cp.split_inputs_cp_object_list,
    "cat_outputs_cp_object_list": legacy_cp.cat_outputs_cp_object_list,
}
# the only functions a compat module may define itself (argument mapping); everything else is imported
OWN_FUNCTIONS = {("device_mesh_collectives", "broadcast"), ("worldfoundry", "install")}


# ---- the tree is aliases --------------------------------------------------------------------------------
@pytest.mark.parametrize("module", list(ALIASES), ids=[m.__name__.rpartition(".")[2] for m in ALIASES])
def test_every_name_is_the_wf_mesh_object(module):
    expected = ALIASES[module]
    assert sorted(module.__all__) == sorted(expected)
    for name, obj in expected.items():
        assert getattr(module, name) is obj, name


def test_root_exports_the_original_root_names():
    for name in LEGACY_20:
        assert getattr(wfd, name) is getattr(wf_mesh, name), name
    for name in ROOT_ACCESSORS:
        assert getattr(wfd, name) is getattr(parallel_state, name), name
    for name, obj in ROOT_OTHERS.items():
        assert getattr(wfd, name) is obj, name
    assert set(wfd.__all__) == {*LEGACY_20, *ROOT_ACCESSORS, *ROOT_OTHERS, "install"}
    assert sorted(m.name for m in pkgutil.iter_modules(wfd.__path__)) == SUBMODULES
    assert [getattr(wfd, name).__name__ for name in SUBMODULES] == [f"{wfd.__name__}.{n}" for n in SUBMODULES]


def test_compat_modules_are_thin():
    for module in [wfd, *(getattr(wfd, name) for name in SUBMODULES)]:
        short = module.__name__.rpartition(".")[2]
        own = {
            (short, obj.__name__)
            for obj in vars(module).values()
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == module.__name__
        }
        assert own <= OWN_FUNCTIONS, f"{module.__name__} defines {own - OWN_FUNCTIONS}: put logic in wf_mesh.legacy"


# ---- without torch.distributed ----------------------------------------------------------------------------
def test_process_helpers_without_distributed(monkeypatch):
    assert not dist.is_initialized()
    tpg = torch_process_group
    assert (tpg.get_rank(), tpg.get_world_size(), tpg.is_rank0(), wfd.get_global_rank(), wfd.get_world_size()) == (
        0,
        1,
        True,
        0,
        1,
    )
    assert wfd.is_distributed_initialized() is False and tpg.barrier() is None
    assert tpg.rank0_only(lambda x: x + 1)(1) == 2 and tpg.rank0_first(lambda x: x * 3)(2) == 6
    assert inference_runtime.get_device() == legacy_runtime.get_device() == wfd.get_distributed_device()
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert tpg.is_local_rank0() and tpg.device_with_rank("cuda") == "cuda:0" and tpg.device_with_rank("cpu") == "cpu"
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert not tpg.is_local_rank0() and tpg.device_with_rank("cuda") == "cuda:3"
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="environment variable LOCAL_RANK='x' is not an integer"):
        tpg.is_local_rank0()
    assert model_parallel_groups.get_tp_group(check_initialized=False) is None
    assert not wfd.model_parallel_is_initialized()
    items, x = [1, 2, 3], torch.ones(2)
    assert context_parallel.split_inputs_cp_object_list(items, None) is items
    assert context_parallel.cat_outputs_cp_object_list(items, None) is items
    assert context_parallel.robust_broadcast(x, 0, None) is x


def test_get_device_maps_local_rank():
    expected = torch.device("cuda", 1) if torch.cuda.is_available() else torch.device("cpu")
    assert inference_runtime.get_device(1) == expected and wfd.get_distributed_device(1) == expected


def test_log_without_distributed():
    records = []
    sink = logger.add(lambda m: records.append((m.record["message"], m.record["level"].name, m.record["extra"])))
    try:
        wf_logging.log.info("step {}", 3, rank0_only=True)
        wf_logging.log.success("done")
    finally:
        logger.remove(sink)
    assert records == [
        ("step 3", "INFO", {"rank": None, "coords": None}),
        ("done", "SUCCESS", {"rank": None, "coords": None}),
    ]


# ---- 2 ranks: payloads, CP round trips, decorators, logging ------------------------------------------------
PAYLOADS = {"bool": True, "int": -7, "enum": DataType.VIDEO, "dict": {"kind": DataType.IMAGE, "t": 4, "ok": False}}


@torch_process_group.rank0_only
def whoami():
    return dist.get_rank()


@torch_process_group.rank0_first
def prepare_cache(path):
    """Writes the cache if it is missing: with rank 0 first, rank 0 writes it and the others read it."""
    if not os.path.exists(path):
        time.sleep(0.2)  # without the ordering, the other ranks would find no file and write their own
        with open(path, "w") as f:
            f.write(f"written by rank {dist.get_rank()}")
    with open(path) as f:
        return f.read()


def two_rank_calls(cache_path):
    rank, world = dist.get_rank(), dist.group.WORLD
    out = {name: context_parallel.broadcast(value if rank == 0 else None, world) for name, value in PAYLOADS.items()}
    out["split_none"] = context_parallel.broadcast_split_tensor(None, 1, world)
    x = sample((2, 6, 3), seed=1)
    out["shard"] = context_parallel.split_inputs_cp(x, 1, world)
    out["cat"] = context_parallel.cat_outputs_cp(out["shard"], 1, world)
    out["objects"] = {
        n: context_parallel.cat_outputs_cp_object_list(
            context_parallel.split_inputs_cp_object_list([f"item{i}" for i in range(n)], world), world
        )
        for n in (0, 1, 5, 6)
    }
    out["block"] = context_parallel.split_inputs_cp_object_list(list("abcde"), world)
    source = sample((3, 4), seed=2)
    out["robust"] = context_parallel.robust_broadcast(source if rank == 0 else torch.empty(1, 1), 0, world)
    mesh = DeviceMesh.from_group(world, "cpu")
    out["mesh_broadcast"] = device_mesh_collectives.broadcast(
        sample((2, 2), 3) if rank == 0 else torch.zeros(2, 2), mesh
    )
    out["mesh_shape_check"] = device_mesh_collectives.broadcast_with_shape_check(
        sample((4,), 4) if rank == 0 else torch.zeros(1), mesh
    )
    out["rank0_only"] = whoami()
    out["rank0_first"] = prepare_cache(cache_path)
    records = []
    sink = logger.add(
        lambda m: records.append((m.record["message"], m.record["level"].name, m.record["extra"]["rank"]))
    )
    try:
        wf_logging.log.info("step {}", 3, rank0_only=True)
        wf_logging.log.warning("every rank")
    finally:
        logger.remove(sink)
    out["logs"] = records
    tpg = torch_process_group
    out["process"] = (
        tpg.get_rank(),
        tpg.get_world_size(),
        tpg.is_rank0(),
        wfd.get_global_rank(),
        wfd.is_distributed_initialized(),
    )
    return out


def test_two_rank_call_patterns(tmp_path):
    cache = tmp_path / "cache.txt"
    results = run_distributed(2, two_rank_calls, str(cache))
    x = sample((2, 6, 3), seed=1)
    for rank, out in enumerate(results):
        for name, value in PAYLOADS.items():
            assert out[name] == value and type(out[name]) is type(value), name
        assert out["dict"]["kind"] is DataType.IMAGE
        assert out["split_none"] is None
        assert torch.equal(out["shard"], x.chunk(2, dim=1)[rank]) and torch.equal(out["cat"], x)
        assert out["objects"] == {n: [f"item{i}" for i in range(n)] for n in (0, 1, 5, 6)}
        assert out["block"] == [["a", "b", "c"], ["d", "e"]][rank]
        assert torch.equal(out["robust"], sample((3, 4), seed=2)) and out["robust"].device.type == "cpu"
        assert torch.equal(out["mesh_broadcast"], sample((2, 2), 3))
        assert torch.equal(out["mesh_shape_check"], sample((4,), 4))
        assert out["rank0_only"] == [0, None][rank]
        assert out["rank0_first"] == "written by rank 0"
        assert out["process"] == (rank, 2, rank == 0, rank, True)
    assert results[0]["logs"] == [("[rank 0] step 3", "INFO", 0), ("[rank 0] every rank", "WARNING", 0)]
    assert results[1]["logs"] == [("[rank 1] every rank", "WARNING", 1)]


# ---- 4 ranks: model-parallel groups through the compat tree ------------------------------------------------
def four_rank_groups():
    before = (model_parallel_groups.get_tp_group(check_initialized=False), wfd.model_parallel_is_initialized())
    model_parallel_groups.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    ranks = {
        axis: dist.get_process_group_ranks(getter())
        for axis, getter in (("tp", wfd.get_tp_group), ("cp", wfd.get_cp_group), ("dp", wfd.get_dp_group))
    }
    sizes = (
        wfd.get_tp_world_size(),
        wfd.get_cp_world_size(),
        wfd.get_dp_world_size(),
        wfd.get_tp_rank(),
        wfd.get_cp_rank(),
    )
    cp_group = model_parallel_groups.get_cp_group()
    x = sample((1, 4, 8, 2), seed=5)
    shard = wfd.split_inputs_cp(x, 2, cp_group)
    cat = wfd.cat_outputs_cp(shard, 2, cp_group)
    objects = wfd.cat_outputs_cp_object_list(wfd.split_inputs_cp_object_list(list(range(7)), cp_group), cp_group)
    world_block = wfd.split_inputs_cp_object_list(list(range(6)), dist.group.WORLD)
    split = tuple(wfd.find_split((1, 16, 24, 88, 160), 4))
    cp_size_t = megatron_compat.parallel_state.cp_size_t
    last_tp_cp = wfd.is_last_tp_cp_rank()
    wfd.destroy_model_parallel()
    after = (wfd.model_parallel_is_initialized(), hasattr(megatron_compat.mpu, "cp_size_t"))
    return before, ranks, sizes, shard, torch.equal(cat, x), objects, world_block, split, cp_size_t, last_tp_cp, after


def test_model_parallel_groups_on_four_ranks():
    results = run_distributed(4, four_rank_groups)
    plan = plan_video_split((1, 16, 24, 88, 160), 4, (1, 2, 2))
    x = sample((1, 4, 8, 2), seed=5)
    for rank, (before, ranks, sizes, shard, cat_ok, objects, block, split, cp_size_t, last, after) in enumerate(
        results
    ):
        tp, cp = rank % 2, rank // 2  # order tp-cp-pp-dp: tp fastest
        assert before == (None, False)
        assert ranks == {"tp": [2 * cp, 2 * cp + 1], "cp": [tp, tp + 2], "dp": [rank]}
        assert sizes == (2, 2, 1, tp, cp)
        assert torch.equal(shard, x.chunk(2, dim=2)[cp]) and cat_ok
        assert objects == list(range(7))
        assert block == [[0, 1], [2, 3], [4], [5]][rank]
        assert split == tuple(plan.local_thw) and cp_size_t == plan.cp_t
        assert last == (rank == 3)
        assert after == (False, False)


# ---- hsdp_device_mesh ---------------------------------------------------------------------------------------
def hsdp_groups(replicas, shard, rank):
    """Pure: the original's init_device_mesh((replicas, shard)) groups of ``rank``."""
    return [rank % shard + i * shard for i in range(replicas)], [rank // shard * shard + j for j in range(shard)]


def groups_of(mesh):
    return [dist.get_process_group_ranks(mesh.get_group(name)) for name in ("replicate", "shard")]


def hsdp_meshes():
    baseline = process_group_counts()[0]
    out = {}
    built = fsdp_runtime.hsdp_device_mesh(sharding_group_size=2)
    out["built"] = (built.mesh_dim_names, built.device_type, groups_of(built))
    out["cached"] = fsdp_runtime.hsdp_device_mesh(2, 2) is built
    out["default"] = groups_of(fsdp_runtime.hsdp_device_mesh())  # shard size min(world, 8) = 4
    wfd.destroy_model_parallel()  # no current mesh: still releases them
    out["released"] = (_compat.mesh_is_live(built), process_group_counts()[0] - baseline)
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(dp=4), dp_replicate=2)
    before = process_group_counts()[0]
    out["view"] = (fsdp_runtime.hsdp_device_mesh(2, 2) is pm.hsdp_mesh(), process_group_counts()[0] - before)
    pm.destroy()
    wfd.initialize_model_parallel(tp_size=2)  # its HSDP view (if any) could not span the world: build one
    other = fsdp_runtime.hsdp_device_mesh(replica_group_size=2, sharding_group_size=2)
    out["with_tp"] = groups_of(other)
    wfd.destroy_model_parallel()
    out["released_with_mesh"] = (_compat.mesh_is_live(other), process_group_counts()[0] - baseline)
    return out


def test_hsdp_device_mesh_groups_and_lifetime():
    results = run_distributed(4, hsdp_meshes)
    for rank, out in enumerate(results):
        assert out["built"] == (("replicate", "shard"), "cpu", list(hsdp_groups(2, 2, rank)))
        assert out["cached"]
        assert out["default"] == list(hsdp_groups(1, 4, rank))
        assert out["released"] == (False, 0)
        assert out["view"] == (True, 0)  # the mesh's own HSDP view: no new group
        assert out["with_tp"] == list(hsdp_groups(2, 2, rank))
        assert out["released_with_mesh"] == (False, 0)


# ---- errors, on every rank ----------------------------------------------------------------------------------
@torch_process_group.rank0_first
def failing_download():
    if dist.get_rank() == 0:
        raise ValueError("download failed")
    return "never reached"


def misuse(case):
    rank, world = dist.get_rank(), dist.group.WORLD
    if case == "rank0_first_failure":
        return failing_download()
    if case == "robust_broadcast_other_source":
        return context_parallel.robust_broadcast(torch.zeros(2), 1, world)
    if case == "robust_broadcast_not_a_tensor":
        return context_parallel.robust_broadcast("text" if rank == 0 else None, 0, world)
    if case == "object_list_pickle_refused":
        return context_parallel.cat_outputs_cp_object_list([rank], world, allow_pickle=rank != 1)
    if case == "object_list_not_a_list":
        return context_parallel.cat_outputs_cp_object_list({rank} if rank else [rank], world)
    if case == "hsdp_sizes":
        return fsdp_runtime.hsdp_device_mesh(replica_group_size=2, sharding_group_size=2)
    if case == "hsdp_disagree":
        return fsdp_runtime.hsdp_device_mesh(sharding_group_size=1 + rank)


MISUSE = {
    "rank0_first_failure": (
        ValueError,
        r"^rank0_first\(failing_download\): rank 0: download failed \(raised on every rank",
    ),
    "robust_broadcast_other_source": (NotImplementedError, r"^robust_broadcast: src=1 is not the group's first rank 0"),
    "robust_broadcast_not_a_tensor": (
        TypeError,
        r"^robust_broadcast sends a tensor; the source \(rank 0\) passed str$",
    ),
    "object_list_pickle_refused": (
        TypeError,
        r"^cat_outputs_cp_object_list: rank 1: the objects travel pickled and pickle is off on this rank",
    ),
    "object_list_not_a_list": (
        TypeError,
        r"^cat_outputs_cp_object_list: rank 1: object_list must be a list or tuple, got set",
    ),
    "hsdp_sizes": (
        ValueError,
        r"^hsdp_device_mesh: replica_group_size=2 x sharding group size 2 = 4 is not the world size 2",
    ),
    "hsdp_disagree": (
        DisagreementError,
        r"^hsdp_device_mesh: ranks disagree on \(replicas, shard size, device\) \(rank 0: \(2, 1, 'cpu'\); rank 1: \(1, 2, 'cpu'\)\)",
    ),
}


@pytest.mark.parametrize("case", list(MISUSE))
def test_misuse_raises_on_every_rank(case):
    error, match = MISUSE[case]
    raised_everywhere(run_distributed(2, misuse, case, return_exceptions=True), error, match)


# ---- install() ----------------------------------------------------------------------------------------------
@pytest.fixture
def clean_worldfoundry_modules(monkeypatch):
    """Forget every worldfoundry* module this test imported (the sys.path change is undone by monkeypatch)."""
    before = {name for name in sys.modules if name.split(".")[0] == "worldfoundry"}
    yield monkeypatch
    for name in [n for n in sys.modules if n.split(".")[0] == "worldfoundry" and n not in before]:
        del sys.modules[name]


def test_install_refuses_a_foreign_module(clean_worldfoundry_modules):
    foreign = types.ModuleType("worldfoundry.core.distributed")
    foreign.__file__ = "/opt/original/worldfoundry/core/distributed/__init__.py"
    clean_worldfoundry_modules.setitem(sys.modules, "worldfoundry.core.distributed", foreign)
    with pytest.raises(
        ImportError,
        match=r"^install\(\): 'worldfoundry.core.distributed' is already imported from "
        r"/opt/original/worldfoundry/core/distributed/__init__.py, which is not "
        r"'wf_mesh.compat.worldfoundry'",
    ) as info:
        wfd.install()
    assert info.value.path == foreign.__file__ and info.value.name == "worldfoundry.core.distributed"
    assert "worldfoundry" not in sys.modules and "worldfoundry.core.distributed.logging" not in sys.modules


def write_package(root, files):
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_install_refuses_an_original_its_parent_package_imports(tmp_path, clean_worldfoundry_modules):
    write_package(
        tmp_path,
        {
            "worldfoundry/__init__.py": "",
            "worldfoundry/core/__init__.py": "from . import distributed\n",
            "worldfoundry/core/distributed/__init__.py": "ORIGINAL = True\n",
        },
    )
    clean_worldfoundry_modules.syspath_prepend(str(tmp_path))
    original = str(tmp_path / "worldfoundry" / "core" / "distributed" / "__init__.py")
    with pytest.raises(ImportError, match=f"is already imported from {original}, which is not"):
        wfd.install()
    assert sys.modules["worldfoundry.core.distributed"].ORIGINAL


INSTALL_SCRIPT = """
import json, sys
from wf_mesh.compat import worldfoundry as wfd
root = wfd.install()
import worldfoundry.core.distributed.context_parallel
from worldfoundry.core.distributed import split_inputs_cp
from worldfoundry.core.distributed.megatron_compat import parallel_state
from worldfoundry.core.distributed.logging import log
import wf_mesh
checks = [
    root is wfd, worldfoundry.core.distributed is wfd, wfd.install() is wfd,
    worldfoundry.core.distributed.context_parallel is wfd.context_parallel,
    split_inputs_cp is wf_mesh.split_inputs_cp, parallel_state is wf_mesh.parallel_state,
    log is wf_mesh.legacy.log.log,
]
if len(sys.argv) > 1:  # real parent packages: kept, and their other modules still import
    import worldfoundry.models
    checks += [worldfoundry.models.REAL, worldfoundry.__file__.startswith(sys.argv[1])]
names = sorted(n for n in sys.modules if n.split(".")[0] == "worldfoundry" and n != "worldfoundry.models")
print(json.dumps([checks, names]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("parents", ["created", "real"])
def test_install_then_original_imports(tmp_path, parents):
    argv = []
    if parents == "real":
        write_package(
            tmp_path,
            {
                "worldfoundry/__init__.py": "",
                "worldfoundry/core/__init__.py": "",
                "worldfoundry/core/distributed/__init__.py": "raise RuntimeError('the original must not be imported')\n",
                "worldfoundry/models/__init__.py": "REAL = True\n",
            },
        )
        argv = [str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", INSTALL_SCRIPT, *argv],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    checks, names = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(checks), checks
    tree = [f"worldfoundry.core.distributed.{name}" for name in SUBMODULES]
    assert names == sorted(["worldfoundry", "worldfoundry.core", "worldfoundry.core.distributed", *tree])
