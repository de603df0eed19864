"""wf_mesh.parallel_state against Megatron-LM's documented parallel_state behaviour, called the Megatron way.

Expected groups are computed here, independently of wf_mesh: Megatron puts global rank
``sum(coord[a] * prod(size of the axes before a in order))`` at each coordinate (order lists the FASTEST axis
first; an ``ep`` of size 1 takes no room), and a group of some axes is every rank sharing the coordinates of
the OTHER axes, in ascending rank order. Written-out tables pin the same facts for Megatron's own example
(tp=2, pp=4 on 8 GPUs: first pipeline rank ``rank % 2``, next ``(rank + 2) % 8``, prev ``(rank - 2) % 8``).
"""

import pytest
import torch
import torch.distributed as dist

from wf_mesh import parallel_state as ps
from wf_mesh.errors import DegreeError, NotInitializedError
from wf_mesh.testing import run_distributed

WORLD = 8
SMALL = 4  # before-initialization and error checks need no 8-rank layout: 4 ranks are cheaper on a small machine


# ---- the independent reference ------------------------------------------------------------------------
def coords(rank, order, sizes):
    """Megatron's coordinates of ``rank``: the order's first axis varies fastest."""
    out = {}
    for axis in order.split("-"):
        rank, out[axis] = divmod(rank, sizes[axis])
    return out


def ref_group(rank, order, sizes, *axes):
    """Ranks sharing ``rank``'s coordinates on every axis not in ``axes``, ascending."""
    mine = coords(rank, order, sizes)
    others = [a for a in order.split("-") if a not in axes]
    return [q for q in range(WORLD) if all(coords(q, order, sizes)[a] == mine[a] for a in others)]


def last_stage_only(pipeline):
    """A custom ``get_embedding_ranks``: the embeddings live on the last stage only."""
    return [pipeline[-1]]


# ---- what every rank reports --------------------------------------------------------------------------
def _ranks(group):
    return None if group is None else dist.get_process_group_ranks(group)


def _live_sum(group):
    """All-reduce this rank's number over ``group``: proves the group works, not just its bookkeeping."""
    if group is None:
        return None
    total = torch.tensor([dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(total, group=group)
    return total.item()


def megatron_report(tp, cp, pp, order, custom_embedding=False, vpp=None):
    kwargs = {"get_embedding_ranks": last_stage_only} if custom_embedding else {}
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        order=order,
        **kwargs,
    )
    r = _ranks
    out = {
        "initialized": (ps.model_parallel_is_initialized(), ps.is_initialized(), ps.has_separate_all_gather_group()),
        "tp": (
            r(ps.get_tensor_model_parallel_group()),
            ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_src_rank(),
        ),
        "pp": (
            r(ps.get_pipeline_model_parallel_group()),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_rank(),
        ),
        "pp_ring": (
            ps.get_pipeline_model_parallel_first_rank(),
            ps.get_pipeline_model_parallel_last_rank(),
            ps.get_pipeline_model_parallel_next_rank(),
            ps.get_pipeline_model_parallel_prev_rank(),
            ps.is_pipeline_first_stage(),
            ps.is_pipeline_last_stage(),
        ),
        "dp": (
            r(ps.get_data_parallel_group()),
            ps.get_data_parallel_world_size(),
            ps.get_data_parallel_rank(),
            ps.get_data_parallel_src_rank(),
            r(ps.get_data_parallel_group_gloo()),
        ),
        "dp_cp": (
            r(ps.get_data_parallel_group(with_context_parallel=True)),
            ps.get_data_parallel_world_size(with_context_parallel=True),
            ps.get_data_parallel_rank(with_context_parallel=True),
            ps.get_data_parallel_src_rank(with_context_parallel=True),
            r(ps.get_data_parallel_group_gloo(with_context_parallel=True)),
            r(ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)),
        ),
        "cp": (
            r(ps.get_context_parallel_group()),
            ps.get_context_parallel_world_size(),
            ps.get_context_parallel_rank(),
            ps.get_context_parallel_global_ranks(),
        ),
        "tp_cp": (
            r(ps.get_tensor_and_context_parallel_group()),
            ps.get_tensor_and_context_parallel_world_size(),
            ps.get_tensor_and_context_parallel_rank(),
        ),
        "mp": (r(ps.get_model_parallel_group()), ps.get_model_parallel_src_rank()),
        "tp_dp": (
            r(ps.get_tensor_and_data_parallel_group()),
            r(ps.get_tensor_and_data_parallel_group(with_context_parallel=True)),
        ),
        "amax": [
            r(ps.get_amax_reduction_group(with_context_parallel=w, tp_only_amax_red=t))
            for w in (False, True)
            for t in (False, True)
        ],
        "unchecked": [
            r(g)
            for g in (
                ps.get_tensor_model_parallel_group(check_initialized=False),
                ps.get_pipeline_model_parallel_group(check_initialized=False),
                ps.get_context_parallel_group(check_initialized=False),
                ps.get_model_parallel_group(check_initialized=False),
                ps.get_tensor_and_context_parallel_group(check_initialized=False),
                ps.get_tensor_and_data_parallel_group(check_initialized=False),
                ps.get_data_parallel_group(check_initialized=False),
            )
        ]
        + [ps.get_context_parallel_global_ranks(check_initialized=False)],
        "embedding": (
            r(ps.get_embedding_group(check_initialized=False)),
            ps.is_rank_in_embedding_group(),
            _live_sum(ps.get_embedding_group(check_initialized=False)),
        ),
        "position": (
            r(ps.get_position_embedding_group(check_initialized=False)),
            ps.is_rank_in_position_embedding_group(),
            _live_sum(ps.get_position_embedding_group(check_initialized=False)),
        ),
        "vpp": (ps.get_virtual_pipeline_model_parallel_rank(), ps.get_virtual_pipeline_model_parallel_world_size()),
    }
    if ps.is_rank_in_embedding_group():
        out["embedding_checked"] = r(ps.get_embedding_group())  # check_initialized=True works for members
    if vpp is not None:
        out["virtual"] = virtual_report()
    stage, stages = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    # Overrides win over the groups until reset with None (Megatron's set_* semantics).
    ps.set_tensor_model_parallel_world_size(3)
    ps.set_tensor_model_parallel_rank(5)
    ps.set_pipeline_model_parallel_rank((stage + 1) % stages)
    out["tp_overridden"] = (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tp_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tp_rank(),
        ps.get_tp_world_size(with_context_parallel=True),
    )
    out["pp_rank_overridden"] = (
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_next_rank(),
        ps.get_pipeline_model_parallel_prev_rank(),
        ps.is_pipeline_first_stage(),
        ps.is_pipeline_last_stage(),
    )
    ps.set_pipeline_model_parallel_world_size(1)
    ps.set_pipeline_model_parallel_rank(0)
    out["pp_single_stage"] = (
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_last_rank(),
        ps.get_pipeline_model_parallel_next_rank(),
        ps.is_pipeline_first_stage(),
        ps.is_pipeline_last_stage(),
    )
    for setter in (
        ps.set_tensor_model_parallel_world_size,
        ps.set_tensor_model_parallel_rank,
        ps.set_pipeline_model_parallel_world_size,
        ps.set_pipeline_model_parallel_rank,
    ):
        setter(None)
    out["reset"] = (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_rank(),
    )
    return out


def virtual_report():
    """Megatron's virtual-pipeline semantics (called right after initialize with a virtual size of 2)."""
    first, last = ps.is_pipeline_first_stage, ps.is_pipeline_last_stage
    out = {
        "by_stage": [
            (
                first(ignore_virtual=False, vp_stage=s),
                last(ignore_virtual=False, vp_stage=s),
                ps.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=s),
            )
            for s in (0, 1)
        ],
        "ignored": (first(), last(), first(vp_stage=1), last(vp_stage=0)),
        "current_rank_0": (first(ignore_virtual=False), last(ignore_virtual=False)),  # no vp_stage: the set rank
    }
    ps.set_virtual_pipeline_model_parallel_rank(1)
    out["current_rank_1"] = (
        ps.get_virtual_pipeline_model_parallel_rank(),
        first(ignore_virtual=False),
        last(ignore_virtual=False),
    )
    ps.set_tensor_model_parallel_world_size(3)
    ps.destroy_model_parallel()
    out["after_destroy"] = (
        ps.get_virtual_pipeline_model_parallel_rank(),
        ps.get_virtual_pipeline_model_parallel_world_size(),
        ps.is_rank_in_embedding_group(),
        ps.is_rank_in_position_embedding_group(),
        ps.model_parallel_is_initialized(),
    )
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=4, order=ps.MEGATRON_ORDER)
    out["reinitialized"] = (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_virtual_pipeline_model_parallel_world_size(),
    )
    return out


CONFIGS = {
    # (tp, cp, pp, order, custom get_embedding_ranks)
    "wf_mesh-order": (2, 1, 2, "tp-cp-pp-dp", True),
    "megatron-order": (1, 2, 2, "tp-cp-ep-dp-pp", False),
    "dp-fastest-pp1": (2, 2, 1, "dp-cp-tp-pp", False),
}


def check_report(rank, got, tp, cp, pp, order, custom_embedding):
    sizes = {"tp": tp, "cp": cp, "pp": pp, "ep": 1, "dp": WORLD // (tp * cp * pp)}

    def g(*axes):
        return ref_group(rank, order, sizes, *axes)

    pipeline, stage = g("pp"), g("pp").index(rank)
    assert got["initialized"] == (True, True, False)
    assert got["tp"] == (g("tp"), tp, g("tp").index(rank), g("tp")[0])
    assert got["pp"] == (pipeline, pp, stage)
    assert got["pp_ring"] == (
        pipeline[0],
        pipeline[-1],
        pipeline[(stage + 1) % pp],
        pipeline[(stage - 1) % pp],
        stage == 0,
        stage == pp - 1,
    )
    dp = g("dp")
    assert got["dp"] == (dp, len(dp), dp.index(rank), dp[0], dp)
    dp_cp = g("dp", "cp")
    assert got["dp_cp"] == (dp_cp, len(dp_cp), dp_cp.index(rank), dp_cp[0], dp_cp, dp_cp)
    assert got["cp"] == (g("cp"), cp, g("cp").index(rank), g("cp"))
    assert got["tp_cp"] == (g("tp", "cp"), tp * cp, g("tp", "cp").index(rank))
    assert got["mp"] == (g("tp", "pp"), g("tp", "pp")[0])
    assert got["tp_dp"] == (g("tp", "dp"), g("tp", "dp", "cp"))
    # amax: (cp?, tp only?) = (F, F) tp-dp, (F, T) tp, (T, F) tp-dp-cp, (T, T) tp-cp
    assert got["amax"] == [g("tp", "dp"), g("tp"), g("tp", "dp", "cp"), g("tp", "cp")]
    assert got["unchecked"] == [g("tp"), pipeline, g("cp"), g("tp", "pp"), g("tp", "cp"), g("tp", "dp"), dp, g("cp")]
    embedding = [pipeline[-1]] if custom_embedding else sorted({pipeline[0], pipeline[-1]})
    member = rank in embedding
    assert got["embedding"] == ((embedding, True, sum(embedding)) if member else (None, False, None))
    assert got.get("embedding_checked") == (embedding if member else None)
    first_stage = rank == pipeline[0]
    assert got["position"] == (([rank], True, rank) if first_stage else (None, False, None))
    # Overrides: tp size 3 and rank 5 (tp x cp untouched); pp rank = stage + 1; then a single stage.
    assert got["tp_overridden"] == (3, 3, 5, 5, tp * cp)
    moved = (stage + 1) % pp
    assert got["pp_rank_overridden"] == (
        moved,
        pipeline[(moved + 1) % pp],
        pipeline[(moved - 1) % pp],
        moved == 0,
        moved == pp - 1,
    )
    assert got["pp_single_stage"] == (1, pipeline[0], pipeline[0], True, True)
    assert got["reset"] == (tp, g("tp").index(rank), pp, stage)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_groups_match_megatron_layout(config):
    tp, cp, pp, order, custom = CONFIGS[config]
    reports = run_distributed(WORLD, megatron_report, tp, cp, pp, order, custom)
    for rank, got in enumerate(reports):
        check_report(rank, got, tp, cp, pp, order, custom)
        assert got["vpp"] == (None, None)


# Written-out expectations for the layouts above (Megatron's rank formula done by hand).
TABLES = {
    "wf_mesh-order": {  # rank = tp + 2 * pp + 4 * dp
        "pp": [[0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]],
        "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [0, 4], [1, 5], [2, 6], [3, 7]],
        "embedding": [None, None, [2], [3], None, None, [6], [7]],
    },
    "megatron-order": {  # rank = cp + 2 * dp + 4 * pp
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7], [0, 4], [1, 5], [2, 6], [3, 7]],
        "dp": [[0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]],
        "embedding": [[0, 4], [1, 5], [2, 6], [3, 7], [0, 4], [1, 5], [2, 6], [3, 7]],
    },
    "dp-fastest-pp1": {  # rank = dp + 2 * cp + 4 * tp; pp=1: each rank is its own pipeline and embedding group
        "pp": [[r] for r in range(WORLD)],
        "dp": [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7]],
        "embedding": [[r] for r in range(WORLD)],
    },
}


def test_reference_matches_written_tables():
    for name, table in TABLES.items():
        tp, cp, pp, order, custom = CONFIGS[name]
        sizes = {"tp": tp, "cp": cp, "pp": pp, "ep": 1, "dp": WORLD // (tp * cp * pp)}
        for rank in range(WORLD):
            pipeline = ref_group(rank, order, sizes, "pp")
            assert pipeline == table["pp"][rank]
            assert ref_group(rank, order, sizes, "dp") == table["dp"][rank]
            embedding = last_stage_only(pipeline) if custom else sorted({pipeline[0], pipeline[-1]})
            assert (embedding if rank in embedding else None) == table["embedding"][rank]


def test_megatron_tp2_pp4_example_with_virtual_pipeline():
    """Megatron's unit-test layout: tp=2, pp=4, its default order, plus an interleaved schedule of 2."""
    reports = run_distributed(WORLD, megatron_report, 2, 1, 4, ps.MEGATRON_ORDER, False, 2)
    for rank, got in enumerate(reports):
        check_report(rank, got, 2, 1, 4, ps.MEGATRON_ORDER, False)
        assert got["pp"][0] == [rank % 2, rank % 2 + 2, rank % 2 + 4, rank % 2 + 6]
        assert got["pp_ring"][:4] == (rank % 2, rank % 2 + 6, (rank + 2) % 8, (rank - 2) % 8)
        assert got["dp"][3] == rank  # dp = 1: each rank is its own data-parallel source
        assert got["embedding"][0] == ([rank % 2, rank % 2 + 6] if rank in (0, 1, 6, 7) else None)
        assert got["vpp"] == (0, 2)
        stage = rank // 2
        v = got["virtual"]
        # ignore_virtual=False: first stage only in virtual stage 0, last stage only in virtual stage 1.
        assert v["by_stage"] == [(stage == 0, False, stage == 0), (False, stage == 3, stage == 3)]
        assert v["ignored"] == (stage == 0, stage == 3, stage == 0, stage == 3)
        assert v["current_rank_0"] == (stage == 0, False)
        assert v["current_rank_1"] == (1, False, stage == 3)
        assert v["after_destroy"] == (None, None, False, False, False)
        assert v["reinitialized"] == (2, None)  # the tp override and the virtual size did not survive destroy


# ---- before initialization, and Megatron's initialization errors --------------------------------------
GROUP_GETTERS = [
    "get_tensor_model_parallel_group",
    "get_pipeline_model_parallel_group",
    "get_data_parallel_group",
    "get_data_parallel_group_gloo",
    "get_context_parallel_group",
    "get_model_parallel_group",
    "get_tensor_and_context_parallel_group",
    "get_tensor_and_data_parallel_group",
    "get_embedding_group",
    "get_position_embedding_group",
    "get_amax_reduction_group",
    "get_context_parallel_global_ranks",
]


def before_initialize():
    return (
        [getattr(ps, name)(check_initialized=False) for name in GROUP_GETTERS],
        ps.model_parallel_is_initialized(),
        ps.is_initialized(),
        ps.is_rank_in_embedding_group(),
        ps.is_rank_in_position_embedding_group(),
        ps.get_virtual_pipeline_model_parallel_world_size(),
    )


def call(name, *args, **kwargs):
    return getattr(ps, name)(*args, **kwargs)


def test_before_initialize():
    nothing = ([None] * len(GROUP_GETTERS), False, False, False, False, None)
    assert run_distributed(SMALL, before_initialize) == [nothing] * SMALL
    errors = run_distributed(SMALL, call, "get_tensor_model_parallel_group", return_exceptions=True)
    for error in errors:  # Megatron asserts: callers catch AssertionError
        assert isinstance(error, NotInitializedError) and isinstance(error, AssertionError)
        assert str(error).startswith("model parallel is not initialized: call wf_mesh.initialize_model_parallel(")


RANK_GETTERS = [
    "get_data_parallel_src_rank",
    "get_model_parallel_src_rank",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_next_rank",
    "get_tensor_model_parallel_src_rank",
]


@pytest.mark.parametrize("name", GROUP_GETTERS + RANK_GETTERS)
def test_getters_assert_without_torch_distributed(name):
    """In a process without torch.distributed: Megatron's AssertionError (here a NotInitializedError)."""
    assert not dist.is_initialized()
    with pytest.raises(AssertionError, match="model parallel is not initialized"):
        call(name)


def test_initialize_asserts_without_torch_distributed():
    with pytest.raises(AssertionError, match="initialize_model_parallel needs torch.distributed"):
        ps.initialize_model_parallel(order=ps.MEGATRON_ORDER)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"tensor_model_parallel_size": 2 * SMALL},
            "initialize_model_parallel: world_size=4 is not divisible by tp*cp*pp = 8*1*1 = 8; cannot infer dp",
        ),
        (
            {"virtual_pipeline_model_parallel_size": 2},
            (
                "initialize_model_parallel: virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1 "
                "(got 1): the interleaved schedule splits pipeline stages"
            ),
        ),
    ],
)
def test_initialize_raises_runtime_error_on_every_rank(kwargs, message):
    """Megatron raises RuntimeError for both; wf_mesh's DegreeError is one, raised on every rank."""
    errors = run_distributed(
        SMALL, call, "initialize_model_parallel", order=ps.MEGATRON_ORDER, return_exceptions=True, **kwargs
    )
    for error in errors:
        assert type(error) is DegreeError and isinstance(error, RuntimeError)
        assert str(error) == message


# ---- Megatron's module globals (what test_initialize_and_destroy_model_parallel and callers read) -----
GROUP_GLOBALS = {  # global -> the axes of its group (None: not a mesh axis)
    "_MODEL_PARALLEL_GROUP": ("tp", "pp"),
    "_TENSOR_MODEL_PARALLEL_GROUP": ("tp",),
    "_PIPELINE_MODEL_PARALLEL_GROUP": ("pp",),
    "_DATA_PARALLEL_GROUP": ("dp",),
    "_DATA_PARALLEL_GROUP_WITH_CP": ("dp", "cp"),
    "_CONTEXT_PARALLEL_GROUP": ("cp",),
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": ("tp", "cp"),
    "_TENSOR_AND_DATA_PARALLEL_GROUP": ("tp", "dp"),
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": ("tp", "dp", "cp"),
}
RANK_GLOBALS = {
    "_MODEL_PARALLEL_GLOBAL_RANKS": ("tp", "pp"),
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": ("tp",),
    "_PIPELINE_GLOBAL_RANKS": ("pp",),
    "_DATA_PARALLEL_GLOBAL_RANKS": ("dp",),
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": ("dp", "cp"),
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": ("cp",),
}


def read_globals():
    return {name: getattr(ps, name) for name in ps.MEGATRON_GLOBALS}


def globals_report(tp, cp, pp, order):
    out = {"before": read_globals()}
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp, pipeline_model_parallel_size=pp, order=order
    )
    from wf_mesh.compat.worldfoundry import model_parallel_groups
    from wf_mesh.parallel_state import _MODEL_PARALLEL_GROUP  # a from-import reads it live too

    live = read_globals()
    out["from_import"] = _MODEL_PARALLEL_GROUP is ps.get_model_parallel_group()
    out["compat"] = model_parallel_groups._CONTEXT_PARALLEL_GROUP is ps.get_context_parallel_group()
    out["groups"] = {name: _ranks(live[name]) for name in GROUP_GLOBALS}
    out["sums"] = {name: _live_sum(live[name]) for name in GROUP_GLOBALS}
    out["same_as_getters"] = (
        live["_TENSOR_MODEL_PARALLEL_GROUP"] is ps.get_tensor_model_parallel_group(),
        live["_DATA_PARALLEL_GROUP_WITH_CP"] is ps.get_data_parallel_group(with_context_parallel=True),
        live["_EMBEDDING_GROUP"] is ps.get_embedding_group(check_initialized=False),
    )
    out["ranks"] = {name: live[name] for name in RANK_GLOBALS}
    out["embedding"] = (_ranks(live["_EMBEDDING_GROUP"]), live["_EMBEDDING_GLOBAL_RANKS"])
    out["position"] = (_ranks(live["_POSITION_EMBEDDING_GROUP"]), live["_POSITION_EMBEDDING_GLOBAL_RANKS"])
    out["gloo_before_request"] = (live["_DATA_PARALLEL_GROUP_GLOO"], live["_DATA_PARALLEL_GROUP_WITH_CP_GLOO"])
    ps.get_data_parallel_group_gloo()
    out["gloo"] = (_ranks(ps._DATA_PARALLEL_GROUP_GLOO), _ranks(ps._DATA_PARALLEL_GROUP_WITH_CP_GLOO))
    ps.set_tensor_model_parallel_world_size(3)
    ps.set_pipeline_model_parallel_rank(0)
    out["overrides"] = (
        ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE,
        ps._MPU_PIPELINE_MODEL_PARALLEL_RANK,
        ps._MPU_TENSOR_MODEL_PARALLEL_RANK,
        ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE,
    )
    ps.destroy_model_parallel()
    out["after"] = read_globals()
    return out


def test_module_globals_read_the_live_groups():
    """Megatron's test_initialize_and_destroy_model_parallel reads ``_MODEL_PARALLEL_GROUP`` and its siblings:
    the live groups after initialize, None before it and after destroy."""
    tp, cp, pp, order = 1, 2, 2, ps.MEGATRON_ORDER
    sizes = {"tp": tp, "cp": cp, "pp": pp, "ep": 1, "dp": WORLD // (tp * cp * pp)}
    nothing = dict.fromkeys(ps.MEGATRON_GLOBALS)
    assert set(GROUP_GLOBALS) | set(RANK_GLOBALS) < set(ps.MEGATRON_GLOBALS)
    for rank, got in enumerate(run_distributed(WORLD, globals_report, tp, cp, pp, order)):

        def g(*axes, rank=rank):
            return ref_group(rank, order, sizes, *axes)

        assert got["before"] == nothing and got["after"] == nothing
        assert got["from_import"] and got["compat"] and got["same_as_getters"] == (True, True, True)
        assert got["groups"] == {name: g(*axes) for name, axes in GROUP_GLOBALS.items()}
        assert got["sums"] == {name: sum(g(*axes)) for name, axes in GROUP_GLOBALS.items()}
        assert got["ranks"] == {name: g(*axes) for name, axes in RANK_GLOBALS.items()}
        pipeline = g("pp")
        embedding = [pipeline[0], pipeline[-1]]
        assert got["embedding"] == ((embedding if rank in embedding else None), embedding)
        assert got["position"] == (([rank] if rank == pipeline[0] else None), [pipeline[0]])
        assert got["gloo_before_request"] == (None, None)
        assert got["gloo"] == (g("dp"), g("dp", "cp"))
        assert got["overrides"] == (3, 0, None, None)


def test_module_globals_without_torch_distributed():
    assert not dist.is_initialized()
    assert read_globals() == dict.fromkeys(ps.MEGATRON_GLOBALS)
    assert "_MODEL_PARALLEL_GROUP" in dir(ps)
    with pytest.raises(AttributeError, match="has no attribute '_NO_SUCH_GROUP'"):
        ps._NO_SUCH_GROUP  # noqa: B018
