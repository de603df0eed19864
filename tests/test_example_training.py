"""examples/train_video_dit.py: the same training at every world size, resumable across world sizes and after a
worker is killed under torchrun.

In-process runs go through the pooled gloo clusters (``main(argv)`` in every worker); each is compared with
the single-process run. Tolerance: every run computes the same fp32 math but sums in a different order
(partial sums per dp/cp rank, online-softmax merges of attention blocks, FSDP's reduce-scatter), so results
differ by rounding, amplified a little by six AdamW steps (AdamW divides each gradient component by its
running RMS, so a small component carries its relative rounding error into a full-sized update). Measured on
these shapes: losses and gradient norms within 2.3e-7 relative, weights within 6.5e-7 and EMA within 1.2e-7
absolute (weights move by up to ~6e-3 in six steps). The bounds leave ~10x headroom: ``LOSS_RTOL`` 2e-6 for
losses and gradient norms, ``WEIGHT_ATOL`` 1e-5 for weights and EMA. Wrong scaling is far outside them: FSDP's
default averaging (gradients 1/dp too small) shows as a 50% gradient-norm error and 8e-4 in the weights;
per-rank mean losses on the uneven batch split as 23% and 8e-3. (The gradient norm matters: AdamW alone is
almost blind to a uniform scale error.) A resume at the same world size is bitwise equal.
"""

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from functools import cache
from pathlib import Path

import pytest
import torch

from wf_mesh.testing import run_distributed

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_video_dit.py"
# The workers import the example through `train` below. They fork from a server that inherits sys.path when
# it starts (the first cluster), and they import this module by name, which runs this line there too.
if str(SCRIPT.parent) not in sys.path:
    sys.path.insert(0, str(SCRIPT.parent))

STEPS = 6
SHAPE = ["--batch", "4", "--channels", "4", "--frames", "4", "--height", "8", "--width", "4", "--dim", "32",
         "--heads", "2", "--depth", "2"]  # fmt: skip
LOSS_RTOL = 2e-6
WEIGHT_ATOL = 1e-5
TIMEOUT = 180  # seconds for any process this module starts (torchrun with a restart included)
MARKER = "WF_MESH_EXAMPLE_TEST_MARKER"


def train(argv):
    """``train_video_dit.main(argv)`` on every rank of a cluster (importable by the workers)."""
    import train_video_dit

    return train_video_dit.main(argv)


@cache
def run(world, *args):
    """Rank 0's result of a quiet 6-step run with the tiny shapes, after checking that all ranks agree."""
    results = run_distributed(world, train, [*SHAPE, "--steps", str(STEPS), "--quiet", *args])
    for rank, result in enumerate(results[1:], 1):
        assert result["losses"] == results[0]["losses"], rank  # one all-reduce: the same value everywhere
        assert result["digest"] == results[0]["digest"], rank
    return results[0]


def deviations(got, expected):
    """Max relative deviations of the losses and gradient norms, max absolute ones of the weights and EMA."""
    out = []
    for key in ("losses", "grad_norms"):
        assert sorted(got[key]) == sorted(expected[key])
        out.append(max(abs(got[key][s] - expected[key][s]) / abs(expected[key][s]) for s in got[key]))
    for key in ("weights", "ema"):
        assert got[key].keys() == expected[key].keys()
        out.append(max((got[key][n] - expected[key][n]).abs().max().item() for n in expected[key]))
    return out


def after(result, step):
    """``result`` with only the losses and gradient norms of the steps after ``step``."""
    keep = lambda values: {s: v for s, v in values.items() if s > step}
    return {**result, "losses": keep(result["losses"]), "grad_norms": keep(result["grad_norms"])}


def assert_close(got, expected, what):
    loss, norm, weights, ema = deviations(got, expected)
    print(
        f"{what}: max deviation of losses {loss:.1e}, grad norms {norm:.1e} (relative), weights {weights:.1e}, EMA {ema:.1e}"
    )
    assert loss <= LOSS_RTOL, (what, loss)
    assert norm <= LOSS_RTOL, (what, norm)
    assert weights <= WEIGHT_ATOL, (what, weights)
    assert ema <= WEIGHT_ATOL, (what, ema)


# ---- in-process: every world size trains the same model ----------------------------------------------
@pytest.mark.parametrize(
    ("world", "args", "batch"),
    [
        pytest.param(2, (), 4, marks=pytest.mark.slow),  # dp 2
        pytest.param(2, ("--cp", "2"), 4, marks=pytest.mark.slow),  # cp 2, ring
        (4, ("--cp", "2"), 4),  # dp 2 x cp 2: the fast lane's one
        pytest.param(4, ("--cp", "4", "--cp-method", "usp", "--cp-ulysses", "2"), 4, marks=pytest.mark.slow),
        pytest.param(4, ("--cp", "2", "--cp-method", "ulysses"), 3, marks=pytest.mark.slow),  # uneven: 2 and 1
        pytest.param(4, ("--tp", "2", "--cp", "2"), 4, marks=pytest.mark.slow),  # parallelize_module on mesh["tp"]
    ],
    ids=["dp2", "cp2-ring", "dp2xcp2-ring", "cp4-usp", "dp2xcp2-ulysses-uneven", "tp2xcp2-ring"],
)
def test_loss_trajectory_and_weights_match_one_process(world, args, batch):
    reference = run(1, "--batch", str(batch))
    result = run(world, "--batch", str(batch), *args)
    assert (result["world_size"], result["start_step"]) == (world, 0)
    assert sorted(result["losses"]) == list(range(1, STEPS + 1))
    assert result["losses"][STEPS] < result["losses"][1]  # it learns
    assert_close(result, reference, f"{world} processes {' '.join(args)}")


@pytest.mark.slow
@pytest.mark.parametrize("batch", [4, 3], ids=["even", "uneven"])
def test_per_dp_rank_data_is_the_same_run_at_every_cp(batch):
    # --data-rng dp: each dp rank draws its own samples, noise and noise levels (mesh.generator over dp), so the
    # cp peers of a dp rank see the same data and the run depends on dp only: dp 2 x cp 2 = dp 2 x cp 1
    per_dp = run(2, "--batch", str(batch), "--data-rng", "dp")
    assert_close(
        run(4, "--batch", str(batch), "--cp", "2", "--data-rng", "dp"), per_dp, "dp 2 x cp 2 vs dp 2, per-dp data"
    )
    assert deviations(per_dp, run(2, "--batch", str(batch)))[0] > 1e-3  # other data than the global stream


@pytest.mark.slow
def test_resume_at_2_processes_from_a_checkpoint_taken_at_4(tmp_path):
    saved = run_distributed(4, train, [*SHAPE, "--steps", "3", "--quiet", "--cp", "2", "--ckpt-dir", str(tmp_path),
                                       "--save-every", "3"])[0]  # fmt: skip
    assert sorted(os.listdir(tmp_path)) == ["step_000003"]
    (tmp_path / "step_000005").mkdir()  # an interrupted save (no .metadata): must be ignored
    # dp 2 x cp 2 (FSDP shards over 4 ranks) -> dp 2 (over 2): DCP reshards model, optimizer and EMA
    resumed = run_distributed(2, train, [*SHAPE, "--steps", str(STEPS), "--quiet", "--ckpt-dir", str(tmp_path)])
    assert [r["start_step"] for r in resumed] == [3, 3]
    assert resumed[0]["losses"] == resumed[1]["losses"] and resumed[0]["digest"] == resumed[1]["digest"]
    uninterrupted = run(4, "--batch", "4", "--cp", "2")
    assert saved["losses"] == {s: uninterrupted["losses"][s] for s in (1, 2, 3)}  # same world, same order: exact
    assert_close(resumed[0], after(uninterrupted, 3), "4 processes to step 3, then 2")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cp-method", "usp"], "--cp-method usp needs --cp-ulysses N > 1 (the Ulysses part of --cp; the ring is "
                                 "the rest)"),
        (["--cp", "2", "--cp-method", "usp", "--cp-ulysses", "1"], "--cp-method usp needs --cp-ulysses N > 1"),
        (["--cp", "4", "--cp-method", "usp", "--cp-ulysses", "3"], "--cp-ulysses 3 must divide --cp 4 (cp = ring x "
                                                                    "ulysses)"),
        (["--cp", "2", "--cp-ulysses", "2"], "--cp-ulysses > 1 is for --cp-method usp"),
    ],
)  # fmt: skip
def test_cp_flags_that_cannot_work_fail_at_parse_time_naming_the_flag(argv, message, capsys):
    import train_video_dit

    with pytest.raises(SystemExit) as exited:
        train_video_dit.parse_args(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].split(": error: ", 1)[1].startswith(message)  # after the prog


# ---- slow: processes of their own ---------------------------------------------------------------------
def clean_env(**extra):
    """This environment without a launcher's variables (so the script starts its own world), plus ``extra``."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in launcher}, **extra}


@pytest.mark.slow
def test_runs_as_one_process_without_a_launcher():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *SHAPE, "--steps", "2"], env=clean_env(), capture_output=True, text=True,
        timeout=TIMEOUT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    printed = [
        float(m) for m in re.findall(r"^step \d/2  loss (\S+)  grad norm \S+  tokens/s [\d,]+$", done.stdout, re.M)
    ]
    assert len(printed) == 2, done.stdout
    assert printed == pytest.approx(
        [run(1, "--batch", "4")["losses"][s] for s in (1, 2)], abs=1e-6
    )  # printed with 6 decimals
    assert "1 process(es) = dp 1 x cp 1" in done.stdout and "done: step 2" in done.stdout


@pytest.mark.slow
def test_quiet_is_quiet_and_a_finished_run_says_so(tmp_path):
    """--quiet: no output at all, not even wf_mesh's "no launcher" log line; run again (not quiet) on the
    finished checkpoint directory: it says the run is complete, trains nothing and exits 0."""
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "first.pt", tmp_path / "second.pt"
    args = [sys.executable, str(SCRIPT), *SHAPE, "--steps", "1", "--ckpt-dir", str(ckpt), "--save-every", "1"]
    quiet = subprocess.run([*args, "--quiet", "--out", str(first)], env=clean_env(), capture_output=True, text=True,
                           timeout=TIMEOUT)  # fmt: skip
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")
    again = subprocess.run([*args, "--out", str(second)], env=clean_env(), capture_output=True, text=True,
                           timeout=TIMEOUT)  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    trained, resumed = torch.load(first), torch.load(second)
    assert (trained["start_step"], sorted(trained["losses"])) == (0, [1])
    assert (resumed["start_step"], resumed["losses"], resumed["grad_norms"]) == (1, {}, {})  # trained nothing
    assert resumed["digest"] == trained["digest"] and sorted(os.listdir(ckpt)) == ["step_000001"]
    assert f"run already complete at step 1 ({ckpt / 'step_000001'}, --steps 1): nothing to train" in again.stdout
    assert "step 1/1" not in again.stdout and "done:" not in again.stdout
    assert "init_from_env: no launcher" in again.stderr  # not quiet: the log line is there


def marked(marker, *entries):
    """Live processes whose environment holds ``MARKER=marker`` and every one of ``entries`` ("KEY=value")."""
    wanted, found = {f"{MARKER}={marker}".encode(), *(e.encode() for e in entries)}, []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if wanted <= set(f.read().split(b"\0")):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def wait_for(log, pattern, proc, deadline):
    while time.monotonic() < deadline:
        text = log.read_text()
        if re.search(pattern, text, re.M):
            return text
        assert proc.poll() is None, f"torchrun exited ({proc.returncode}) before {pattern!r}:\n{text}"
        time.sleep(0.05)
    raise AssertionError(f"no {pattern!r} within {TIMEOUT} s:\n{log.read_text()}")


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_from_the_last_checkpoint(tmp_path):
    marker, log, out = uuid.uuid4().hex, tmp_path / "log.txt", tmp_path / "result.pt"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
        "--monitor-interval", "0.2", str(SCRIPT), *SHAPE, "--steps", str(STEPS), "--ckpt-dir", str(tmp_path / "ckpt"),
        "--save-every", "2", "--out", str(out), "--step-delay", "1",
    ]  # fmt: skip
    # torchrun's agent keeps ONE TCPStore for all restarts by default, and a restarted worker can read the keys
    # its dead predecessors left there (rank 0's old gloo address: "Connection refused" on the restart; see
    # pytorch/pytorch#135712 and #167288). Without sharing, every restart round gets a fresh store.
    env = clean_env(**{MARKER: marker, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    deadline = time.monotonic() + TIMEOUT
    with open(log, "w") as sink:  # a session of its own: on failure the launcher and its workers go at once
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    try:
        wait_for(log, r"^saved checkpoint .*step_000002\n(.*\n)*step 3/", proc, deadline)
        victims = marked(marker, "LOCAL_RANK=1", "TORCHELASTIC_RESTART_COUNT=0")
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        returncode = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in marked(marker):  # a worker that left the launcher's session
            os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    assert returncode == 0, text
    assert not marked(marker), text
    result = torch.load(out)
    start = result["start_step"]
    assert start in (2, 4), text  # the kill came after step 3; step 4's checkpoint may have been saved by then
    assert re.search(rf"^resumed from .*step_{start:06d} \(step {start}\)$", text, re.M), text
    assert sorted(result["losses"]) == list(range(start + 1, STEPS + 1))
    uninterrupted = run(2, "--batch", "4")
    assert_close(result, after(uninterrupted, start), f"torchrun, killed after step 3, resumed from step {start}")
