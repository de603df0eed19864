"""Pipeline P2P on the pp axis (legacy PPScheduler, native PipelineP2P) and the PipelineStage bridge, on gloo.

Every distributed result is compared with a single-process reference computed here.
"""

import gc
import os

import pytest
import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh.errors import DisagreementError
from wf_mesh.legacy.errors import PipelineStateError
from wf_mesh.legacy.pipeline import PPScheduler, init_pp_scheduler, pp_scheduler, pp_scheduler_or_none
from wf_mesh.pipeline import PipelineP2P, build_pipeline_stage
from wf_mesh.testing import run_distributed

from helpers import raised_everywhere

# layout id -> (tp, cp, pp, dp); world = product
LAYOUTS = {
    "pp2": (1, 1, 2, 1),
    "pp4": (1, 1, 4, 1),
    "tp2-cp2-pp2": (2, 2, 2, 1),
    "pp4-dp2": (1, 1, 4, 2),
}


def _world(layout):
    tp, cp, pp, dp = LAYOUTS[layout]
    return tp * cp * pp * dp


def _plan(layout):
    tp, cp, pp, dp = LAYOUTS[layout]
    return wf_mesh.ParallelDims(tp=tp, cp=cp, pp=pp, dp=dp).resolve(_world(layout))


def _ring(layout, rank):
    """(stage, prev global rank, next global rank) from the pure plan."""
    plan = _plan(layout)
    group, stage = plan.group_of("pp", rank), plan.coords(rank)["pp"]
    return stage, group[(stage - 1) % len(group)], group[(stage + 1) % len(group)]


def _dist_init(layout):
    tp, cp, pp, dp = LAYOUTS[layout]
    sizes = {"tp_size": tp, "cp_size": cp, "pp_size": pp, "dp_size": dp}
    return wf_mesh.dist_init({"distributed_backend": "gloo", "distributed_timeout_minutes": 1, **sizes})


def _init_parallel(layout):
    tp, cp, pp, dp = LAYOUTS[layout]
    return wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=tp, cp=cp, pp=pp, dp=dp))


# ---- legacy PPScheduler -------------------------------------------------------------------------------
def ring_dropped_handles(layout):
    _dist_init(layout)  # creates the scheduler because pp > 1
    sched = pp_scheduler()
    rank = dist.get_rank()
    sent = torch.tensor([rank, sched.stage])
    sched.isend_next(sent)  # handle dropped, as legacy code does
    sent.fill_(-1)  # isend_next sent a copy: overwriting the original is safe
    gc.collect()
    dist.barrier()  # the receive is posted only after the sender dropped its handle
    got = sched.recv_prev_data((2,), torch.int64)
    sched.wait_sends()  # before teardown: a send dropped with its group is lost
    return got.tolist(), (sched.stage, sched.prev_rank, sched.next_rank)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ring_last_stage_reaches_stage_0(layout):
    for rank, (got, ring) in enumerate(run_distributed(_world(layout), ring_dropped_handles, layout)):
        stage, prev, _ = _ring(layout, rank)
        assert ring == _ring(layout, rank)
        assert got == [prev, (stage - 1) % LAYOUTS[layout][2]]  # stage 0 gets the last stage's tensor


def queued_fifo(layout, n):
    _dist_init(layout)
    sched = pp_scheduler()
    shapes = [(k + 1, 3) for k in range(n)]
    for shape in shapes:  # all receives pre-posted before anything is sent
        sched.queue_irecv_prev(shape, torch.float32)
    dist.barrier()
    for k, shape in enumerate(shapes):
        sched.isend_next(torch.full(shape, 100.0 * dist.get_rank() + k))
    got = [sched.queue_irecv_prev_data() for _ in shapes]
    try:
        sched.queue_irecv_prev_data()
    except RuntimeError as e:
        empty = str(e)
    # the raw legacy receive into a caller's buffer
    buffer = torch.empty(2, dtype=torch.float64)
    work = sched.irecv_prev(buffer)
    sent = sched.isend_next(torch.tensor([dist.get_rank(), 0.5], dtype=torch.float64))
    sched.wait_sends()  # waits on `sent`; waiting on it again must not block (gloo's own work would)
    sent.wait()
    work.wait()
    work.wait()
    return [g.tolist() for g in got], empty, buffer.tolist()


@pytest.mark.parametrize("layout", ["pp2", "pp4-dp2"])
def test_queued_receives_pop_in_fifo_order(layout):
    n = 4
    for rank, (got, empty, raw) in enumerate(run_distributed(_world(layout), queued_fifo, layout, n)):
        _, prev, _ = _ring(layout, rank)
        assert got == [torch.full((k + 1, 3), 100.0 * prev + k).tolist() for k in range(n)]
        assert empty == "queue_irecv_prev_data: no receive is queued; call queue_irecv_prev(shape, dtype) first"
        assert raw == [prev, 0.5]


# ---- denoising-style loop -----------------------------------------------------------------------------
STEPS, BATCH, DIM, N_BLOCKS = 4, 2, 8, 4


def _blocks():
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh()).double() for _ in range(N_BLOCKS)]


def _run(blocks, x):
    for block in blocks:
        x = block(x)
    return x


def _latent():
    return torch.randn(BATCH, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def denoise_reference():
    blocks, x = _blocks(), _latent()
    with torch.no_grad():
        for _ in range(STEPS):
            x = x - 0.1 * _run(blocks, x)
    return x


def denoise(layout, checked):
    _dist_init(layout)
    sched = PPScheduler(checked=True) if checked else pp_scheduler()
    per = N_BLOCKS // sched.num_stages
    mine = _blocks()[sched.stage * per : (sched.stage + 1) * per]
    shape, dtype = (BATCH, DIM), torch.float64
    result = None
    with torch.no_grad():
        for t in range(STEPS):
            if sched.is_first:
                x = _latent() if t == 0 else sched.queue_irecv_prev_data()  # the last stage's update
                if t + 1 < STEPS:
                    sched.queue_irecv_prev(shape, dtype)  # pre-post the next step's latent, then compute
                state = torch.stack([x, _run(mine, x)])
            else:
                state = sched.recv_prev_data((2, *shape), dtype)
                state = torch.stack([state[0], _run(mine, state[1])])
            if not sched.is_last:
                sched.isend_next(state)
            else:
                result = state[0] - 0.1 * state[1]
                if t + 1 < STEPS:
                    sched.isend_next(result)  # wraps around to stage 0
    sched.wait_sends()
    return result


@pytest.mark.parametrize("layout, checked", [("pp4", False), ("tp2-cp2-pp2", False), ("pp2", True)])
def test_denoising_loop_matches_single_process(layout, checked):
    expected = denoise_reference()
    for rank, got in enumerate(run_distributed(_world(layout), denoise, layout, checked)):
        stage = _ring(layout, rank)[0]
        if stage == LAYOUTS[layout][2] - 1:
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        else:
            assert got is None


# ---- native PipelineP2P -------------------------------------------------------------------------------
SPECS = [((3,), torch.float32), ((2, 2), torch.bfloat16), ((5,), torch.int64), ((1, 2, 3), torch.bool)]


def _payload(src_rank, k, shape, dtype):
    values = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) + 10 * src_rank + k
    return (values % 2).to(dtype) if dtype == torch.bool else values.to(dtype)


def native_transfers(layout, checked):
    _init_parallel(layout)
    # unchecked: at most 2 unwaited sends tracked, so the 3rd and 4th send first wait for the oldest
    link = PipelineP2P(checked=checked, max_pending_sends=64 if checked else 2)
    rank = dist.get_rank()
    payloads = [_payload(rank, k, s, d) for k, (s, d) in enumerate(SPECS)]
    if checked:  # a checked receive may be posted ahead of its sender only one at a time
        sends = [link.send(p) for p in payloads]
        pending = [link.irecv(s, d) for s, d in SPECS]
    else:  # several receives in flight before anything is sent
        pending = [link.irecv(s, d) for s, d in SPECS]
        dist.barrier()
        sends = [link.send(p) for p in payloads]
    assert len(sends) == len(SPECS)
    got = [p.wait() for p in reversed(pending)][::-1]  # waited out of order, matched in posting order
    big = torch.full((256, 1024), float(rank))  # 1 MiB each way, both directions at once
    from_prev, from_next = link.exchange(
        send_next=big, send_prev=big + 0.5, recv_prev=(big.shape, big.dtype), recv_next=(big.shape, big.dtype)
    )
    link.send(torch.tensor([rank, 7]), peer="prev")  # the backward direction, one message
    backward = link.recv((2,), torch.int64, peer="next").tolist()
    link.wait_sends()
    exchanged = [(t[0, 0].item(), t.eq(t[0, 0]).all().item()) for t in (from_prev, from_next)]
    return got, exchanged, backward


@pytest.mark.parametrize("layout, checked", [("pp2", False), ("pp2", True), ("pp4", True), ("pp4-dp2", False)])
def test_native_in_flight_and_both_directions(layout, checked):
    results = run_distributed(_world(layout), native_transfers, layout, checked)
    for rank, (got, exchanged, backward) in enumerate(results):
        _, prev, nxt = _ring(layout, rank)
        for k, ((shape, dtype), tensor) in enumerate(zip(SPECS, got)):
            assert tensor.dtype == dtype and torch.equal(tensor, _payload(prev, k, shape, dtype))
        assert exchanged == [(float(prev), True), (nxt + 0.5, True)]
        assert backward == [nxt, 7]


# ---- checked mode -------------------------------------------------------------------------------------
def checked_mismatch(send_spec, expect_spec, catch):
    wf_mesh.init_parallel(wf_mesh.ParallelDims(pp=2))
    link = PipelineP2P()  # checked by default
    if link.stage == 0:
        link.send(torch.ones(send_spec[0], dtype=send_spec[1]))
        if catch:
            link.send(torch.arange(6.0).reshape(2, 3))
        link.wait_sends()  # completes: the receiver drained the mismatched payload
        return None
    try:
        link.recv(*expect_spec)
    except ValueError as e:
        if not catch:
            raise
        message = str(e)
    return message, link.recv((2, 3), torch.float32).tolist()  # the link is still in step


@pytest.mark.parametrize(
    "send_spec, expect_spec, expected",
    [
        # the sender's payload is larger than the receive buffer: unchecked, gloo would SIGABRT the receiver
        (
            ((2, 4), torch.float32),
            ((2, 3), torch.float32),
            (
                r"expected shape \(2, 3\) dtype torch.float32, "
                r"received shape \(2, 4\) dtype torch.float32"
            ),
        ),
        (
            ((4,), torch.bfloat16),
            ((4,), torch.float32),
            (
                r"expected shape \(4,\) dtype torch.float32, "
                r"received shape \(4,\) dtype torch.bfloat16"
            ),
        ),
        # smaller: unchecked, the rest of the receive buffer would keep stale or uninitialised data
        (
            ((2, 2), torch.float32),
            ((2, 3), torch.float32),
            (
                r"expected shape \(2, 3\) dtype torch.float32, "
                r"received shape \(2, 2\) dtype torch.float32"
            ),
        ),
    ],
)
def test_checked_mismatch_raises_on_receiver(send_spec, expect_spec, expected):
    prefix = r"checked receive on pp stage 1 from pp stage 0 \(global rank 0\): "
    with pytest.raises(ValueError, match=prefix + expected):
        run_distributed(2, checked_mismatch, send_spec, expect_spec, False)
    _, (message, after) = run_distributed(2, checked_mismatch, send_spec, expect_spec, True)
    assert message.endswith("(the payload was drained; the link stays usable)")
    assert after == torch.arange(6.0).reshape(2, 3).tolist()


def checked_exchange_mismatch():
    wf_mesh.init_parallel(wf_mesh.ParallelDims(pp=2))
    link = PPScheduler(checked=True)
    a, b = torch.ones(2, 3), torch.arange(4.0)
    try:
        if link.stage == 0:
            link.exchange(send_next=a, recv_next=((4,), torch.float32))
        else:
            link.exchange(recv_prev=((2, 2), torch.float32), send_prev=b)
        error = None
    except ValueError as e:
        error = str(e)
    # both sides still agree afterwards: a matched exchange and a legacy checked receive
    got = link.exchange(send_next=a + link.stage, recv_prev=((2, 3), torch.float32))[0]
    link.isend_next(b)
    buffer = torch.empty(3)
    try:
        link.irecv_prev(buffer)
    except ValueError as e:
        legacy = str(e)
    link.wait_sends()
    return error, got.tolist(), legacy


def test_checked_exchange_mismatch_keeps_link_in_step():
    (err0, got0, legacy0), (err1, got1, legacy1) = run_distributed(2, checked_exchange_mismatch)
    assert err0 is None
    assert err1.startswith(
        "checked receive on pp stage 1 from pp stage 0 (global rank 0): expected shape (2, 2) "
        "dtype torch.float32, received shape (2, 3) dtype torch.float32"
    )
    assert got0 == (torch.ones(2, 3) + 1).tolist() and got1 == torch.ones(2, 3).tolist()
    mismatch = "expected shape (3,) dtype torch.float32, received shape (4,) dtype torch.float32"
    assert legacy0.startswith(f"checked receive on pp stage 0 from pp stage 1 (global rank 1): {mismatch}")
    assert legacy1.startswith(f"checked receive on pp stage 1 from pp stage 0 (global rank 0): {mismatch}")


def modes(case):
    wf_mesh.init_parallel(wf_mesh.ParallelDims(pp=2))
    if case == "mixed":  # a checked sender and an unchecked receiver would misread headers as data
        return PipelineP2P(checked=dist.get_rank() == 0)
    os.environ["WF_MESH_PP_CHECKED"] = "1"  # the legacy scheduler's global switch
    try:
        return PPScheduler().checked, PPScheduler(checked=False).checked, PipelineP2P().checked
    finally:
        del os.environ["WF_MESH_PP_CHECKED"]


def test_both_ends_of_a_link_use_the_same_mode():
    raised_everywhere(
        run_distributed(2, modes, "mixed", return_exceptions=True),
        DisagreementError,
        r"^PipelineP2P: ranks disagree on checked \(rank 0: True; rank 1: False\); every stage must use the same mode$",
    )
    assert run_distributed(2, modes, "switch") == [(True, False, True)] * 2


# ---- lifecycle and errors -----------------------------------------------------------------------------
def test_pp_scheduler_before_init_single_process():
    assert pp_scheduler_or_none() is None
    for kind in (RuntimeError, AssertionError):
        with pytest.raises(kind, match=r"pp_scheduler: the PP scheduler is not initialized; call wf_mesh.init_pp_sch"):
            pp_scheduler()
    with pytest.raises(RuntimeError, match="model parallel is not initialized"):
        init_pp_scheduler()


def lifecycle():
    out = {}
    wf_mesh.initialize_model_parallel(pp_size=2)  # legacy initialize does not create the scheduler
    out["before"] = pp_scheduler_or_none()
    try:
        pp_scheduler()
    except AssertionError as e:
        out["before_error"] = (type(e).__name__, isinstance(e, RuntimeError))
    sched = init_pp_scheduler()
    out["same"] = pp_scheduler() is sched
    try:
        init_pp_scheduler()
    except PipelineStateError as e:
        out["twice"] = str(e)
    wf_mesh.destroy_model_parallel()
    out["after_destroy"] = pp_scheduler_or_none()
    try:
        sched.isend_next(torch.ones(1))
    except RuntimeError as e:
        out["stale"] = str(e)
    mesh = _dist_init("pp2")  # dist_init creates it, and calling it again keeps it
    created = pp_scheduler()
    config = {"distributed_backend": "gloo", "distributed_timeout_minutes": 1, "cp_size": 1, "pp_size": 2}
    out["dist_init_twice"] = wf_mesh.dist_init(config) is mesh and pp_scheduler() is created
    out["repr"] = repr(created)
    for name, call in {
        "peer": lambda: created.send(torch.ones(1), peer="up"),
        "device": lambda: created.isend_next(torch.ones(1, device="meta")),
        "type": lambda: created.isend_next([1.0]),
        "buffer": lambda: created.irecv_prev(torch.ones(4, 4).t()),
        "exchange": lambda: created.exchange(),
        "pending": lambda: PipelineP2P(max_pending_sends=0),
    }.items():
        try:
            call()
        except (ValueError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    wf_mesh.destroy_model_parallel()
    wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=2))  # pp=1: nobody to talk to
    try:
        PipelineP2P().recv((1,), torch.float32)
    except RuntimeError as e:
        out["pp1"] = str(e)
    return out


def test_lifecycle_and_errors():
    for rank, out in enumerate(run_distributed(2, lifecycle)):
        assert out["before"] is None and out["before_error"] == ("PipelineStateError", True)
        assert out["same"]
        assert out["twice"].startswith(
            f"init_pp_scheduler: the PP scheduler is already initialized (PPScheduler(stage={rank}/2"
        )
        assert out["twice"].endswith("call wf_mesh.destroy_model_parallel() before initializing again")
        assert out["after_destroy"] is None
        assert out["stale"].startswith("PPScheduler: its mesh (ParallelDims(tp=1, cp=1, pp=2, dp=1")
        assert out["dist_init_twice"]
        peer = 1 - rank
        assert (
            out["repr"] == f"PPScheduler(stage={rank}/2, prev_rank={peer}, next_rank={peer}, device=cpu, checked=False)"
        )
        assert out["peer"] == "ValueError: peer must be 'next' or 'prev', got 'up'"
        assert out["device"] == "ValueError: isend_next: tensor is on meta, but the pp axis communicates on cpu"
        assert out["type"] == "TypeError: isend_next needs a torch.Tensor, got list"
        assert out["buffer"] == "ValueError: receive buffer must be contiguous, got shape (4, 4) stride (1, 4)"
        assert out["exchange"].startswith("ValueError: exchange: nothing to do")
        assert out["pending"] == "ValueError: max_pending_sends=0 must be >= 1"
        assert out["pp1"] == "cannot receive: the pp axis has a single stage (pp=1), so there is no neighbour"


# ---- bridge to torch.distributed.pipelining -----------------------------------------------------------
N_MICRO = 4


def _mlp_blocks():
    torch.manual_seed(2)
    return [torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.GELU()).double() for _ in range(N_BLOCKS)]


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, DIM, dtype=torch.float64, generator=g), torch.randn(8, DIM, dtype=torch.float64, generator=g)


def _mse(output, target):
    return torch.nn.functional.mse_loss(output, target)


def bridge_reference():
    """Single process, full model, same microbatches: per-block parameter grads and per-microbatch losses."""
    blocks = _mlp_blocks()
    model = torch.nn.Sequential(*blocks)
    x, y = _batch()
    losses = [_mse(model(xm), ym) for xm, ym in zip(x.chunk(N_MICRO), y.chunk(N_MICRO))]
    (sum(losses) / N_MICRO).backward()  # the schedule's default scale_grads=True divides by n_microbatches
    return [[p.grad for p in block.parameters()] for block in blocks], [loss.detach() for loss in losses]


def bridge(layout, schedule_name):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    _init_parallel(layout)
    mesh = wf_mesh.get_parallel_mesh()
    per = N_BLOCKS // mesh.size("pp")
    mine = _mlp_blocks()[mesh.rank("pp") * per : (mesh.rank("pp") + 1) * per]
    stage = build_pipeline_stage(torch.nn.Sequential(*mine))
    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    schedule = schedule_cls(stage, n_microbatches=N_MICRO, loss_fn=_mse)
    x, y = _batch()
    losses = []
    if stage.is_first:
        schedule.step(x)
    elif stage.is_last:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    grads = [[p.grad for p in block.parameters()] for block in mine]
    return (stage.stage_index, stage.num_stages), grads, [loss.detach() for loss in losses]


@pytest.mark.parametrize(
    "layout, schedule", [("pp2", "gpipe"), ("pp4", "1f1b"), ("tp2-cp2-pp2", "1f1b"), ("pp4-dp2", "gpipe")]
)
def test_bridge_schedule_grads_match_single_process(layout, schedule):
    ref_grads, ref_losses = bridge_reference()
    pp = LAYOUTS[layout][2]
    per = N_BLOCKS // pp
    for rank, ((index, count), grads, losses) in enumerate(run_distributed(_world(layout), bridge, layout, schedule)):
        stage = _ring(layout, rank)[0]
        assert (index, count) == (stage, pp)
        for got, want in zip(grads, ref_grads[stage * per : (stage + 1) * per], strict=True):
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
        if stage == pp - 1:
            torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-10, atol=1e-12)
        else:
            assert losses == []
