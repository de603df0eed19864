"""cp_attention under ``torch.compile(fullgraph=True, dynamic=False)``: with a plan (checks on or off) a block
calling it compiles to ONE graph for ring, ulysses, usp and allgather (the communicating pieces are custom
ops of wf_mesh.attention_ops), forward and gradients equal eager, no recompile over 3 steps of one shape and
one per new sequence length. Backend ``aot_eager`` (AOTAutograd with fake tensors, eager kernels: the graph
capture and the custom ops' fake and autograd rules) for the matrix; one case runs inductor.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import wf_mesh
from wf_mesh import agreement
from wf_mesh.attention import CPSelfAttention, cp_attention
from wf_mesh.context_parallel import sequence_dtensor
from wf_mesh.testing import counting_backend, graph_breaks, run_distributed

from helpers import sample

USP = ("cp_ring", "cp_ulysses")


def _mesh(pm, method, world):
    return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=USP) if method == "usp" else pm


def compiled_vs_eager(
    method, causal, layout, checks, seqs, inner="aot_eager", dtensor=False, pad=False, planless=False
):
    """Per sequence length, 3 steps of eager and compiled: max |difference| of out, dq, dk, dv; the graphs."""
    world = dist.get_world_size()
    agreement.set_checks(checks)
    try:
        pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=world))
        mesh = _mesh(pm, method, world)
        seq_dim = 1 if layout == "bshd" else 2

        def block(q, k, v, mask, plan):
            out = cp_attention(
                q * 2, k, v, method=method, layout=layout, causal=causal, key_padding_mask=mask, plan=plan
            )
            return out.sin()

        backend, compiles = counting_backend(inner)
        compiled = torch.compile(block, fullgraph=True, backend=backend, dynamic=False)
        diffs = []
        for seq in seqs:
            for step in range(3):
                plan = wf_mesh.plan_cp_attention(seq_len=seq, mesh=mesh)  # a new plan every step, equal content
                shape = (1, seq, 4, 8) if layout == "bshd" else (1, 4, seq, 8)
                g = [sample(shape, seed=10 * step + i) for i in range(4)]
                mask = None
                if pad:
                    mask = torch.rand(1, seq, generator=torch.Generator().manual_seed(step)) < 0.3
                    mask = wf_mesh.shard_sequence(mask, 1, mesh=pm, as_dtensor=False)
                results = []
                for fn in (block, compiled):
                    leaves = [
                        wf_mesh.shard_sequence(x, seq_dim, mesh=pm, as_dtensor=False).clone().requires_grad_()
                        for x in g[:3]
                    ]
                    inputs = leaves
                    if dtensor:
                        inputs = [sequence_dtensor(x, seq_dim, shape, mesh=pm) for x in leaves]
                    out = fn(*inputs, mask, None if planless else plan)
                    if dtensor:
                        out = out.to_local()
                    out.backward(wf_mesh.shard_sequence(g[3], seq_dim, mesh=pm, as_dtensor=False))
                    results.append([out.detach(), *(x.grad for x in leaves)])
                diffs.append(max((a - b).abs().max().item() if a.numel() else 0.0 for a, b in zip(*results)))
        return diffs, list(compiles)
    finally:
        agreement.set_checks(None)


CASES = [  # (method, causal, layout, checks, DTensor inputs, key padding mask)
    ("ring", True, "bhsd", False, False, False),
    ("ulysses", False, "bshd", True, False, True),
    pytest.param("usp", True, "bshd", False, False, False, marks=pytest.mark.slow),  # 4 processes compiling
    ("allgather", True, "bhsd", True, True, True),
]


@pytest.mark.parametrize("method,causal,layout,checks,dtensor,pad", CASES, ids=["ring", "ulysses", "usp", "allgather"])
def test_one_graph_equal_to_eager_no_recompile(method, causal, layout, checks, dtensor, pad):
    world = 4 if method == "usp" else 2
    args = (method, causal, layout, checks, (9, 12))
    for diffs, compiles in run_distributed(world, compiled_vs_eager, *args, dtensor=dtensor, pad=pad):
        assert max(diffs) < 1e-6, diffs
        assert len(compiles) == 2, compiles  # one graph for 3 steps of 9 tokens, one more for 12 tokens


def test_dtensor_inputs_compile_without_a_plan_checks_off():
    for diffs, compiles in run_distributed(
        2, compiled_vs_eager, "ulysses", True, "bshd", False, (10,), dtensor=True, pad=True, planless=True
    ):
        assert max(diffs) < 1e-6, diffs
        assert len(compiles) == 1, compiles


@pytest.mark.slow  # inductor's C++ compile: ~40 s on a loaded 2-core machine
def test_inductor_compiles_the_ring():
    for diffs, compiles in run_distributed(2, compiled_vs_eager, "ring", True, "bhsd", False, (9,), inner="inductor"):
        assert max(diffs) < 1e-5, diffs
        assert len(compiles) == 1, compiles


def compile_misuse(kind):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
    q = sample((1, 2, 4, 8))
    plan = wf_mesh.plan_cp_attention(seq_len=10, mesh=pm)
    if kind == "dtensor_checks_on":
        q = sequence_dtensor(q, 2, (1, 2, 8, 8), mesh=pm)
    if kind == "dtensor_placement":  # bhsd read, sharded on dim 1 (heads)
        q = sequence_dtensor(q, 1, (1, 4, 4, 8), mesh=pm)
        agreement.set_checks(False)

    def block(x):
        return cp_attention(x, x, x, layout="bhsd", plan=plan if kind == "local_len" else None)

    try:
        torch.compile(block, fullgraph=True, backend="aot_eager", dynamic=False)(q)
    except Exception as exc:  # its message: dynamo's exceptions cannot be pickled back before torch 2.13
        return f"{type(exc).__name__}: {exc}"
    finally:
        agreement.set_checks(None)
    return None


COMPILE_ERRORS = {
    "dtensor_placement": r"q, k, v must be placed \(Shard\(2\),\) \(the sequence dim of layout='bhsd'\)",
    "plain_without_plan": r"needs plan= \(wf_mesh.plan_cp_attention\) or DTensor inputs",
    "dtensor_checks_on": r"with DTensor inputs and checks on: .* pass plan=",
    "local_len": r"holds 4 tokens but the plan gives cp rank \d 5 \(seq_len=10",
}


@pytest.mark.parametrize("kind", sorted(COMPILE_ERRORS))
def test_misuse_under_compile_raises_at_trace_time_on_every_rank(kind):
    outcomes = run_distributed(2, compile_misuse, kind)
    for rank, message in enumerate(outcomes):
        assert message is not None and re.search(COMPILE_ERRORS[kind], message), (rank, message)


def module_compiled_vs_eager(method):
    """A CPSelfAttention block compiled whole (the issue's failing case): output and weight gradients."""
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
    torch.manual_seed(0)
    attn = CPSelfAttention(16, heads=2, method=method, mesh=pm)
    backend, compiles = counting_backend()
    compiled = torch.compile(attn, fullgraph=True, backend=backend, dynamic=False)
    x = wf_mesh.shard_sequence(sample((2, 11, 16)), 1, mesh=pm, as_dtensor=False)
    results = []
    for fn in (attn, compiled):
        for _ in range(2):  # two steps, a new plan each
            attn.zero_grad()
            out = fn(x, plan=wf_mesh.plan_cp_attention(seq_len=11, mesh=pm))
            out.square().sum().backward()
        results.append([out.detach(), *(p.grad.clone() for p in attn.parameters())])
    return max((a - b).abs().max().item() for a, b in zip(*results)), len(compiles)


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_a_cp_self_attention_block_compiles_whole(method):
    for diff, graphs in run_distributed(2, module_compiled_vs_eager, method):
        assert diff < 1e-5 and graphs == 1, (diff, graphs)


def compiled_across_mesh_rebuild():
    """A compiled graph keeps working after its mesh is destroyed and built again (it finds groups by name)."""
    backend, compiles = counting_backend()

    def block(q, plan):
        return cp_attention(q, q, q, method="ring", layout="bhsd", plan=plan)

    compiled = torch.compile(block, fullgraph=True, backend=backend, dynamic=False)
    diffs = []
    for _ in range(2):
        pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
        q = wf_mesh.shard_sequence(sample((1, 2, 10, 8)), 2, mesh=pm, as_dtensor=False)
        plan = wf_mesh.plan_cp_attention(seq_len=10, mesh=pm)
        diffs.append((compiled(q, plan) - block(q, plan)).abs().max().item())
        pm.destroy()
    return diffs, len(compiles)


def test_a_compiled_graph_outlives_its_mesh():
    for diffs, graphs in run_distributed(2, compiled_across_mesh_rebuild):
        assert max(diffs) < 1e-6 and graphs <= 2, (diffs, graphs)


def explained(method):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
    q = wf_mesh.shard_sequence(sample((1, 10, 4, 8)), 1, mesh=pm, as_dtensor=False)
    mask = torch.zeros(1, 5, dtype=torch.bool)

    def block(q, plan):
        out = cp_attention(q, q, q, method=method, layout="bshd", causal=True, key_padding_mask=mask, plan=plan)
        return out.sin()

    return graph_breaks(block, q, wf_mesh.plan_cp_attention(seq_len=10, mesh=pm))


@pytest.mark.parametrize("method", ["ring", "ulysses", "allgather"])
def test_dynamo_explain_sees_one_graph_and_no_break(method):
    for graphs, breaks, reasons in run_distributed(2, explained, method):
        assert (graphs, breaks, reasons) == (1, 0, [])
