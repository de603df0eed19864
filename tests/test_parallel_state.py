"""Megatron/MAGI parallel_state accessors and the legacy lifecycle functions, on real gloo groups."""

import pytest
import torch.distributed as dist

import wf_mesh
from wf_mesh import parallel_state as ps
from wf_mesh.testing import run_distributed


def accessors(tp, cp, pp, order):
    wf_mesh.initialize_model_parallel(tp_size=tp, pp_size=pp, cp_size=cp, order=order)
    ranks = dist.get_process_group_ranks
    return {
        "initialized": (ps.model_parallel_is_initialized(), ps.is_initialized(), wf_mesh.model_parallel_is_initialized()),
        "tp": (ranks(ps.get_tp_group()), ps.get_tp_world_size(), ps.get_tp_rank()),
        "tp_cp": (ranks(ps.get_tp_group(with_context_parallel=True)), ps.get_tp_world_size(True), ps.get_tp_rank(True)),
        "tp_megatron": (ranks(ps.get_tensor_model_parallel_group()), ps.get_tensor_model_parallel_world_size(),
                        ps.get_tensor_model_parallel_rank()),
        "tp_and_cp": (ranks(ps.get_tensor_and_context_parallel_group()), ps.get_tensor_and_context_parallel_world_size(),
                      ps.get_tensor_and_context_parallel_rank()),
        "tp_src": (ps.get_tensor_model_parallel_src_rank(), ps.get_tensor_model_parallel_src_rank(True)),
        "tp_ranks": (ps.get_tensor_model_parallel_ranks(), ps.get_tensor_model_parallel_ranks(True)),
        "tp_last": (ps.get_tensor_model_parallel_last_rank(), ps.get_tensor_model_parallel_last_rank(True)),
        "cp": (ranks(ps.get_cp_group()), ps.get_cp_world_size(), ps.get_cp_rank()),
        "cp_megatron": (ranks(ps.get_context_parallel_group()), ps.get_context_parallel_world_size(),
                        ps.get_context_parallel_rank(), ps.get_context_parallel_global_ranks()),
        "pp": (ranks(ps.get_pp_group()), ps.get_pp_world_size(), ps.get_pp_rank()),
        "pp_megatron": (ranks(ps.get_pipeline_model_parallel_group()), ps.get_pipeline_model_parallel_world_size(),
                        ps.get_pipeline_model_parallel_rank()),
        "pp_ring": (ps.get_pipeline_model_parallel_first_rank(), ps.get_pipeline_model_parallel_last_rank(),
                    ps.get_pipeline_model_parallel_next_rank(), ps.get_pipeline_model_parallel_prev_rank(),
                    ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()),
        "dp": (ranks(ps.get_dp_group()), ps.get_dp_world_size(), ps.get_dp_rank()),
        "dp_cp": (ranks(ps.get_dp_group(with_context_parallel=True)), ps.get_dp_world_size(True), ps.get_dp_rank(True)),
        "dp_megatron": (ranks(ps.get_data_parallel_group()), ps.get_data_parallel_world_size(),
                        ps.get_data_parallel_rank(), ranks(ps.get_data_parallel_group(with_context_parallel=True))),
        "dp_gloo": (ranks(ps.get_dp_group_gloo()), ranks(ps.get_data_parallel_group_gloo(with_context_parallel=True))),
        "mp": ranks(ps.get_model_parallel_group()),
        "last": (wf_mesh.is_last_rank(), wf_mesh.is_last_tp_cp_rank()),
    }


@pytest.mark.parametrize("tp, cp, pp, order", [(2, 2, 2, "tp-cp-pp-dp"), (1, 2, 2, "tp-cp-pp-dp"), (2, 1, 2, "pp-dp-tp-cp")])
def test_accessors_match_plan(tp, cp, pp, order):
    world = 8
    plan = wf_mesh.ParallelDims(tp=tp, cp=cp, pp=pp, order=order).resolve(world)
    for rank, got in enumerate(run_distributed(world, accessors, tp, cp, pp, order)):
        def grp(token):
            g = plan.group_of(token, rank)
            return sorted(g), len(g), g.index(rank)

        assert got["initialized"] == (True, True, True)
        assert got["tp"] == got["tp_megatron"] == grp("tp")
        assert got["tp_cp"] == got["tp_and_cp"] == grp("tp-cp")
        assert got["tp_src"] == (plan.group_of("tp", rank)[0], plan.group_of("tp-cp", rank)[0])
        assert got["tp_ranks"] == (plan.group_of("tp", rank), plan.group_of("tp-cp", rank))
        assert got["tp_last"] == (plan.group_of("tp", rank)[-1], plan.group_of("tp-cp", rank)[-1])
        assert got["cp"] == got["cp_megatron"][:3] == grp("cp")
        assert got["cp_megatron"][3] == plan.group_of("cp", rank)
        assert got["pp"] == got["pp_megatron"] == grp("pp")
        pp_group, pp_rank = plan.group_of("pp", rank), plan.coords(rank)["pp"]
        assert got["pp_ring"] == (
            pp_group[0], pp_group[-1], pp_group[(pp_rank + 1) % pp], pp_group[(pp_rank - 1) % pp],
            pp_rank == 0, pp_rank == pp - 1,
        )
        assert got["dp"] == grp("dp") and got["dp_cp"] == grp("dp-cp")
        assert got["dp_megatron"] == (*grp("dp"), sorted(plan.group_of("dp-cp", rank)))
        assert got["dp_gloo"] == (sorted(plan.group_of("dp", rank)), sorted(plan.group_of("dp-cp", rank)))
        assert got["mp"] == sorted(plan.group_of("tp-pp", rank))
        assert got["last"] == (rank == world - 1, plan.group_of("tp-cp", rank)[-1] == rank)


def test_pipeline_ring_wraps():
    got = run_distributed(4, accessors, 1, 1, 4, "tp-cp-pp-dp")
    assert [g["pp_ring"][2:4] for g in got] == [(1, 3), (2, 0), (3, 1), (0, 2)]


def lifecycle_errors():
    out = {}
    try:
        ps.get_tp_group()
    except RuntimeError as e:
        out["before_init"] = str(e)
    out["optional"] = (ps.get_tensor_model_parallel_group(check_initialized=False),
                       ps.get_context_parallel_group(check_initialized=False))
    try:
        wf_mesh.initialize_model_parallel(tp_size=3, pp_size=2, cp_size=1)
    except RuntimeError as e:
        out["indivisible"] = str(e)
    wf_mesh.initialize_model_parallel(tp_size=2)
    try:
        wf_mesh.initialize_model_parallel(tp_size=2)
    except RuntimeError as e:
        out["double"] = str(e)
    ps.cp_size_t = 4  # as find_split sets it
    wf_mesh.destroy_model_parallel()
    out["after_destroy"] = (ps.model_parallel_is_initialized(), hasattr(ps, "cp_size_t"))
    wf_mesh.destroy_model_parallel()  # nothing to destroy: a no-op
    return out


def test_lifecycle_errors():
    out = run_distributed(4, lifecycle_errors)[0]
    assert out["before_init"].startswith("model parallel is not initialized: call wf_mesh.initialize_model_parallel(...)")
    assert out["optional"] == (None, None)
    assert out["indivisible"] == "world_size=4 is not divisible by tp_size*pp_size*cp_size = 3*2*1 = 6"
    assert "model parallel is already initialized" in out["double"]
    assert out["after_destroy"] == (False, False)


def test_distributed_off_sizes_are_one():
    assert not dist.is_initialized()
    assert (ps.get_tp_world_size(), ps.get_cp_world_size(), ps.get_pp_world_size(), ps.get_dp_world_size(True)) == (1, 1, 1, 1)
    assert (ps.get_tp_rank(), ps.get_cp_rank(), ps.get_pp_rank(), ps.get_data_parallel_rank()) == (0, 0, 0, 0)
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    assert wf_mesh.is_last_rank() and wf_mesh.is_last_tp_cp_rank()
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="initialize_model_parallel needs torch.distributed"):
        ps.initialize_model_parallel()
    with pytest.raises(RuntimeError, match="model parallel is not initialized"):
        ps.get_cp_group()


# ---- NCCL communicator YAML ------------------------------------------------------------------------
def test_communicator_config_parsing(tmp_path):
    good = tmp_path / "comm.yaml"
    good.write_text("tp:\n  min_ctas: 2\n  max_ctas: 8\nmp:\n  cga_cluster_size: 4\n")
    assert ps.load_nccl_communicator_config(good) == {"tp": {"min_ctas": 2, "max_ctas": 8}, "tp_pp": {"cga_cluster_size": 4}}
    with pytest.raises(FileNotFoundError, match="nccl_communicator_config_path: no such file '.*missing.yaml'"):
        ps.load_nccl_communicator_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tp: [unclosed\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        ps.load_nccl_communicator_config(bad)
    bad.write_text("ep:\n  min_ctas: 1\n")
    with pytest.raises(ValueError, match=r"unknown group 'ep'; groups are \['dp', 'dp_cp', 'cp', 'mp'"):
        ps.load_nccl_communicator_config(bad)
    bad.write_text("tp:\n  min_ctas: two\n")
    with pytest.raises(ValueError, match=r"group 'tp' must map \['cga_cluster_size', 'max_ctas', 'min_ctas'\] to ints"):
        ps.load_nccl_communicator_config(bad)
    bad.write_text("- tp\n")
    with pytest.raises(ValueError, match="must map group names to options, got list"):
        ps.load_nccl_communicator_config(bad)


def communicator_config_on_gloo(path):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wf_mesh.initialize_model_parallel(tp_size=2, nccl_communicator_config_path=path)
    return [str(w.message) for w in caught], ps.get_tp_world_size()


def test_communicator_config_ignored_on_gloo(tmp_path):
    path = tmp_path / "comm.yaml"
    path.write_text("tp:\n  min_ctas: 2\n")
    messages, tp = run_distributed(2, communicator_config_on_gloo, str(path))[0]
    assert tp == 2
    assert any("ignored: backend is 'gloo', not 'nccl'" in m for m in messages), messages
