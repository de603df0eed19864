"""MAGI-1's short names and the lifecycle of wf_mesh.parallel_state on real gloo groups; its errors, raised on
every rank where they come from a collective, and at once (no torch.distributed needed) where purely local."""

import warnings

import pytest
import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh import parallel_state as ps
from wf_mesh.errors import (
    DegreeError,
    DisagreementError,
    NotInitializedError,
    StateError,
)
from wf_mesh.legacy.errors import LegacyStateError
from wf_mesh.testing import process_group_counts, run_distributed

WORLD = 4  # the Megatron-style tests (test_megatron_parallel_state.py) run at 8 ranks
EVERY_RANK = f"(raised on every rank of the group {list(range(WORLD))})"


# ---- MAGI-1 short names -------------------------------------------------------------------------------
def magi_accessors(tp, cp, pp, order):
    ps.initialize_model_parallel(tp, pp, cp, None, 30, order)  # MAGI-1's positional arguments
    ranks = dist.get_process_group_ranks
    return {
        "initialized": (
            ps.model_parallel_is_initialized(),
            ps.is_initialized(),
            wf_mesh.model_parallel_is_initialized(),
        ),
        "tp": (ranks(ps.get_tp_group()), ps.get_tp_world_size(), ps.get_tp_rank()),
        # MAGI-1: get_tp_group(check_initialized=True, with_context_parallel=False)
        "tp_cp": (ranks(ps.get_tp_group(True, True)), ps.get_tp_world_size(True), ps.get_tp_rank(True)),
        "tp_src": (ps.get_tensor_model_parallel_src_rank(), ps.get_tensor_model_parallel_src_rank(True)),
        "tp_ranks": (ps.get_tensor_model_parallel_ranks(), ps.get_tensor_model_parallel_ranks(True)),
        "tp_last": (ps.get_tensor_model_parallel_last_rank(), ps.get_tensor_model_parallel_last_rank(True)),
        "cp": (ranks(ps.get_cp_group()), ps.get_cp_world_size(), ps.get_cp_rank()),
        "pp": (ranks(ps.get_pp_group()), ps.get_pp_world_size(), ps.get_pp_rank()),
        "pp_ring": (
            ps.get_pipeline_model_parallel_first_rank(),
            ps.get_pipeline_model_parallel_last_rank(),
            ps.get_pipeline_model_parallel_next_rank(),
            ps.get_pipeline_model_parallel_prev_rank(),
            ps.is_pipeline_first_stage(),
            ps.is_pipeline_last_stage(),
        ),
        "dp": (ranks(ps.get_dp_group()), ps.get_dp_world_size(), ps.get_dp_rank()),
        "dp_cp": (ranks(ps.get_dp_group(True)), ps.get_dp_world_size(True), ps.get_dp_rank(True)),
        "dp_gloo": (ranks(ps.get_dp_group_gloo()), ranks(ps.get_dp_group_gloo(True))),
        "mp": ranks(ps.get_model_parallel_group()),
    }


# (tp, cp, pp, order) -> the pipeline ring written out per rank: (next, prev)
CONFIGS = {
    (2, 2, 1, "cp-dp-tp-pp"): None,
    (1, 1, 4, "tp-cp-pp-dp"): [(1, 3), (2, 0), (3, 1), (0, 2)],  # rank = stage
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_magi_accessors_match_plan(config):
    tp, cp, pp, order = config
    plan = wf_mesh.ParallelDims(tp=tp, cp=cp, pp=pp, order=order).resolve(WORLD)
    for rank, got in enumerate(run_distributed(WORLD, magi_accessors, tp, cp, pp, order)):

        def grp(token, rank=rank):
            g = plan.group_of(token, rank)
            return g, len(g), g.index(rank)

        assert got["initialized"] == (True, True, True)
        assert got["tp"] == grp("tp") and got["tp_cp"] == grp("tp-cp")
        assert got["tp_src"] == (plan.group_of("tp", rank)[0], plan.group_of("tp-cp", rank)[0])
        assert got["tp_ranks"] == (plan.group_of("tp", rank), plan.group_of("tp-cp", rank))
        assert got["tp_last"] == (plan.group_of("tp", rank)[-1], plan.group_of("tp-cp", rank)[-1])
        assert got["cp"] == grp("cp") and got["pp"] == grp("pp")
        pp_group, stage = plan.group_of("pp", rank), plan.coords(rank)["pp"]
        assert got["pp_ring"] == (
            pp_group[0],
            pp_group[-1],
            pp_group[(stage + 1) % pp],
            pp_group[(stage - 1) % pp],
            stage == 0,
            stage == pp - 1,
        )
        if CONFIGS[config] is not None:
            assert got["pp_ring"][2:4] == CONFIGS[config][rank]
        assert got["dp"] == grp("dp") and got["dp_cp"] == grp("dp-cp")
        assert got["dp_gloo"] == (plan.group_of("dp", rank), plan.group_of("dp-cp", rank))
        assert got["mp"] == plan.group_of("tp-pp", rank)


def test_megatron_names_are_aliases_of_the_short_names():
    assert ps.get_tensor_model_parallel_group is ps.get_tp_group
    assert ps.get_tensor_model_parallel_world_size is ps.get_tp_world_size
    assert ps.get_tensor_model_parallel_rank is ps.get_tp_rank
    assert ps.get_context_parallel_group is ps.get_cp_group
    assert ps.get_pipeline_model_parallel_group is ps.get_pp_group
    assert ps.get_pipeline_model_parallel_rank is ps.get_pp_rank
    assert ps.get_data_parallel_group is ps.get_dp_group
    assert ps.get_data_parallel_group_gloo is ps.get_dp_group_gloo
    assert ps.get_data_parallel_world_size is ps.get_dp_world_size
    assert ps.is_initialized is ps.model_parallel_is_initialized
    assert all(callable(getattr(ps, name)) or name.isupper() for name in ps.__all__)


# ---- lifecycle ----------------------------------------------------------------------------------------
def lifecycle(config_path):
    getters = (ps.get_tp_group, ps.get_cp_group, ps.get_pp_group, ps.get_dp_group)
    out = {"unchecked": tuple(getter(check_initialized=False) for getter in getters)}
    held = process_group_counts()[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ps.initialize_model_parallel(pipeline_model_parallel_size=4, nccl_communicator_config_path=config_path)
    out["warnings"] = [str(w.message) for w in caught]
    wf_mesh.find_split((1, 16, 24, 88, 160), 16)  # sets cp_size_t
    out["cp_size_t"] = ps.cp_size_t
    ps.destroy_model_parallel()
    # pp=4: the embedding groups [first, last] and the position-embedding groups [first] are new groups; destroyed.
    out["after_destroy"] = (
        ps.model_parallel_is_initialized(),
        hasattr(ps, "cp_size_t"),
        process_group_counts()[0] - held,
    )
    ps.destroy_model_parallel()  # nothing to destroy: a no-op
    ps.initialize_model_parallel(pipeline_model_parallel_size=4)
    built = process_group_counts()[0]
    ps.destroy_model_parallel(destroy_process_groups=False)  # a framework destroys them: references only
    out["kept"] = (built - held > 0, process_group_counts()[0] == built)
    return out


def test_lifecycle(tmp_path):
    path = tmp_path / "comm.yaml"
    path.write_text("tp:\n  min_ctas: 2\n")
    for got in run_distributed(WORLD, lifecycle, str(path)):
        assert got["unchecked"] == (None, None, None, None)
        ignored = f"nccl_communicator_config_path={str(path)!r} ignored: backend is 'gloo', not 'nccl'"
        assert got["warnings"] == [ignored]
        assert got["cp_size_t"] == 8
        assert got["after_destroy"] == (False, False, 0)
        assert got["kept"] == (True, True)


def test_distributed_off_sizes_are_one():
    assert not dist.is_initialized()
    sizes = (ps.get_tp_world_size(), ps.get_cp_world_size(), ps.get_pp_world_size(), ps.get_dp_world_size(True))
    assert sizes == (1, 1, 1, 1)
    assert (ps.get_tensor_and_context_parallel_world_size(), ps.get_data_parallel_world_size()) == (1, 1)
    assert (ps.get_tp_rank(), ps.get_cp_rank(), ps.get_pp_rank(), ps.get_data_parallel_rank()) == (0, 0, 0, 0)
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    assert not ps.model_parallel_is_initialized()
    assert not ps.is_rank_in_embedding_group() and not ps.is_rank_in_position_embedding_group()
    with pytest.raises(StateError, match="initialize_model_parallel needs torch.distributed"):
        ps.initialize_model_parallel()
    with pytest.raises(NotInitializedError, match="model parallel is not initialized"):
        ps.get_cp_group()


def test_overrides_without_a_mesh_and_reset_by_destroy():
    """Megatron's set_* values win even when nothing is initialized; destroy_model_parallel forgets them."""
    try:
        ps.set_tensor_model_parallel_world_size(4)
        ps.set_pipeline_model_parallel_rank(2)
        ps.set_virtual_pipeline_model_parallel_world_size(3)
        assert (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()) == (4, 2)
        assert not ps.is_pipeline_first_stage()
        assert ps.get_virtual_pipeline_model_parallel_world_size() == 3
        vp_stage_missing = r"vp_stage must be given: virtual pipelining is on \(virtual world size 3\)"
        with pytest.raises(ValueError, match=vp_stage_missing):
            ps.is_pipeline_first_stage(ignore_virtual=False)
        assert not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1)  # not the last virtual stage
    finally:
        ps.destroy_model_parallel()
    assert (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()) == (1, 0)
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None
    with pytest.raises(TypeError, match="world_size must be an int, got str '2'"):
        ps.set_tensor_model_parallel_world_size("2")
    with pytest.raises(ValueError, match="rank=-1 must be >= 0"):
        ps.set_pipeline_model_parallel_rank(-1)


# ---- errors raised on every rank (collective agreement) ----------------------------------------------
def initialize_per_rank(default, per_rank):
    """initialize_model_parallel(**default), with ``per_rank[rank]`` overriding it on some ranks."""
    ps.initialize_model_parallel(**{**default, **per_rank.get(dist.get_rank(), {})})


def initialize_twice():
    ps.initialize_model_parallel(tp_size=2)
    ps.initialize_model_parallel(tp_size=2)


def outside_the_pipeline(pipeline):
    return [(pipeline[-1] + 1) % WORLD]


@pytest.mark.parametrize(
    "fn, args, error, message",
    [
        (
            initialize_per_rank,
            ({"tp_size": 2}, {1: {"tp_size": 0}}),
            DegreeError,
            "initialize_model_parallel: rank 1: tp=0 must be >= 1 (dp may be -1 to infer it); tp=0, cp=1, pp=1, dp=-1 "
            + EVERY_RANK,
        ),
        (
            initialize_per_rank,
            ({"pp_size": 2}, {3: {"pp_size": "2"}}),
            TypeError,
            f"initialize_model_parallel: rank 3: pp must be an int, got str '2' {EVERY_RANK}",
        ),
        (
            initialize_per_rank,
            ({}, {0: {"tp_size": 2}}),
            DisagreementError,
            (
                "init_parallel: ranks disagree on tp (rank 0: 2; ranks [1, 2, 3]: 1); every rank must build "
                "the same mesh"
            ),
        ),
        (
            initialize_per_rank,
            ({"pp_size": 2}, {0: {"virtual_pipeline_model_parallel_size": 2}}),
            DisagreementError,
            (
                "initialize_model_parallel: ranks disagree on virtual_pipeline_model_parallel_size (rank 0: 2; ranks "
                "[1, 2, 3]: None); every rank must pass the same arguments"
            ),
        ),
        (
            initialize_per_rank,
            ({"pp_size": 2, "get_embedding_ranks": outside_the_pipeline}, {}),
            ValueError,
            (
                "initialize_model_parallel: get_embedding_ranks([0, 1]) returned [2]: it must return distinct ranks of "
                "that pipeline (at least one)"
            ),
        ),
        (
            initialize_twice,
            (),
            LegacyStateError,  # a StateError and Megatron's AssertionError
            (
                "initialize_model_parallel: model parallel is already initialized (ParallelDims(tp=2, cp=1, pp=1, dp=2, "
                "order='tp-cp-pp-dp')); call wf_mesh.destroy_model_parallel() before initializing again"
            ),
        ),
        (
            initialize_per_rank,
            ({"pipeline_model_parallel_comm_backend": "ucc"}, {}),
            NotImplementedError,
            (
                "initialize_model_parallel: pipeline_model_parallel_comm_backend='ucc' is not supported: pipeline groups "
                "use the default group's backend 'gloo'"
            ),
        ),
        (
            initialize_per_rank,
            ({"expert_model_parallel_size": 2, "use_sharp": True}, {}),
            NotImplementedError,
            (
                "initialize_model_parallel: not supported by wf_mesh (dense tp/cp/pp/dp only): expert_model_parallel_size=2 "
                "(expert parallelism), use_sharp=True (SHARP)"
            ),
        ),
    ],
    ids=[
        "bad-degree-on-one-rank",
        "bad-type-on-one-rank",
        "ranks-disagree-on-tp",
        "ranks-disagree-on-vpp",
        "embedding-ranks-outside-pipeline",
        "initialized-twice",
        "ucc-pipeline-backend",
        "expert-parallel",
    ],
)
def test_initialize_errors_on_every_rank(fn, args, error, message):
    for exc in run_distributed(WORLD, fn, *args, return_exceptions=True):
        assert type(exc) is error
        assert str(exc) == message


def getter_after_initialize(init_kwargs, getter):
    ps.initialize_model_parallel(**init_kwargs)
    group = getattr(ps, getter)()
    return dist.get_process_group_ranks(group)


def test_gloo_groups_not_created():
    for exc in run_distributed(
        WORLD,
        getter_after_initialize,
        {"create_gloo_process_groups": False},
        "get_data_parallel_group_gloo",
        return_exceptions=True,
    ):
        assert type(exc) is LegacyStateError and isinstance(exc, AssertionError)
        assert str(exc) == "no Gloo groups: initialize_model_parallel was called with create_gloo_process_groups=False"


def gloo_on_first_request():
    """Megatron's Gloo groups: none until the first request (every rank makes it), then dp's ranks on Gloo."""
    held = process_group_counts()[0]
    ps.initialize_model_parallel(cp_size=2)  # 4 ranks: cp=2, dp=2
    out = {"before": (ps._DATA_PARALLEL_GROUP_GLOO, process_group_counts()[0] - held)}
    built = process_group_counts()[0]
    dp, dp_cp = ps.get_dp_group_gloo(), ps.get_dp_group_gloo(with_context_parallel=True)
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total, group=dp)
    out["groups"] = {
        "ranks": (dist.get_process_group_ranks(dp), dist.get_process_group_ranks(dp_cp)),
        "mesh": (dist.get_process_group_ranks(ps.get_dp_group()), dist.get_process_group_ranks(ps.get_dp_group(True))),
        "backends": (dist.get_backend(dp), dist.get_backend(dp_cp)),
        "own": dp is not ps.get_dp_group() and dp_cp is not ps.get_dp_group(True),
        "again": ps.get_dp_group_gloo() is dp and ps.get_dp_group_gloo(True) is dp_cp,
        "globals": ps._DATA_PARALLEL_GROUP_GLOO is dp and ps._DATA_PARALLEL_GROUP_WITH_CP_GLOO is dp_cp,
        "sum": total.item(),
        "created": process_group_counts()[0] - built > 0,
    }
    ps.destroy_model_parallel()
    out["after"] = (ps._DATA_PARALLEL_GROUP_GLOO, process_group_counts()[0] - held)
    return out


def test_gloo_groups_made_on_first_request():
    plan = wf_mesh.ParallelDims(cp=2).resolve(WORLD)
    for rank, got in enumerate(run_distributed(WORLD, gloo_on_first_request)):
        dp, dp_cp = plan.group_of("dp", rank), plan.group_of("dp-cp", rank)
        assert got["before"][0] is None and got["after"] == (None, 0)
        assert got["groups"] == {
            "ranks": (dp, dp_cp),
            "mesh": (dp, dp_cp),
            "backends": ("gloo", "gloo"),
            "own": True,
            "again": True,
            "globals": True,
            "sum": sum(dp),
            "created": True,
        }


def test_embedding_group_outside_it():
    """pp=4: the middle stages hold no embedding; Megatron asserts there, the ends get their group."""
    got = run_distributed(WORLD, getter_after_initialize, {"pp_size": 4}, "get_embedding_group", return_exceptions=True)
    pipeline = [0, 1, 2, 3]
    for rank, result in enumerate(got):
        if rank in (0, 3):
            assert result == [0, 3]
        else:
            assert type(result) is LegacyStateError
            assert isinstance(result, StateError) and isinstance(result, AssertionError)
            assert str(result) == (
                f"rank {rank} is in no embedding group: its pipeline {pipeline} has embedding ranks "
                f"[{pipeline[0]}, {pipeline[-1]}]"
            )


# ---- errors raised at once, before any collective (no torch.distributed needed) -----------------------
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            {"tp_size": 2, "tensor_model_parallel_size": 2},
            TypeError,
            (
                "initialize_model_parallel got both tp_size=2 and tensor_model_parallel_size=2: they are the same degree, "
                "pass one"
            ),
        ),
        ({"cp_size": 1, "context_parallel_size": 2}, TypeError, "got both cp_size=1 and context_parallel_size=2"),
        ({"pp_size": 2, "pipeline_model_parallel_size": 2}, TypeError, "got both pp_size=2 and pipeline_model"),
        ({"get_embedding_ranks": [0]}, TypeError, "get_embedding_ranks must be a callable"),
        ({"create_gloo_process_groups": 1}, TypeError, "create_gloo_process_groups must be a bool, got 1"),
        ({"distributed_timeout_minutes": 0}, ValueError, "distributed_timeout_minutes=0 must be > 0"),
        ({"distributed_timeout_minutes": "30"}, TypeError, "distributed_timeout_minutes must be a number"),
        ({"expert_model_parallel_size": 4}, NotImplementedError, "expert_model_parallel_size=4 (expert parallelism)"),
        (
            {"tp_size": 2, "expert_tensor_parallel_size": 1},
            NotImplementedError,
            "expert_tensor_parallel_size=1 (a separate expert tensor-parallel layout; tensor_model_parallel_size=2)",
        ),
        ({"hierarchical_context_parallel_sizes": [2, 2]}, NotImplementedError, "[2, 2] (hierarchical cp)"),
        ({"hybrid_context_parallel": True}, NotImplementedError, "hybrid_context_parallel=True"),
        ({"sharp_enabled_group": "dp"}, NotImplementedError, "sharp_enabled_group='dp' (SHARP)"),
        ({"num_distributed_optimizer_instances": 2}, NotImplementedError, "=2 (partial data parallel)"),
        ({"create_all_gather_group": True}, NotImplementedError, "create_all_gather_group=True"),
        ({"high_priority_stream_groups": ["dp_cp"]}, NotImplementedError, "['dp_cp'] (high-priority NCCL streams)"),
        ({"encoder_pipeline_model_parallel_size": 1}, NotImplementedError, "=1 (encoder pipeline)"),
        ({"pipeline_model_parallel_split_rank": 2}, NotImplementedError, "split_rank=2 (encoder pipeline)"),
    ],
)
def test_local_errors_need_no_collective(kwargs, error, message):
    assert not dist.is_initialized()  # raised before torch.distributed is even looked at
    with pytest.raises(error) as info:
        ps.initialize_model_parallel(**kwargs)
    assert type(info.value) is error and message in str(info.value)


def test_megatron_order_and_expert_defaults_are_accepted_locally():
    """ep=1 (an "ep" in the order), expert_tensor_parallel_size == tp and the off values of the unsupported
    features pass the local checks: what stops them here is only the missing torch.distributed."""
    with pytest.raises(StateError, match="initialize_model_parallel needs torch.distributed"):
        ps.initialize_model_parallel(
            tensor_model_parallel_size=2,
            order="tp-cp-ep-dp-pp",
            expert_model_parallel_size=1,
            expert_tensor_parallel_size=2,
            hierarchical_context_parallel_sizes=None,
            create_all_gather_group=None,
            encoder_tensor_model_parallel_size=None,
            high_priority_stream_groups=[],
        )


def test_data_parallel_getter_argument_errors():
    with pytest.raises(ValueError, match="partial_data_parallel=True needs with_context_parallel=True"):
        ps.get_data_parallel_group(partial_data_parallel=True)
    with pytest.raises(StateError, match="independent_all_gather=True: wf_mesh builds no separate all-gather group"):
        ps.get_data_parallel_group(with_context_parallel=True, independent_all_gather=True)


# ---- NCCL communicator YAML ------------------------------------------------------------------------
def test_communicator_config_parsing(tmp_path):
    good = tmp_path / "comm.yaml"
    good.write_text("tp:\n  min_ctas: 2\n  max_ctas: 8\nmp:\n  cga_cluster_size: 4\n")
    expected = {"tp": {"min_ctas": 2, "max_ctas": 8}, "tp_pp": {"cga_cluster_size": 4}}
    assert ps.load_nccl_communicator_config(good) == expected
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


# ---- the mesh extension point ------------------------------------------------------------------------------
LEGACY_EXTENSIONS = {"legacy.context_parallel", "legacy.megatron", "legacy.pp_scheduler", "legacy.hsdp_meshes"}


def test_legacy_state_is_listed_as_named_mesh_extensions():
    import wf_mesh.legacy.fsdp  # noqa: F401 - every legacy module that keeps state, imported
    from wf_mesh import mesh

    assert LEGACY_EXTENSIONS <= set(mesh.extensions())
    calls = []
    mesh.register_extension("test.probe", calls.append)
    try:
        assert mesh.extensions()[-1] == "test.probe"
        ps.destroy_model_parallel()  # no mesh: every extension is reset all the same
        ps.destroy_model_parallel(destroy_process_groups=False)
        assert calls == [True, False]
    finally:
        mesh.register_extension("test.probe", lambda destroy_process_groups: None)


def extension_resets_on_destroy():
    """Each legacy extension holds state after use and none after the mesh is destroyed."""
    from wf_mesh.legacy import context_parallel, fsdp, model_parallel, pipeline

    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    wf_mesh.find_split((1, 16, 24, 88, 160), 16)
    context_parallel.mesh_for_group(ps.get_dp_group())  # not the cp group: a mesh of its own, cached
    fsdp.hsdp_device_mesh(2, 2)
    pipeline.init_pp_scheduler()
    ps.set_tensor_model_parallel_rank(1)

    def held():
        return (
            context_parallel.state.cp_size_t,
            len(context_parallel.state.group_meshes),
            len(fsdp._meshes),
            pipeline.pp_scheduler_or_none() is not None,
            model_parallel.state.tp_rank,
        )

    used = held()
    wf_mesh.get_parallel_mesh().destroy()  # the native destroy resets the legacy state too
    return used, held()


def test_extensions_reset_with_the_mesh():
    for used, after in run_distributed(WORLD, extension_resets_on_destroy):
        assert used == (8, 1, 1, True, 1)
        assert after == (None, 0, 0, False, None)


# ---- the legacy AssertionError contract ------------------------------------------------------------------
def test_native_errors_are_not_assertions_and_legacy_ones_are_both():
    from wf_mesh import errors
    from wf_mesh.legacy import errors as legacy

    assert [name for name in errors.__all__ if issubclass(getattr(errors, name), AssertionError)] == []
    pairs = {
        legacy.LegacyStateError: errors.StateError,
        legacy.LegacyNotInitializedError: errors.NotInitializedError,
        legacy.PipelineStateError: errors.StateError,
        legacy.LegacyIndivisibleSequenceError: errors.IndivisibleSequenceError,
    }
    for legacy_type, native in pairs.items():
        assert issubclass(legacy_type, native) and issubclass(legacy_type, AssertionError)
    for native, expected in [
        (errors.NotInitializedError, legacy.LegacyNotInitializedError),
        (errors.StateError, legacy.LegacyStateError),
        (errors.IndivisibleSequenceError, legacy.LegacyIndivisibleSequenceError),
    ]:
        with pytest.raises(AssertionError) as caught, legacy.asserting():
            raise native("the message")
        assert type(caught.value) is expected and str(caught.value) == "the message"
    with pytest.raises(KeyError), legacy.asserting():  # anything else passes through
        raise KeyError("x")
