"""Pure topology: ParallelDims against docs/design.md section 2.1 and an independent Megatron-style reference."""

import dataclasses
import itertools
import math
import re

import pytest

from wf_mesh import topology
from wf_mesh.errors import DegreeError
from wf_mesh.topology import AXES, AXIS_TABLE, DEFAULT_ORDER, DERIVED_AXES, FSDP_AXIS, Axis, ParallelDims, parse_axes

TOKENS = ["tp", "cp", "pp", "dp", "tp-cp", "dp-cp", "tp-pp", "tp-cp-dp", "tp-dp", "cp-pp", "tp-cp-pp-dp"]


def megatron_groups(world_size, sizes, mask):
    """Megatron-LM's generate_masked_orthogonal_rank_groups, written out independently."""

    def prefix_product(a):
        out, acc = [1], 1
        for v in a:
            acc *= v
            out.append(acc)
        return out

    def decompose(index, shape):
        return [(index // d) % s for s, d in zip(shape, prefix_product(shape))]

    def inner(a, b):
        return sum(x * y for x, y in zip(a, b))

    stride = prefix_product(sizes)
    masked_shape = [s for s, m in zip(sizes, mask) if m]
    unmasked_shape = [s for s, m in zip(sizes, mask) if not m]
    masked_stride = [d for d, m in zip(stride, mask) if m]
    unmasked_stride = [d for d, m in zip(stride, mask) if not m]
    group_size = math.prod(masked_shape)
    return [
        [
            inner(decompose(i, masked_shape), masked_stride) + inner(decompose(g, unmasked_shape), unmasked_stride)
            for i in range(group_size)
        ]
        for g in range(world_size // group_size)
    ]


def factorisations(n):
    for tp, cp, pp in itertools.product([1, 2, 4, 8], repeat=3):
        if n % (tp * cp * pp) == 0:
            yield tp, cp, pp, n // (tp * cp * pp)


FOUR = [a.name for a in AXIS_TABLE if not a.optional]
ORDERS = ["-".join(p) for p in itertools.permutations(FOUR)]


@pytest.mark.parametrize("order", ORDERS)
def test_every_factorisation_of_8_matches_megatron(order):
    for tp, cp, pp, dp in factorisations(8):
        dims = ParallelDims(tp=tp, cp=cp, pp=pp, dp=dp, order=order)
        names = order.split("-")
        sizes = [getattr(dims, a) for a in names]
        for token in TOKENS:
            mask = [a in token.split("-") for a in names]
            expected = megatron_groups(8, sizes, mask)
            assert dims.groups(token) == expected, (dims, token)
            for rank in range(8):
                group = dims.group_of(token, rank)
                assert group in expected and rank in group


# docs/design.md section 2.1 worked examples, order tp-cp-pp-dp.
TABLE = {
    (1, 4, 2, 1): {
        "tp": [[r] for r in range(8)],
        "cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp": [[r] for r in range(8)],
        "tp-cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "dp-cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "tp-pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    },
    (1, 2, 2, 2): {
        "tp": [[r] for r in range(8)],
        "cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "tp-cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp-cp": [[0, 1, 4, 5], [2, 3, 6, 7]],
        "tp-pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    },
    (2, 2, 2, 1): {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp": [[r] for r in range(8)],
        "tp-cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "dp-cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "tp-pp": [[0, 1, 4, 5], [2, 3, 6, 7]],
    },
}


@pytest.mark.parametrize("degrees", list(TABLE))
def test_design_table(degrees):
    tp, cp, pp, dp = degrees
    dims = ParallelDims(tp=tp, cp=cp, pp=pp, dp=dp)
    for token, groups in TABLE[degrees].items():
        assert dims.groups(token) == groups, token


def test_derived_axis_names_are_tokens():
    dims = ParallelDims(tp=2, cp=2, pp=2).resolve(16)
    for name, members in DERIVED_AXES.items():
        assert dims.groups(name) == dims.groups("-".join(members))
    assert dims.groups("dp-cp") == dims.groups("cp-dp")  # inside-group order follows `order`, not the token


def test_rank_arithmetic_round_trips():
    dims = ParallelDims(tp=2, cp=3, pp=2, order="cp-tp-dp-pp").resolve(24)
    assert dims.mesh_dim_names == ("pp", "dp", "tp", "cp")
    assert dims.mesh_shape == (2, 2, 2, 3)
    assert dims.strides() == {"cp": 1, "tp": 3, "dp": 6, "pp": 12}
    for rank in range(24):
        assert dims.rank_of(**dims.coords(rank)) == rank
    assert dims.rank_grid().flatten().tolist() == list(range(24))
    assert dims.rank_of(tp=1, pp=1) == 15


def test_dp_inferred_and_missing_axes_appended():
    dims = ParallelDims(tp=2, order="tp-cp-dp").resolve(8)
    assert (dims.dp, dims.shown_order, dims.world_size) == (4, "tp-cp-dp-pp", 8)
    assert dims.order == "tp-cp-cfg-dp-pp"  # cfg (optional) goes just before dp
    assert ParallelDims(tp=2, order="tp-cp").resolve(2).shown_order == "tp-cp-pp-dp"  # left-out axes of degree 1
    assert ParallelDims().resolve(1).world_size == 1
    assert (dims.tp_enabled, dims.cp_enabled, dims.pp_enabled, dims.dp_enabled) == (True, False, False, True)


def test_size_one_world():
    dims = ParallelDims().resolve(1)
    for token in TOKENS:
        assert dims.groups(token) == [[0]]


@pytest.mark.parametrize(
    "kwargs, world, message",
    [
        (dict(tp=3), 8, "world_size=8 is not divisible by tp*cp*pp = 3*1*1 = 3; cannot infer dp"),
        (dict(tp=2, cp=2, pp=2, dp=2), 8, "tp*cp*pp*dp = 2*2*2*2 = 16 != world_size=8"),
        (dict(tp=0), 8, "tp=0 must be >= 1 (dp may be -1 to infer it); tp=0, cp=1, pp=1, dp=-1"),
        (dict(cp=-2), 8, "cp=-2 must be >= 1"),
        (dict(order="tp-cp-xx-dp"), 8, "bad order 'tp-cp-xx-dp': unknown axes ['xx'], repeated axes []"),
        (dict(order="tp-tp-pp-dp"), 8, "bad order 'tp-tp-pp-dp': unknown axes [], repeated axes ['tp']"),
        (
            dict(cp=2, order="tp-pp-dp"),
            8,
            "order 'tp-pp-dp' leaves out cp=2; an axis may be left out only if its degree is 1",
        ),
        (dict(), 0, "world_size=0 must be >= 1"),
    ],
)
def test_validation_messages(kwargs, world, message):
    with pytest.raises(ValueError) as info:
        ParallelDims(**kwargs).resolve(world)
    assert message in str(info.value)


def test_type_and_lookup_errors():
    with pytest.raises(TypeError, match="tp must be an int, got str '2'"):
        ParallelDims(tp="2")
    dims = ParallelDims(tp=2).resolve(4)
    with pytest.raises(ValueError, match=r"unknown axis 'ep' in 'tp-ep'"):
        dims.groups("tp-ep")
    with pytest.raises(ValueError, match="repeats an axis"):
        parse_axes("tp-tp")
    with pytest.raises(ValueError, match="rank 4 out of range for world_size=4"):
        dims.coords(4)
    with pytest.raises(ValueError, match="tp coordinate 2 out of range for tp=2"):
        dims.rank_of(tp=2)
    with pytest.raises(ValueError, match=r"dp is still -1 .*call .resolve\(world_size\) first"):
        ParallelDims(tp=2).world_size  # noqa: B018 (the property raises)


def test_plans_100k_ranks():
    dims = ParallelDims(tp=8, cp=5, pp=5).resolve(100_000)
    assert dims.dp == 500
    groups = dims.groups("dp-cp")
    assert len(groups) == 100_000 // 2500 and len(groups[0]) == 2500
    assert groups[0][:6] == [0, 8, 16, 24, 32, 200]  # cp (stride 8) fastest, then dp (stride 200)
    assert dims.group_of("dp-cp", 99_999) == groups[-1]


# ---- contract fixes and the cp sub-axes ------------------------------------------------------------------
@pytest.mark.parametrize("order", ["", "tp-cp-pp"])
def test_left_out_axis_is_checked_after_dp_is_inferred(order):
    with pytest.raises(DegreeError, match=f"order {order!r} leaves out dp=2; an axis may be left out only if"):
        ParallelDims(order=order).resolve(2)
    assert ParallelDims(order=order).resolve(1).shown_order == "tp-cp-pp-dp"


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: ParallelDims().resolve("4"), TypeError, "world_size must be an int, got str '4'"),
        (lambda: ParallelDims().resolve(4.0), TypeError, "world_size must be an int, got float 4.0"),
        (lambda: ParallelDims(cp=2.9), TypeError, "cp must be an int, got float 2.9"),
        (lambda: ParallelDims(tp=True), TypeError, "tp must be an int, got bool True"),
        (lambda: ParallelDims().resolve(4).coords(1.5), TypeError, "rank must be an int, got float 1.5"),
        (lambda: ParallelDims().resolve(4).rank_of(dp=1.0), TypeError, "dp coordinate must be an int, got float"),
        (lambda: ParallelDims(cp=4, cp_ulysses=3), DegreeError, "cp_ulysses=3 must divide cp=4"),
        (lambda: ParallelDims(order=["tp"]), TypeError, "order must be a str like 'tp-cp-pp-dp', got list"),
    ],
)
def test_integers_are_checked_as_integers(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_degree_errors_are_value_and_runtime_errors():
    with pytest.raises(ValueError):
        ParallelDims(tp=3).resolve(8)
    with pytest.raises(RuntimeError):  # what Megatron's initialize_model_parallel raises there
        ParallelDims(tp=3).resolve(8)


def test_cp_sub_axes_split_cp_with_ulysses_fastest():
    dims = ParallelDims(tp=2, cp=8, cp_ulysses=2).resolve(32)  # dp = 2
    assert (dims.cp_ring, dims.degree("cp_ulysses"), dims.degree("cp_ring"), dims.degree("cp")) == (4, 2, 4, 8)
    cp_group = dims.group_of("cp", 0)
    assert cp_group == [0, 2, 4, 6, 8, 10, 12, 14]
    # cp index = ring * cp_ulysses + ulysses: Ulysses groups are consecutive cp ranks, rings stride over them
    assert dims.group_of("cp_ulysses", 0) == [0, 2] and dims.group_of("cp_ulysses", 6) == [4, 6]
    assert dims.group_of("cp_ring", 0) == [0, 4, 8, 12] and dims.group_of("cp_ring", 2) == [2, 6, 10, 14]
    assert dims.groups("cp_ring-cp_ulysses") == dims.groups("cp")
    assert dims.groups("dp_cp_ring")[0] == [0, 4, 8, 12, 16, 20, 24, 28]
    for rank in range(32):
        sub = dims.sub_coords(rank)
        assert sub["cp_ring"] * 2 + sub["cp_ulysses"] == dims.coords(rank)["cp"]
        c = dims.coords(rank)
        del c["cp"]
        assert dims.rank_of(**c, **sub) == rank
    assert ParallelDims(cp=4).resolve(4).groups("cp_ring") == [[0, 1, 2, 3]]  # cp_ulysses=1: the ring is cp


def test_group_arithmetic_agrees_with_groups():
    dims = ParallelDims(tp=2, cp=4, pp=2, cp_ulysses=2, order="cp-tp-dp-pp").resolve(32)
    for token in [*TOKENS, "cp_ulysses", "cp_ring", "tp_cp_ring"]:
        groups = dims.groups(token)
        assert list(dims.iter_groups(token)) == groups and dims.num_groups(token) == len(groups)
        for rank in range(32):
            assert groups[dims.group_index(token, rank)] == dims.group_of(token, rank)
            assert rank in dims.group_of(token, rank)


def test_a_million_ranks_plan_by_arithmetic():
    dims = ParallelDims(tp=8, cp=8, pp=4, cp_ulysses=2).resolve(1_048_576)
    assert dims.dp == 4096
    assert dims.group_of("dp_cp", 1_048_575)[-1] == 1_048_575
    assert len(dims.group(("dp", "cp"), 0)) == 4096 * 8
    huge = ParallelDims(tp=8).resolve(8 * 10**8)
    assert huge.group_of("tp", 799_999_999) == list(range(799_999_992, 800_000_000))
    with pytest.raises(ValueError, match="groups\\('dp'\\) would list all 800,000,000 ranks"):
        huge.groups("dp")


# ---- the axis table and the cfg axis ---------------------------------------------------------------------
def test_the_table_drives_axes_order_fields_and_flags():
    assert AXES == ("tp", "cp", "pp", "cfg", "dp") == tuple(a.name for a in AXIS_TABLE)
    assert DEFAULT_ORDER == "tp-cp-pp-cfg-dp" == ParallelDims().order
    assert [a.flag for a in AXIS_TABLE] == ["--tp", "--cp", "--pp", "--cfg", "--dp"]
    assert topology.SUB_AXES == {"cp_ulysses": "cp", "cp_ring": "cp"}
    fields = {f.name for f in dataclasses.fields(ParallelDims) if f.init}
    assert fields == {*AXES, *topology.SUB_AXES.keys() - {"cp_ring"}, "order"}  # a field per degree, and the order
    assert {a.name: a.default for a in AXIS_TABLE} == {a: getattr(ParallelDims(), a) for a in AXES}
    assert FSDP_AXIS in DERIVED_AXES and set(DERIVED_AXES[FSDP_AXIS]) == {"dp", "cfg", "cp"}


def test_cfg_one_is_hidden_from_what_users_see():
    dims = ParallelDims(tp=2, cp=2, pp=2).resolve(16)
    assert str(dims) == "ParallelDims(tp=2, cp=2, pp=2, dp=2, order='tp-cp-pp-dp')"
    assert dims.axis_order == ("tp", "cp", "pp", "dp") and dims.shown_order == "tp-cp-pp-dp"
    assert dims.mesh_dim_names == ("dp", "pp", "cp", "tp") and "cfg" not in dims.coords(5)
    assert "cfg" not in dims.shown_axes and FSDP_AXIS not in dims.shown_axes
    assert dims.groups("cfg") == [[r] for r in range(16)] and dims.degree("cfg") == 1
    assert dims.groups(FSDP_AXIS) == dims.groups("dp_cp")  # the same ranks: cfg branches are not split
    assert not dims.cfg_enabled and dims.in_use("tp") and not dims.in_use("cfg")
    assert dims.rank_of(cfg=0, tp=1) == 1


def test_cfg_groups_equal_hand_computed_ranks():
    dims = ParallelDims(tp=2, cfg=2).resolve(8)  # rank = tp + 2 * cfg + 4 * dp
    assert str(dims) == "ParallelDims(tp=2, cp=1, pp=1, cfg=2, dp=2, order='tp-cp-pp-cfg-dp')"
    assert dims.mesh_dim_names == ("dp", "cfg", "pp", "cp", "tp") and dims.mesh_shape == (2, 2, 1, 1, 2)
    assert dims.coords(6) == {"tp": 0, "cp": 0, "pp": 0, "cfg": 1, "dp": 1}
    assert dims.groups("cfg") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.groups(FSDP_AXIS) == [[0, 2, 4, 6], [1, 3, 5, 7]] == dims.groups("dp-cfg")  # cfg faster than dp
    assert dims.groups("dp_cp") == dims.groups("dp")  # cfg is not in dp_cp
    assert dims.groups("tp_pp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.cfg_enabled and dims.enabled(FSDP_AXIS) and "cfg" in dims.shown_axes
    assert dims.rank_of(cfg=1, dp=1, tp=1) == 7
    for rank in range(8):
        assert dims.rank_of(**dims.coords(rank)) == rank


@pytest.mark.parametrize("order", ["-".join(p) for p in itertools.permutations(AXES)][::7])
def test_cfg_two_matches_megatron_in_any_order(order):
    for tp, cp, pp, rest in factorisations(8):
        if rest % 2:
            continue
        dims = ParallelDims(tp=tp, cp=cp, pp=pp, cfg=2, dp=rest // 2, order=order)
        names = order.split("-")
        sizes = [getattr(dims, a) for a in names]
        for token in [*TOKENS, "cfg", "cfg-dp", "dp_cfg_cp", "tp-cfg"]:
            mask = [a in parse_axes(token) for a in names]
            assert dims.groups(token) == megatron_groups(8, sizes, mask), (dims, token)


@pytest.mark.parametrize(
    "order, full",
    [
        ("tp-cp-pp-dp", "tp-cp-pp-cfg-dp"),
        ("tp-cp-dp-pp", "tp-cp-cfg-dp-pp"),  # Megatron's layout
        ("tp-cp-ep-dp-pp", "tp-cp-cfg-dp-pp"),  # Megatron's own string: ep is not sharded, dropped
        ("dp-tp-cp-pp", "cfg-dp-tp-cp-pp"),
        ("cfg-tp-cp-pp-dp", "cfg-tp-cp-pp-dp"),
    ],
)
def test_orders_without_cfg_stay_valid(order, full):
    for cfg in (1, 2):
        dims = ParallelDims(tp=2, cfg=cfg, order=order).resolve(8)
        assert dims.order == full and dims.resolve(8).order == full
    assert ParallelDims(tp=2, order=order).resolve(8).shown_order == full.replace("cfg-", "").replace("-cfg", "")


@pytest.mark.parametrize("cfg, error", [(3, DegreeError), (0, DegreeError), (-1, DegreeError), (2.0, TypeError)])
def test_cfg_other_than_one_or_two_is_refused(cfg, error):
    with pytest.raises(
        error,
        match=re.escape(f"cfg must be an int, got float {cfg}")
        if error is TypeError
        else (rf"^cfg={cfg} must be (>= 1|one of \[1, 2\])"),
    ):
        ParallelDims(cfg=cfg)


def test_cfg_in_resolve_messages():
    with pytest.raises(DegreeError, match=r"world_size=6 is not divisible by tp\*cp\*pp\*cfg = 2\*1\*1\*2 = 4"):
        ParallelDims(tp=2, cfg=2).resolve(6)
    with pytest.raises(DegreeError, match=r"tp\*cp\*pp\*cfg\*dp = 1\*1\*1\*2\*2 = 4 != world_size=8"):
        ParallelDims(cfg=2, dp=2).resolve(8)


def test_a_new_axis_is_a_row(monkeypatch):
    """An extra row (here "ep", optional, before dp) is all the pure layer needs for order, flags and groups;
    ParallelDims gains a field for its degree (dataclasses.make_dataclass stands in for that line)."""
    row = Axis("ep", 1, "expert-parallel degree", optional=True)
    table = (*AXIS_TABLE[:-1], row, AXIS_TABLE[-1])
    monkeypatch.setattr(topology, "AXIS_TABLE", table)
    monkeypatch.setattr(topology, "AXES", tuple(a.name for a in table))
    monkeypatch.setattr(topology, "_TABLE", {a.name: a for a in table})
    monkeypatch.setattr(topology, "_NAMES", {*topology._NAMES, "ep"})
    monkeypatch.setattr(topology, "UNSHARDED_AXES", {})
    Dims = dataclasses.make_dataclass("Dims", [("ep", int, 1)], bases=(ParallelDims,), frozen=True)
    dims = Dims(tp=2, ep=2, cfg=2).resolve(16)
    assert dims.order == "tp-cp-pp-cfg-ep-dp" and dims.axis_order == ("tp", "cp", "pp", "cfg", "ep", "dp")
    assert dims.dp == 2 and dims.groups("ep")[0] == [0, 4] and dims.coords(4)["ep"] == 1
    assert str(dims) == "ParallelDims(tp=2, cp=1, pp=1, cfg=2, ep=2, dp=2, order='tp-cp-pp-cfg-ep-dp')"
    assert "ep" not in Dims(tp=2).resolve(2).axis_order
