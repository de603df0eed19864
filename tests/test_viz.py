"""viz: format_table, TopologyView and PlacementView (text and HTML), pure, plus one multi-process DTensor check."""

import colorsys
import itertools
import math
import re
from html.parser import HTMLParser

import pytest
import torch
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)

import wf_mesh
from wf_mesh import ParallelDims
from wf_mesh.testing import run_distributed
from wf_mesh.viz import (
    PlacementView,
    TopologyView,
    format_ranks,
    format_table,
    mesh_axes,
    parse_placement,
    show_topology,
)

from helpers import listed_groups

VOID = {"br", "hr", "img", "input", "meta", "link", "col", "wbr"}


class _Checker(HTMLParser):
    """Strict enough: every non-void tag closes in order; collects (attrs, text) of td/tr and captions."""

    def __init__(self):
        super().__init__()
        self.stack, self.cells, self.rows, self.captions = [], [], [], []

    def handle_starttag(self, tag, attrs):
        if tag not in VOID:
            self.stack.append(tag)
        if tag in ("td", "tr"):
            (self.cells if tag == "td" else self.rows).append([dict(attrs), ""])

    def handle_endtag(self, tag):
        assert self.stack and self.stack.pop() == tag, f"unbalanced </{tag}>"

    def handle_data(self, data):
        if self.stack and self.stack[-1] == "td":
            self.cells[-1][1] += data
        if self.stack and self.stack[-1] == "caption":
            self.captions.append(data)


def parse_html(text: str) -> _Checker:
    checker = _Checker()
    checker.feed(text)
    checker.close()
    assert checker.stack == [], f"unclosed tags {checker.stack}"
    return checker


CELL = re.compile(r"background:(hsl\([^)]*\));color:#000;--wf-mesh-dark:(hsl\([^)]*\))")
DARK_SCHEME = (
    '@media (prefers-color-scheme: dark){.wf-mesh-view [style*="--wf-mesh-dark"]'
    "{background:var(--wf-mesh-dark)!important;color:#fff!important}}"
)


def background(attrs: dict) -> str | None:
    m = CELL.fullmatch(attrs.get("style", ""))
    return m[1] if m else None


def luminance(hsl: str) -> float:
    """WCAG relative luminance of a CSS ``hsl(h,s%,l%)`` colour."""
    h, sat, light = (float(v.rstrip("%")) for v in hsl[4:-1].split(","))
    rgb = colorsys.hls_to_rgb(h / 360, light / 100, sat / 100)
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(a: float, b: float) -> float:
    return (max(a, b) + 0.05) / (min(a, b) + 0.05)


def assert_readable_on_any_theme(page: str):
    """Every background comes with its text colour, in the light scheme (inline: black on a light colour) and in
    the dark one (the page's media query swaps in the cell's dark colour under white text), each at a WCAG
    contrast of at least 4.5; captions never wrap."""
    styles = [s for s in re.findall(r'style="([^"]*)"', page) if "background" in s]
    assert styles and all(CELL.fullmatch(s) for s in styles), styles[:3]
    for light, dark in (CELL.fullmatch(s).groups() for s in styles):
        assert contrast(luminance(light), 0.0) >= 4.5 and contrast(luminance(dark), 1.0) >= 4.5, (light, dark)
    assert page.count(DARK_SCHEME) == 1
    assert "caption{white-space:nowrap" in page


# ---- format_table and format_ranks ------------------------------------------------------------------
def test_format_table():
    assert format_table(["name", "n"], [["a", 1], ["bb", 22]], align="lr") == "name   n\na      1\nbb    22"
    assert format_table(["a", "b"], [["x", "y"]], rule=True, sep=" | ", indent="  ") == ("  a | b\n  - | -\n  x | y")
    assert format_table(None, [[1, 22], [333]], align="rr", sep=" ") == "  1 22\n333"
    assert format_table(["a"], []) == "a"
    with pytest.raises(ValueError, match=r"align 'lx': use one 'l' or 'r' per column"):
        format_table(["a", "b"], [], align="lx")


def test_format_ranks():
    assert format_ranks([0, 1, 2, 3, 8, 9]) == "[0-3,8,9]"
    assert format_ranks([0, 4]) == "[0,4]"
    assert format_ranks(range(0, 40, 2), max_ranks=4) == "[0,2,4,(16 more),38]"  # says what it left out
    assert format_ranks([*range(8), *range(16, 24), *range(32, 40), 50], max_ranks=3) == "[0-7,16-23,(8 more),50]"
    assert format_ranks([]) == "[]"


# ---- TopologyView: text -----------------------------------------------------------------------------
def test_topology_text_three_axes():
    assert str(TopologyView(ParallelDims(tp=2, cp=2, pp=2).resolve(8))) == (
        "world 8 = tp 2 x cp 2 x pp 2 x dp 1, order tp-cp-pp-dp (fastest first)\n"
        "rank = tp + 2*cp + 4*pp\n"
        "root DeviceMesh dims ('dp', 'pp', 'cp', 'tp'), shape (1, 2, 2, 2)\n"
        "grid: 2 rows (pp) x 4 columns (tp x cp), rank = row * 4 + column\n"
        "each axis's grid: a rank's group number on that axis (its index in dims.groups(axis))\n"
        "size-1 axes (every rank is its own group): dp\n"
        "\n"
        "     rank      tp (4 groups of 2)   cp (4 groups of 2)   pp (4 groups of 2)\n"
        "tp   0 1 0 1   0 1 0 1              0 1 0 1              0 1 0 1\n"
        "cp   0 0 1 1   0 0 1 1              0 0 1 1              0 0 1 1\n"
        "pp0  0 1 2 3   0 0 1 1              0 1 0 1              0 1 2 3\n"
        "pp1  4 5 6 7   2 2 3 3              2 3 2 3              0 1 2 3\n"
        "\n"
        "groups of every axis (number=[ranks in group order]; a-b = a run of ranks):\n"
        "axis      groups  size  groups\n"
        "tp             4     2  0=[0,1] 1=[2,3] 2=[4,5] 3=[6,7]\n"
        "cp             4     2  0=[0,2] 1=[1,3] 2=[4,6] 3=[5,7]\n"
        "pp             4     2  0=[0,4] 1=[1,5] 2=[2,6] 3=[3,7]\n"
        "dp             8     1  0=[0] 1=[1] 2=[2] 3=[3] 4=[4] 5=[5] 6=[6] 7=[7]\n"
        "tp_cp          2     4  0=[0-3] 1=[4-7]\n"
        "dp_cp          4     2  0=[0,2] 1=[1,3] 2=[4,6] 3=[5,7]  (FSDP; = cp)\n"
        "tp_pp          2     4  0=[0,1,4,5] 1=[2,3,6,7]  (model parallel)\n"
        "tp_cp_dp       2     4  0=[0-3] 1=[4-7]  (= tp_cp)\n"
        "tp_dp          4     2  0=[0,1] 1=[2,3] 2=[4,5] 3=[6,7]  (= tp)"
    )


def test_topology_single_rank():
    text = str(TopologyView(ParallelDims().resolve(1)))
    assert "size-1 axes (every rank is its own group): tp, cp, pp, dp" in text
    assert "grid: 1 row (-) x 1 column (-), rank = row * 1 + column" in text
    assert "rank\n0\n" in text


def test_topology_one_axis_lists_its_groups_and_highlights():
    view = show_topology(ParallelDims(tp=2, cp=2, pp=2).resolve(16), "dp_cp", highlight=5)
    assert str(view) == (
        "world 16 = tp 2 x cp 2 x pp 2 x dp 2, order tp-cp-pp-dp (fastest first)\n"
        "rank = tp + 2*cp + 4*pp + 8*dp\n"
        "root DeviceMesh dims ('dp', 'pp', 'cp', 'tp'), shape (2, 2, 2, 2)\n"
        "grid: 4 rows (pp x dp) x 4 columns (tp x cp), rank = row * 4 + column\n"
        "each axis's grid: a rank's group number on that axis (its index in dims.groups(axis))\n"
        "* = rank 5\n"
        "\n"
        "         rank             dp_cp (4 groups of 4)\n"
        "tp        0   1   0   1   0 1 0 1\n"
        "cp        0   0   1   1   0 0 1 1\n"
        "pp0 dp0   0   1   2   3   0 1 0 1\n"
        "pp1 dp0   4   5*  6   7   2 3 2 3\n"
        "pp0 dp1   8   9  10  11   0 1 0 1\n"
        "pp1 dp1  12  13  14  15   2 3 2 3\n"
        "\n"
        "groups of dp_cp (number=[ranks in group order]; a-b = a run of ranks):\n"
        "axis   groups  size  groups\n"
        "dp_cp       4     4  0=[0,2,8,10] 1=[1,3,9,11] 2=[4,6,12,14] 3=[5,7,13,15]  (FSDP)"
    )


@pytest.mark.parametrize(
    "dims, options",
    [
        (ParallelDims(tp=2, cp=2, pp=2).resolve(16), {"highlight": 5}),
        (ParallelDims(tp=4).resolve(64), {"highlight": 13, "max_rows": 4, "max_cols": 4}),
        (ParallelDims(tp=2, cp=4).resolve(128), {"highlight": 100}),
    ],
)
def test_a_highlighted_rank_keeps_the_columns_aligned(dims, options):
    """The ``*`` takes a place of its own: in the rank grid every number of a column (the coordinates above
    it too) ends at the same character, as without a highlight."""
    lines = str(TopologyView(dims, "tp", **options)).splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\s+rank\s", line))  # the grids' captions
    width = lines[start].index("tp (") - 3  # the rank block, up to the next block's caption
    block = [line[:width].replace("*", " ") for line in lines[start + 1 :] if line and not line.startswith("...")]
    block = block[: next((i for i, line in enumerate(block) if line.startswith("groups")), len(block))]
    grid = lines[start].index("rank")  # where the grid starts, after the row labels
    ends = [{m.end() for m in re.finditer(r"\d+", line[grid:])} for line in block]
    assert len(block) >= 3 and all(e == ends[0] for e in ends), "\n".join(lines[start : start + len(block) + 1])
    assert sum(line[:width].count("*") for line in lines[start:]) == 1 and f"* = rank {options['highlight']}" in lines


DIMS = [
    ParallelDims(tp=2, cp=3, pp=2, dp=2).resolve(24),
    ParallelDims(tp=2, cp=3, pp=2, dp=2, order="dp-pp-cp-tp").resolve(24),
    ParallelDims(tp=2, cp=3, pp=2, dp=2, order="cp-tp-dp-pp").resolve(24),
    ParallelDims(tp=2, cp=4, pp=2, cp_ulysses=2).resolve(32),
    ParallelDims(cp=6, cp_ulysses=3, tp=2, order="cp-dp-tp-pp").resolve(24),
    ParallelDims(cp=4, cp_ulysses=4, pp=2).resolve(16),
]


@pytest.mark.parametrize("dims", DIMS, ids=str)
def test_topology_grids_and_group_lists_match_the_plan(dims):
    view = TopologyView(dims, max_groups=100, width=10_000)  # nothing cut
    ranks = list(itertools.chain(*view.grid))
    assert sorted(ranks) == list(range(dims.world_size))
    for axis in view.axes:
        numbers = list(itertools.chain(*view.group_ids(axis)))
        assert [dims.group_index(axis, r) for r in ranks] == numbers
    assert listed_groups(str(view)) == {axis: dims.groups(axis) for axis in mesh_axes(dims)}


@pytest.mark.parametrize("max_ranks", [2, 3, 5, 16])
@pytest.mark.parametrize("dims", DIMS, ids=str)
def test_group_lists_are_format_ranks_of_the_groups(dims, max_ranks):
    view = TopologyView(dims, max_ranks=max_ranks, max_groups=100, width=10_000)
    text = str(view)
    for axis in [*mesh_axes(dims), "tp-pp-dp", "dp_cp_ring"]:
        expected = " ".join(f"{i}={format_ranks(g, max_ranks=max_ranks)}" for i, g in enumerate(dims.groups(axis)))
        listing = str(TopologyView(dims, axis, max_ranks=max_ranks, max_groups=100, width=10_000)).splitlines()[-1]
        assert listing.split(maxsplit=3)[3].startswith(expected)
    assert "groups of every axis" in text


def test_cp_sub_axes_are_shown_in_text_and_html():
    dims = ParallelDims(tp=2, cp=4, cp_ulysses=2).resolve(16)
    view = TopologyView(dims)
    text = str(view)
    assert view.axes == ("tp", "cp", "cp_ulysses", "cp_ring", "dp")
    assert "world 16 = tp 2 x cp 4 (cp_ring 2 x cp_ulysses 2) x pp 1 x dp 2" in text
    assert "rank = tp + 2*cp_ulysses + 4*cp_ring + 8*dp" in text
    assert "grid: 4 rows (cp_ring x dp) x 4 columns (tp x cp_ulysses)" in text
    assert "cp_ulysses (8 groups of 2)" in text and "cp_ring (8 groups of 2)" in text
    assert "cp_ulysses       8     2  0=[0,2] 1=[1,3]" in text and "(Ulysses all-to-all)" in text
    page = view._repr_html_()
    captions = parse_html(page).captions
    assert captions == [
        "tp (8 groups of 2)",
        "cp (4 groups of 4)",
        "cp_ulysses (8 groups of 2)",
        "cp_ring (8 groups of 2)",
        "dp (8 groups of 2)",
    ]
    assert "<th>cp_ulysses</th>" in page and "<th>cp_ring0 dp1</th>" in page
    assert 'title="rank 6: tp0 cp3 pp0 dp0 (cp_ulysses1 cp_ring1), cp_ring group 2"' in page
    # pure Ulysses: cp_ring is a size-1 axis
    assert "size-1 axes (every rank is its own group): tp, pp, dp, cp_ring" in str(
        TopologyView(ParallelDims(cp=4, cp_ulysses=4).resolve(4))
    )


def test_topology_large_world_is_cut_and_says_what_it_left_out():
    dims = ParallelDims(tp=8, cp=8, pp=16).resolve(100352)
    view = TopologyView(dims)
    text = str(view)
    lines = text.splitlines()
    assert len(lines) < 60 and max(map(len, lines)) <= 100
    assert "grid: 12544 rows (cp x pp x dp) x 8 columns (tp), rank = row * 8 + column" in text
    assert "showing 16 of 12544 rows and 8 of 8 columns (128 of 100352 ranks; the others are left out)" in text
    assert "dp (1024 groups of 98)" in text and "tp (12544 groups of 8)" in text
    assert "cp7 pp1 dp0  120 121 122 123 124 125 126 127" in text
    assert re.search(r"^tp +12544 +8  0=\[0-7\] 1=\[8-15\] .* \(\d+ more\)$", text, re.MULTILINE)
    assert re.search(r"^dp +1024 +98  0=\[0,1024,2048,.*,\(\d+ more\),99328\] \(1023 more\)$", text, re.MULTILINE)
    page = view._repr_html_()
    cells = parse_html(page).cells
    assert sum(1 for attrs, _ in cells if background(attrs)) == 4 * 128  # 4 axes x the 128 ranks shown
    assert [text for attrs, text in cells if attrs.get("class") == "cut"] == ["12528 more rows"] * 4


def test_topology_wide_axis_cuts_columns():
    text = str(TopologyView(ParallelDims(tp=32).resolve(64), "tp"))
    assert "showing 2 of 2 rows and 16 of 32 columns (32 of 64 ranks; the others are left out)" in text
    assert "dp0   0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 ...   0 0 0" in text
    assert text.endswith("\ntp         2    32  0=[0-31] 1=[32-63]")


def test_topology_of_a_billion_ranks_is_pure_arithmetic():
    text = str(TopologyView(ParallelDims(tp=2, cp=2).resolve(10**9)))
    assert "showing 16 of 250000000 rows and 4 of 4 columns (64 of 1000000000 ranks; the others are left out)" in text
    assert "tp_cp_dp           1  1000000000  0=[0-999999999]" in text
    assert (
        "dp                 4   250000000  0=[0,4,8,12,16,20,24,28,32,36,(249999989 more),999999996] (3 more)" in text
    )


def test_topology_bad_input():
    with pytest.raises(ValueError, match="resolve"):
        TopologyView(ParallelDims(tp=2))
    with pytest.raises(ValueError, match="unknown axis 'xx'"):
        TopologyView(ParallelDims(tp=2).resolve(4), "xx")
    with pytest.raises(TypeError, match="ParallelDims or a ParallelMesh, got tuple"):
        TopologyView((2, 2))
    with pytest.raises(ValueError, match="highlight rank 4 is out of range for world size 4"):
        TopologyView(ParallelDims(tp=2).resolve(4), highlight=4)
    with pytest.raises(ValueError, match="max_rows=0 must be >= 1"):
        TopologyView(ParallelDims(tp=2).resolve(4), max_rows=0)


# ---- TopologyView: HTML -----------------------------------------------------------------------------
def test_topology_html_one_coloured_cell_per_rank():
    dims = ParallelDims(tp=2, cp=2, pp=2).resolve(16)
    page = TopologyView(dims, "dp_cp", highlight=3)._repr_html_()
    assert_readable_on_any_theme(page)
    checker = parse_html(page)
    grid = [(attrs, text) for attrs, text in checker.cells if background(attrs)]
    colour = {int(text.rstrip("*")): background(attrs) for attrs, text in grid}
    assert sorted(colour) == list(range(16)) and len(grid) == 16
    groups = dims.groups("dp_cp")
    assert len({colour[g[0]] for g in groups}) == len(groups)  # distinct colour per group
    assert all(colour[r] == colour[g[0]] for g in groups for r in g)  # one colour inside a group
    assert [text for attrs, text in checker.cells if attrs.get("class") == "me"] == ["3*"]
    assert 'title="rank 3: tp1 cp1 pp0 dp0, dp_cp group 1"' in page
    assert "<th>tp</th><th>0</th><th>1</th><th>0</th><th>1</th>" in page  # column labels: coordinates
    assert "<th>pp1 dp1</th>" in page  # row labels
    assert "0=[0,2,8,10] 1=[1,3,9,11] 2=[4,6,12,14] 3=[5,7,13,15]  (FSDP)" in page  # the same group list


def test_html_colours_read_in_both_colour_schemes():
    """Hundreds of group colours (the hues cycle through the golden angle, the levels through three): each one
    readable in the light and the dark scheme; and the dark scheme's rule is what the cells' styles name."""
    dims = ParallelDims(tp=2).resolve(600)  # 300 tp groups
    page = TopologyView(dims, "tp", max_rows=1000, max_cols=2)._repr_html_()
    assert_readable_on_any_theme(page)
    assert len({background(attrs) for attrs, _ in parse_html(page).cells if background(attrs)}) > 100
    placement = PlacementView.plan((2, 64), 64, ["S(1)"], mesh_dim_names=("cp",))._repr_html_()
    assert_readable_on_any_theme(placement)
    assert DARK_SCHEME in wf_mesh.viz._STYLE and "@media (prefers-color-scheme: dark)" not in DARK_SCHEME[1:]


def test_topology_html_default_view_has_a_grid_per_axis():
    dims = ParallelDims(tp=2, cp=2, pp=1, dp=4).resolve(16)
    page = TopologyView(dims)._repr_html_()
    assert_readable_on_any_theme(page)
    checker = parse_html(page)
    assert checker.captions == ["tp (8 groups of 2)", "cp (8 groups of 2)", "dp (4 groups of 4)"]
    assert sum(1 for attrs, _ in checker.cells if background(attrs)) == 3 * 16
    assert "size-1 axes (every rank is its own group): pp" in page


# ---- PlacementView: plans ---------------------------------------------------------------------------
VIDEO = (2, 16, 8, 44, 80)  # (B, C, T, H, W)


def test_planned_video_latent_over_dp_cp():
    view = PlacementView.plan(VIDEO, (2, 4), [Replicate(), Shard(2)], mesh_dim_names=("dp", "cp"), dim_names="BCTHW")
    assert str(view) == (
        "shape (2, 16, 8, 44, 80) on mesh dp=2 x cp=4, placements (R, S(2))\n"
        "8 ranks, 4 distinct slices (same slice = same index ranges)\n"
        "\n"
        "rank  dp  cp  slice  B  C    T  H  W         local shape\n"
        "   0   0   0      0  :  :  0:2  :  :  (2, 16, 2, 44, 80)\n"
        "   1   0   1      1  :  :  2:4  :  :  (2, 16, 2, 44, 80)\n"
        "   2   0   2      2  :  :  4:6  :  :  (2, 16, 2, 44, 80)\n"
        "   3   0   3      3  :  :  6:8  :  :  (2, 16, 2, 44, 80)\n"
        "   4   1   0      0  :  :  0:2  :  :  (2, 16, 2, 44, 80)\n"
        "   5   1   1      1  :  :  2:4  :  :  (2, 16, 2, 44, 80)\n"
        "   6   1   2      2  :  :  4:6  :  :  (2, 16, 2, 44, 80)\n"
        "   7   1   3      3  :  :  6:8  :  :  (2, 16, 2, 44, 80)"
    )
    # The same plan from short strings.
    short = PlacementView.plan(VIDEO, (2, 4), ["R", "S(2)"], mesh_dim_names=("dp", "cp"), dim_names="BCTHW")
    assert str(short) == str(view)


def _take(x: torch.Tensor, ranges) -> torch.Tensor:
    return x[tuple(slice(a, b) for a, b in ranges)]


@pytest.mark.parametrize("t", [8, 7, 5, 3, 1])
def test_uneven_time_follows_torch_chunk(t):
    shape = (2, 3, t, 4, 5)
    x = torch.arange(math.prod(shape)).reshape(shape)
    chunks = torch.chunk(x, 4, dim=2)
    view = PlacementView.plan(shape, (2, 4), ["R", "S(2)"], mesh_dim_names=("dp", "cp"))
    rows = view.rows()
    assert [r.rank for r in rows] == list(range(8))
    for r in rows:
        _dp, cp = r.coords
        assert r.coords == (r.rank // 4, r.rank % 4)
        expected = chunks[cp] if cp < len(chunks) else x.narrow(2, 0, 0)
        assert r.local_shape == tuple(expected.shape)
        assert torch.equal(_take(x, r.ranges), expected)
        assert r.slice == cp


def test_two_axes_sharding_one_dim_chunk_twice():
    # DTensor applies placements left to right: the second Shard(0) chunks the first one's chunk.
    x = torch.arange(10 * 3).reshape(10, 3)
    view = PlacementView.plan(x.shape, (2, 3), ["S(0)", "S(0)"])
    for r in view.rows():
        a, b = r.coords
        inner = torch.chunk(torch.chunk(x, 2)[a], 3)
        expected = inner[b] if b < len(inner) else x[:0]
        assert torch.equal(_take(x, r.ranges), expected)
    assert str(view).splitlines()[3:] == [
        "rank  axis0  axis1  slice    d0  d1  local shape",
        "   0      0      0      0   0:2   :       (2, 3)",
        "   1      0      1      1   2:4   :       (2, 3)",
        "   2      0      2      2   4:5   :       (1, 3)",
        "   3      1      0      3   5:7   :       (2, 3)",
        "   4      1      1      4   7:9   :       (2, 3)",
        "   5      1      2      5  9:10   :       (1, 3)",
    ]


def test_four_axis_mesh_with_partial_and_two_sharded_dims():
    shape = (4, 6, 10)
    view = PlacementView.plan(
        shape, (2, 1, 2, 3), ["S(0)", "R", "P", "S(-1)"], mesh_dim_names=("dp", "pp", "cp", "tp"), highlight=11
    )
    text = str(view)
    assert "placements (S(0), R, P(sum), S(2))" in text
    assert "12 ranks, 6 distinct slices" in text
    assert "partial over cp: each rank holds a term; the value is their sum" in text
    assert "* = rank 11" in text
    assert " 11*   1   0   1   2      5  2:4   :  8:10    (2, 6, 2)" in text
    rows = view.rows()
    assert [r.slice for r in rows] == [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]
    assert rows[3].ranges == rows[0].ranges  # cp: same elements, partial terms


def test_large_planned_mesh_is_cut_and_says_so_in_text_and_html():
    view = PlacementView.plan((25088, 1024), (12544, 8), ["S(0)", "S(1)"], max_rows=8)
    lines = str(view).splitlines()
    assert len(lines) == 13
    assert lines[1] == "100352 ranks, 100352 distinct slices (same slice = same index ranges)"
    assert lines[-2] == "   7      0      7      7  0:2  896:1024     (2, 128)"
    assert lines[-1] == "... 100344 more ranks not shown (8 of 100352; max_rows=8)"
    page = view._repr_html_()
    assert_readable_on_any_theme(page)
    checker = parse_html(page)
    assert len(checker.rows) == 1 + 8 + 1  # header, 8 ranks, the cut note
    assert checker.cells[-1][1] == "... 100344 more ranks not shown (8 of 100352; max_rows=8)"


def test_parse_placement_forms():
    assert parse_placement("S(2)") == Shard(2) == parse_placement("Shard(dim=2)") == parse_placement("Shard(2)")
    assert parse_placement("R") == Replicate() == parse_placement("Replicate()")
    assert parse_placement("P") == Partial() == parse_placement("P(sum)")
    assert parse_placement("P(avg)") == Partial("avg")
    assert parse_placement(Shard(1)) == Shard(1)
    for bad in ["S", "S(x)", "Q", "R(1)", 3]:
        with pytest.raises(ValueError, match="unsupported placement"):
            parse_placement(bad)


def test_plan_bad_input():
    with pytest.raises(ValueError, match=r"placements \(S\(0\)\): 1 given for a 2-D mesh \(2, 2\)"):
        PlacementView.plan((4, 4), (2, 2), ["S(0)"])
    with pytest.raises(ValueError, match=r"S\(3\) on mesh axis cp: no dim 3 in \(4, 4\)"):
        PlacementView.plan((4, 4), 2, ["S(3)"], mesh_dim_names=("cp",))
    with pytest.raises(ValueError, match=r"ranks have shape \(4,\), but mesh_shape is \(2, 2\)"):
        PlacementView.plan((4, 4), (2, 2), ["R", "R"], ranks=[0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"dim_names \(B, C\): 2 given for a 3-D tensor \(1, 2, 3\)"):
        PlacementView.plan((1, 2, 3), 2, ["R"], dim_names="BC")
    with pytest.raises(TypeError, match=r"PlacementView needs a DTensor, got Tensor; use PlacementView.plan\(...\)"):
        PlacementView(torch.zeros(2))


def test_placement_html_colours_per_slice():
    view = PlacementView.plan(VIDEO, (2, 4), ["R", "S(2)"], mesh_dim_names=("dp", "cp"), highlight=6)
    page = view._repr_html_()
    rows = [attrs for attrs, _ in parse_html(page).rows if "style" in attrs]  # the header row has none
    assert len(rows) == 8
    colours = [background(attrs) for attrs in rows]
    assert None not in colours and len(set(colours)) == 4
    assert colours[:4] == colours[4:]  # dp replicas share their slice's colour
    assert [attrs.get("class") == "me" for attrs in rows] == [i == 6 for i in range(8)]
    assert "<th>T</th>" not in page and "<th>d2</th>" in page  # default dim names


# ---- DTensors on real processes ---------------------------------------------------------------------
SHAPE = (2, 3, 5, 4, 6)  # T=5 over cp=2: uneven (3, 2)


def _views_on_ranks():
    pm = wf_mesh.init_parallel(ParallelDims(cp=2))  # dp=2; root mesh ("dp", "pp", "cp", "tp") = (2, 1, 2, 1)
    x = torch.arange(math.prod(SHAPE), dtype=torch.float32).reshape(SHAPE)
    seq = wf_mesh.shard_sequence(x, seq_dim=2, as_dtensor=True)
    full = distribute_tensor(x, pm.root, [Shard(0), Replicate(), Shard(2), Replicate()])
    partial = DTensor.from_local(torch.ones(3, 4), pm["cp"], [Partial()], run_check=False)
    views = [PlacementView(seq), PlacementView(full, dim_names="BCTHW"), PlacementView(partial)]
    return [str(v) for v in views], views[1]._repr_html_(), seq.to_local(), full.to_local(), str(TopologyView(pm))


def test_dtensor_views_match_plans():
    dims = ParallelDims(cp=2).resolve(4)
    x = torch.arange(math.prod(SHAPE), dtype=torch.float32).reshape(SHAPE)
    for rank, (views, html, seq_local, full_local, topology) in enumerate(run_distributed(4, _views_on_ranks)):
        cp_ranks = dims.group_of("cp", rank)
        seq_plan = PlacementView.plan(SHAPE, 2, ["S(2)"], mesh_dim_names=("cp",), ranks=cp_ranks, highlight=rank)
        full_plan = PlacementView.plan(
            SHAPE,
            dims.mesh_shape,
            ["S(0)", "R", "S(2)", "R"],
            mesh_dim_names=dims.mesh_dim_names,
            dim_names="BCTHW",
            highlight=rank,
        )
        partial_plan = PlacementView.plan((3, 4), 2, ["P"], mesh_dim_names=("cp",), ranks=cp_ranks, highlight=rank)
        assert views == [str(seq_plan), str(full_plan), str(partial_plan)]
        assert html == full_plan._repr_html_()
        # The planned ranges are where the DTensor's local data really comes from.
        (seq_row,) = [r for r in seq_plan.rows() if r.rank == rank]
        (full_row,) = [r for r in full_plan.rows() if r.rank == rank]
        assert torch.equal(seq_local, _take(x, seq_row.ranges))
        assert torch.equal(full_local, _take(x, full_row.ranges))
        assert f"* = rank {rank}" in topology
