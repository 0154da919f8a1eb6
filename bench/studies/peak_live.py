"""What is live at each phase's peak of one ``bench/studies/distributed_memory.py --peak`` case, by allocation site.

    PYTHONPATH=. .venv/bin/python bench/studies/peak_live.py fsdp1/full+gc [--top 12]

Runs the case as ``--peak`` does (2 gloo ranks, the same model, wrapping and warm-up step), profiles the
measured step with Python stacks, replays its allocation events as the probe does (memfit.measure.alloc_events:
frees on gloo's threads restored) and prints, per rank and phase, the phase's peak and what is live then,
grouped by where it was allocated: F the forward, L the loss's backward, R1.. each layer's recomputation and
backward (checkpointing), B the layers' backward (without), O the optimizer step; R1P.. the moment each
recomputed layer's gradient is reduce-scattered (FSDP's post-backward hook). Then the largest blocks live at
the step's peak. ~40 s per case on 2 cores. This is how issue 22's FSDP1/FSDP2 terms were found
(docs/distributed.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SITES = (  # (category, any of these in the allocation's stack), first match wins
    ("gloo reduce-scatter clone", ("c10d::",)),
    ("unsharded params", ("_alloc_padded_unsharded_flat_param", "alloc_all_gather_outputs", "foreach_all_gather")),
    ("grad reduce (shards, RS buffers)", ("_get_reduce_scatter_tensors", "foreach_reduce", "_reduce_grad")),
    ("optimizer", ("optimizer.py", "adamw.py")),
    ("recomputed forward", ("recompute_fn",)),
    ("loss", ("cross_entropy", "loss_utils", "LogSoftmaxBackward", "NllLossBackward")),
    ("backward", ("evaluate_function",)),
)


def category(names: tuple) -> str:
    joined = " ".join(names)
    for name, keys in SITES:
        if any(k in joined for k in keys):
            return name
    return "forward (saved, layer inputs)"


def phase_labels(events: list) -> list[str]:
    """F until the first backward node, L until the first recomputation, R1.. per recomputed layer, B for
    a backward without checkpointing, O once the optimizer runs."""
    out, ph, k, prev = [], "F", 0, False
    for _, _, _, names in events:
        joined = " ".join(names)
        if ph == "F" and "evaluate_function" in joined:
            ph = "L"
        rec = "recompute_fn" in joined
        if rec and not prev and ph != "O":
            k += 1
            ph = f"R{k}"
        if rec or "evaluate_function" in joined:
            prev = rec
        if ph != "F" and "evaluate_function" not in joined and ("optimizer.py" in joined or "adamw.py" in joined):
            ph = "O"
        out.append(ph)
    return out


def phases(events: list) -> tuple[dict, dict]:
    """Per phase (bytes at its peak, {category: bytes}); and {address: (bytes, names)} live at the step's peak."""
    live: dict[int, tuple[int, tuple]] = {}
    run, best, top, at_peak = 0, {}, 0, {}
    for (_, ptr, size, names), ph in zip(events, phase_labels(events)):
        if size > 0:
            run += size - live.get(ptr, (0,))[0]
            live[ptr] = (size, names)
        elif size < 0 and ptr in live:
            run -= live.pop(ptr)[0]
        joined = " ".join(names)
        post = size > 0 and ph.startswith("R") and ("_get_reduce_scatter_tensors" in joined
                                                     or "foreach_reduce" in joined) and "c10d::" not in joined
        for key in ([ph] + ([ph + "P"] if post and ph + "P" not in best else [])):
            if key.endswith("P") or run > best.get(key, (0,))[0]:
                comp: dict[str, int] = {}
                for sz, nm in live.values():
                    comp[category(nm)] = comp.get(category(nm), 0) + sz
                best[key] = (run, comp)
        if run > top:
            top, at_peak = run, dict(live)
    return best, at_peak


def worker(case: str, top_n: int) -> None:
    import gc

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from bench.studies.distributed_memory import build_case
    from bench.studies.estimate_vs_probe_dist import _free_fsdp1_stale_grads, optimizer_step
    from memfit.measure.alloc_events import allocations
    from memfit.measure.probe import live_storage_bytes

    dist.init_process_group("gloo")
    model, opt, ids = build_case(case)
    step = optimizer_step(model, opt, ids)
    model.train()
    step()
    _free_fsdp1_stale_grads(model)
    gc.collect()
    base = live_storage_bytes(None, "cpu")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        step()
    best, at_peak = phases(allocations(prof.profiler.kineto_results, "cpu"))
    lines = [f"rank {dist.get_rank()}: live before the step {base / 1e6:.3f} MB; peak "
             f"{(base + sum(s for s, _ in at_peak.values())) / 1e6:.3f} MB"]
    for ph, (run, comp) in best.items():
        parts = ", ".join(f"{c} {b / 1e6:.3f}" for c, b in sorted(comp.items(), key=lambda kv: -kv[1]) if b > 5e4)
        lines.append(f"  {ph:4} {run / 1e6:8.3f} MB: {parts}")
    lines.append("  largest blocks at the peak:")
    for size, names in sorted(at_peak.values(), key=lambda v: -v[0])[:top_n]:
        where = [n.split("/")[-1][:60] for n in names if "(" in n or "::" in n][-4:]
        lines.append(f"    {size / 1e6:7.3f} MB  {' < '.join(reversed(where))}")
    for r in range(dist.get_world_size()):
        dist.barrier()
        if r == dist.get_rank():
            print("\n".join(lines), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    if "--worker" in sys.argv:
        i = sys.argv.index("--worker")
        worker(sys.argv[i + 1], int(sys.argv[i + 2]))
        return 0
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", help="a bench/studies/distributed_memory.py --peak case, e.g. fsdp1/full+gc")
    ap.add_argument("--top", type=int, default=12, help="largest blocks listed at the peak")
    a = ap.parse_args()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT))
    out = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", "29690", __file__, "--worker",
                          a.case, str(a.top)], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    print(out.stdout, end="")
    if out.returncode:
        print(out.stderr[-3000:], file=sys.stderr)
    return out.returncode


if __name__ == "__main__":
    sys.exit(main())
