"""The checkpoint-save phase measured on the CPU (#39 item 5): FSDP2 LoRA on two gloo processes, the demo model,
memfit train's final save under torch's profiler on every rank; each rank's allocator-level peak during the save
(the raw allocation events beyond what was live, memfit.measure.alloc_events) against the estimate's save phase
less its static lines (memfit.estimate.phases: rank 0's share on the CPU device).

    PYTHONPATH=. .venv/bin/python bench/save_phase_cpu.py [--modes full,adapter,sharded] [--out DIR]

The worker (``--worker RUN.yaml OUT``) is what torchrun starts: it wraps memfit.train.api._save_final.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def worker(run_path: str, out: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    import memfit.train.api as api
    from memfit.measure.alloc_events import raw_event_peak
    from memfit.spec.run import load_run

    save = api._save_final

    def probed(run, trainer, engine, tokenizer, folder):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            saved = save(run, trainer, engine, tokenizer, folder)
        peak = raw_event_peak(prof.profiler.kineto_results, "cpu")
        Path(f"{out}.{os.environ.get('RANK', '0')}").write_text(json.dumps({"save_peak": peak}))
        return saved

    api._save_final = probed
    api.train(load_run(run_path))


def measure(mode: str, root: Path) -> dict:
    """{"mode", "measured": [rank 0, rank 1], "predicted"} for one save mode."""
    import yaml

    from memfit.distributed.launch import free_port
    from memfit.resolve import predict
    from memfit.spec.run import load_run
    from memfit.train.demo import ensure_demo_assets

    model, data = ensure_demo_assets(root / "demo")
    run = {"model": str(model), "hardware": "local", "output_dir": str(root / f"out_{mode}"),
           "data": {"path": str(data), "format": "dialogue_summary", "eval_fraction": 0.0},
           "strategy": {"method": "lora", "fsdp": "full_shard", "precision": "fp32", "seq_len": 128,
                        "micro_batch_size": 2},
           "training": {"max_steps": 1}, "distributed": {"nproc": 2}, "save": {"mode": mode}}
    path = root / f"run_{mode}.yaml"
    path.write_text(yaml.safe_dump(run))
    out = root / f"save_{mode}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(Path(__file__).resolve()), "--worker", str(path), str(out)]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    measured = [json.loads(Path(f"{out}.{r}").read_text())["save_peak"] for r in (0, 1)]
    est = predict(load_run(path))
    predicted = est.phases["save"][0] - est.gpu["weights"] - est.gpu["optimizer"]
    return {"mode": mode, "measured": measured, "predicted": predicted,
            "error_pct": round(100 * (predicted - measured[0]) / measured[0], 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=2, metavar=("RUN", "OUT"))
    ap.add_argument("--modes", default="full,adapter,sharded")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        for mode in args.modes.split(","):
            r = measure(mode, root)
            print(f"{mode:8s} rank 0 {r['measured'][0]:>10,} B  rank 1 {r['measured'][1]:>10,} B  "
                  f"predicted (rank 0) {r['predicted']:>12,.0f} B  {r['error_pct']:+.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
