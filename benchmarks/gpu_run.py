"""The prepared GPU run: what a one-GPU machine checks, in one command, sized for under 8 minutes on one H200.

Made for a machine like the project's GPU machine (Python 3.12, torch 2.11, no network, no loguru). Once, where
pip reaches PyPI, fetch the wheels it lacks into ``.whl/`` (ignored by git)::

    python benchmarks/gpu_run.py --fetch-wheels

then, at the repository root of a copy on the GPU machine (``.whl/`` beside it)::

    PYTHONPATH=src python3 benchmarks/gpu_run.py          # tables to $WF_MESH_GPU_RUN_OUT (default gpu_run_out/)

Steps, each in its own process with its own time limit, so one failing or hanging step is recorded and the run
goes on:

1. ``wheels``: install ``.whl/*.whl`` into a temporary folder put on ``PYTHONPATH`` (this process, its steps and
   their workers);
2. ``gpu_check``: ``benchmarks/gpu_check.py`` at cp 1, 2 and 4 (processes sharing the GPU over gloo; ring hops
   stage through host memory, :mod:`wf_mesh.p2p`): every method, dtype and mask against float64 SDPA, and at
   cp 1 the fused vs the math block (fwd+bwd time and peak memory);
3. ``side_by_side``: one causal bf16 fwd+bwd on the whole sequence in one process (SDPA's fused kernel), then the
   same sequence at cp 2 with ring and ulysses (two processes on the one GPU, timed with CUDA events, the slower
   rank counts): cp 2 / one process;
4. ``diffusers``: a tiny Wan transformer in bf16 at cp 2 (ring, ulysses) against the unmodified model, both
   against the float32 model: cp 2's error next to bf16's own.

``--device cpu`` is the dry run (the same stack minus CUDA, small sizes, wall-clock timing; the test suite runs
it). Writes ``summary.md`` (every table), one ``STEP.txt`` per step and ``results.json`` (five files); exits 1 if a
step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ("loguru==0.7.3", "diffusers==0.42.1", "importlib_metadata==10.2.0")
"""What the GPU machine lacks for this run (diffusers' other needs are in its image)."""
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")

# name -> (time limit in seconds, what it does); run in this order
STEPS = {
    "gpu_check": (240, "every CP method, dtype and mask against float64 SDPA at cp 1, 2, 4; fused vs math at cp 1"),
    "side_by_side": (100, "causal bf16 fwd+bwd: cp 2 (ring, ulysses) / one process on the whole sequence"),
    "diffusers": (100, "tiny Wan, bf16, cp 2 (ring, ulysses) vs the unmodified model"),
}
SIZES = {  # device -> sizes: (gpu_check seq, gpu_check time seq, side-by-side seq, Wan latent (frames, h, w))
    "cuda": (4096, 8192, 16384, (8, 32, 32)),
    "cpu": (64, 0, 256, (2, 4, 6)),
}
HEADS, HEAD_DIM = 16, 128


def fetch_wheels(folder: Path) -> int:
    folder.mkdir(exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    return subprocess.call([*command, "--implementation", "cp", *platforms, "-d", str(folder), *WHEELS])


def install_wheels(folder: Path) -> str:
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        return f"no wheels in {folder}: nothing installed"
    site = Path(tempfile.gettempdir()) / "wf_mesh_gpu_run_site"
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade"]
    subprocess.run([*command, "--target", str(site), *map(str, wheels)], check=True)
    paths = [str(site), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return f"installed {', '.join(w.name for w in wheels)} into {site}"


# ---- step: side by side ---------------------------------------------------------------------------------
def _timed(fn, device: str, trials: int = 5) -> float:
    """Median seconds of ``fn()`` after a warm-up (CUDA events on CUDA)."""
    import torch

    fn()
    times = []
    for _ in range(trials):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _qkv(seq: int, device: str):
    import torch

    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return [torch.randn(1, HEADS, seq, HEAD_DIM, generator=g).to(device=device, dtype=dtype) for _ in range(4)]


def one_process_time(seq: int, device: str) -> float:
    import torch.nn.functional as F

    q, k, v, dout = _qkv(seq, device)
    leaves = [x.requires_grad_() for x in (q, k, v)]

    def step():
        F.scaled_dot_product_attention(*leaves, is_causal=True).backward(dout)

    return _timed(step, device)


def cp_time(seq: int, device: str, method: str) -> float:
    import torch
    import torch.distributed as dist

    import wf_mesh

    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()))
    plan = wf_mesh.plan_cp_attention(seq_len=seq, balance="zigzag", mesh=pm)
    q, k, v, dout = (plan.shard(x, 2) for x in _qkv(seq, device))
    leaves = [x.requires_grad_() for x in (q, k, v)]

    def step():
        out = wf_mesh.cp_attention(*leaves, layout="bhsd", method=method, mesh=pm, causal=True, plan=plan)
        out.backward(dout)

    seconds = torch.tensor([_timed(step, device)])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slower rank sets the step's time
    return seconds.item()


def side_by_side(device: str) -> dict:
    from wf_mesh.testing import LocalCluster

    seq = SIZES[device][2]
    results = {"seq": seq, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16" if device == "cuda" else "float32"}
    for world, methods in ((1, [None]), (2, ["ring", "ulysses"])):
        cluster = LocalCluster(world, timeout=90).start()
        try:
            for method in methods:
                fn, args = (one_process_time, (seq, device)) if method is None else (cp_time, (seq, device, method))
                results[method or "one_process"] = cluster.run(fn, *args)[0]
        finally:
            cluster.shutdown()
    results["ratios"] = {m: results[m] / results["one_process"] for m in ("ring", "ulysses")}
    lines = [
        f"causal fwd+bwd, S={seq}, H={HEADS}, D={HEAD_DIM}, {results['dtype']}, median of 5 "
        f"({'CUDA events' if device == 'cuda' else 'wall clock'}); cp 2 = two processes sharing the device",
        "| path | ms | / one process |",
        "|---|---|---|",
        f"| one process, SDPA on the whole sequence | {results['one_process'] * 1e3:.2f} | 1.00 |",
        *(
            f"| cp 2 {m} (zigzag plan) | {results[m] * 1e3:.2f} | {results['ratios'][m]:.2f} |"
            for m in ("ring", "ulysses")
        ),
    ]
    return {"ok": True, "table": "\n".join(lines), "results": results}


# ---- step: diffusers ------------------------------------------------------------------------------------
def _wan(dtype):
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64,
    )  # fmt: skip
    return model.to(dtype)


def _wan_inputs(shape, dtype, device):
    import torch

    g = torch.Generator().manual_seed(1)
    return dict(
        hidden_states=torch.randn(1, 4, *shape, generator=g).to(device=device, dtype=dtype),
        encoder_hidden_states=torch.randn(1, 5, 16, generator=g).to(device=device, dtype=dtype),
        timestep=torch.tensor([500], device=device),
    )


def wan_outputs(shape, device: str, methods) -> dict:
    """On every rank: the float32 and bf16 unmodified models' outputs, then the bf16 model at cp 2 per method."""
    import torch

    import wf_mesh
    from wf_mesh.integrations.diffusers import apply_context_parallel, remove_context_parallel

    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
    outputs = {}
    with torch.no_grad():
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            model = _wan(dtype).to(device)
            outputs[name] = model(**_wan_inputs(shape, dtype, device), return_dict=False)[0].float().cpu()
        for method in methods:
            apply_context_parallel(model, mesh=pm, method=method)
            out = model(**_wan_inputs(shape, torch.bfloat16, device), return_dict=False)[0]
            outputs[method] = out.float().cpu()
            remove_context_parallel(model)
    return outputs


def diffusers_step(device: str) -> dict:
    from wf_mesh.testing import LocalCluster

    shape, methods = SIZES[device][3], ("ring", "ulysses")
    cluster = LocalCluster(2, timeout=90).start()
    try:
        per_rank = cluster.run(wan_outputs, shape, device, methods)
    finally:
        cluster.shutdown()
    tokens = shape[0] * (shape[1] // 2) * (shape[2] // 2)
    lines = [
        f"tiny WanTransformer3DModel (2 layers, 4 heads x 32), {tokens} tokens, on {device}: max abs error against "
        "the float32 model; cp 2's error may be at most 2x bf16's own + 1e-2",
        "| run | rank | max abs err vs float32 | ok |",
        "|---|---|---|---|",
    ]
    ok = True
    for rank, outputs in enumerate(per_rank):
        want = outputs["float32"]
        own = (outputs["bfloat16"] - want).abs().max().item()
        lines.append(f"| bf16, one process | {rank} | {own:.3e} | reference |")
        for method in methods:
            err = (outputs[method] - want).abs().max().item()
            good = err <= 2 * own + 1e-2
            ok &= good
            lines.append(f"| bf16, cp 2 {method} | {rank} | {err:.3e} | {'yes' if good else 'NO'} |")
    return {"ok": ok, "table": "\n".join(lines)}


# ---- step: gpu_check -----------------------------------------------------------------------------------
def gpu_check_step(device: str) -> dict:
    seq, time_seq = SIZES[device][:2]
    args = ["--world-sizes", "1,2,4", "--seq", str(seq), "--device", device]
    args += ["--time-seq", str(time_seq)] if time_seq else []
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args], capture_output=True, text=True
    )
    table = (done.stdout + done.stderr).strip()
    return {"ok": done.returncode == 0, "table": table, "exit_code": done.returncode}


STEP_FUNCTIONS = {"gpu_check": gpu_check_step, "side_by_side": side_by_side, "diffusers": diffusers_step}


def run_step(name: str, device: str, out: Path) -> dict:
    """Run one step in a child process with its time limit; its record (also when it failed or hung)."""
    limit = STEPS[name][0] * (3 if device == "cpu" else 1)  # a shared CPU is slower than the GPU sizes assume
    t0 = time.time()
    scratch = Path(tempfile.mkdtemp(prefix=f"gpu_run_{name}_"))  # the child's record: not one of the run's files
    command = [sys.executable, __file__, "--step", name, "--device", device, "--out", str(scratch)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit)
        record_file = scratch / f"{name}.json"
        record = json.loads(record_file.read_text()) if record_file.exists() else {"ok": False, "table": ""}
        if done.returncode != 0:
            record["ok"] = False
            record["table"] = f"{record.get('table', '')}\nstep exited {done.returncode}:\n{done.stderr[-3000:]}"
    except subprocess.TimeoutExpired as exc:
        tail = exc.stderr.decode(errors="replace")[-3000:] if isinstance(exc.stderr, bytes) else ""
        record = {"ok": False, "table": f"step ran past its limit of {limit} s\n{tail}"}
    record["seconds"] = round(time.time() - t0, 1)
    (out / f"{name}.txt").write_text(record["table"] + "\n")
    return record


def _child(name: str, device: str, out: Path) -> int:
    try:
        record = STEP_FUNCTIONS[name](device)
    except Exception as exc:
        import traceback

        record = {"ok": False, "table": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
    (out / f"{name}.json").write_text(json.dumps(record, indent=1))
    return 0


def _machine(device: str) -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else "no GPU used"
    return f"Python {sys.version.split()[0]}, torch {torch.__version__}, {gpu}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu_run.py", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=sorted(SIZES), help="cpu: the dry run (small sizes)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("WF_MESH_GPU_RUN_OUT", "gpu_run_out")))
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="the carried wheels (default .whl/)")
    parser.add_argument("--fetch-wheels", action="store_true", help="download the wheels into --wheels and stop")
    parser.add_argument("--step", choices=sorted(STEP_FUNCTIONS), help=argparse.SUPPRESS)  # one step's child
    args = parser.parse_args(argv)
    if args.fetch_wheels:
        return fetch_wheels(args.wheels)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.step:
        return _child(args.step, args.device, args.out)
    started = time.time()
    try:
        wheels = {"ok": True, "table": install_wheels(args.wheels)}
    except Exception as exc:  # the steps still run: those that need no wheel say what they miss
        wheels = {"ok": False, "table": f"installing the wheels failed: {exc}"}
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(f"benchmarks/gpu_run.py: no CUDA device (torch {torch.__version__}); --device cpu is the dry run")
            return 2
    records = {"wheels": wheels}
    for name in STEPS:
        records[name] = run_step(name, args.device, args.out)
        print(f"{name}: {'ok' if records[name]['ok'] else 'FAILED'} in {records[name]['seconds']} s", flush=True)
    lines = [f"# GPU run ({args.device}): {_machine(args.device)}; {time.time() - started:.0f} s in all", ""]
    for name, record in records.items():
        what = STEPS[name][1] if name in STEPS else "the carried wheels"
        status = "ok" if record["ok"] else "FAILED"
        lines += [f"## {name}: {status}" + (f" ({record['seconds']} s)" if "seconds" in record else ""), what, ""]
        lines += ["```", record["table"], "```", ""] if name == "gpu_check" else [record["table"], ""]
    summary = "\n".join(lines)
    (args.out / "summary.md").write_text(summary)
    (args.out / "results.json").write_text(json.dumps(records, indent=1, default=str))
    print(summary)
    return 0 if all(r["ok"] for r in records.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
