"""Per-rank model-state memory under DDP, ZeRO-1/2/3 (+offload) and FSDP2, measured on 2 CPU processes.

    .venv/bin/python bench/distributed_memory.py [--hidden 256 --layers 4 --steps 2] [--json]

Builds a tiny Llama (random weights), runs every engine for a full fine-tune and a LoRA in one torchrun
launch (memfit.measure.engine_matrix, gloo), and a single-process reference with the same global batches.
Prints, per rank: parameter bytes, optimizer bytes (fp32 master partitions + Adam moments), gradient
bytes where visible to a callback, the share of DDP's parameters+optimizer, the estimator's
weights+optimizer per GPU for the same strategy on 2 GPUs (fp32), and the largest loss difference
against one process. On the CPU offload moves nothing (it is the same RAM): its row shows the same
bytes, counted wherever they live.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINES = {
    "ddp": [],
    "zero1": ["strategy.zero_stage=1"],
    "zero2": ["strategy.zero_stage=2"],
    "zero3": ["strategy.zero_stage=3"],
    "zero3+offload": ["strategy.zero_stage=3", "strategy.offload=optimizer"],
    "fsdp-full_shard": ["strategy.fsdp=full_shard"],
}


def _run(cmd: list[str], cwd: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{p.stderr[-4000:]}")


def _estimate(model_dir: Path, sets: list[str], steps: int) -> int | None:
    try:
        from memfit.estimate import estimate
        from memfit.spec.hardware import parse_hardware
        from memfit.spec.model import resolve_model
        from memfit.spec.run import run_from_dict
    except ImportError:
        return None
    run = run_from_dict({"model": str(model_dir), "strategy": {"precision": "fp32", "seq_len": 64}}, sets)
    est = estimate(resolve_model(str(model_dir)), parse_hardware("2xA100-80GB"), run.strategy)
    g, cpu = est.gpu, est.cpu  # offloaded states are in the CPU lines, per node of 2 ranks
    return int(g["weights"] + g["optimizer"] + (cpu["offloaded_optimizer"] + cpu["offloaded_params"]) / 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (model, runs, outputs)")
    args = ap.parse_args()

    from memfit.train.quiet import quiet_libraries

    quiet_libraries()
    import yaml

    from memfit.train.demo import TinyModelConfig, build_tiny_model, make_dialogue_records, write_jsonl

    root = Path(tempfile.mkdtemp(prefix="memfit-dist-bench-"))
    records = make_dialogue_records(64, seed=0)
    write_jsonl(records, root / "data.jsonl")
    model_dir = build_tiny_model(root / "model", TinyModelConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, max_position_embeddings=128),
        texts=[r["dialogue"] + "\n" + r["summary"] for r in records])
    base = {"model": str(model_dir),
            "data": {"path": str(root / "data.jsonl"), "format": "dialogue_summary", "eval_fraction": 0.0},
            "strategy": {"precision": "fp32", "micro_batch_size": 1, "seq_len": 64, "lora_dropout": 0.0},
            "training": {"max_steps": args.steps, "learning_rate": 0.01, "lr_scheduler": "constant"}}
    cases, ref_cases = [], []
    for method in ("full", "lora"):
        ref_cases.append({"name": method, "set": [f"method={method}", "strategy.micro_batch_size=2"]})
        for eng, sets in ENGINES.items():
            cases.append({"name": f"{eng}/{method}", "dir": f"{eng}-{method}", "set": [f"method={method}", *sets]})
    jobs = {}
    for name, out, cs in (("dist", "out2", cases), ("ref", "out1", ref_cases)):
        (root / f"{name}.yaml").write_text(yaml.safe_dump({**base, "output_dir": str(root / out)}))
        (root / f"{name}-cases.json").write_text(json.dumps(cs))
        jobs[name] = [str(root / f"{name}.yaml"), str(root / f"{name}-cases.json"), str(root / f"{name}.json")]
    t0 = time.time()
    from memfit.distributed.launch import torchrun_command

    _run(torchrun_command("memfit.measure.engine_matrix", jobs["dist"], nproc=2), root)
    _run([sys.executable, "-m", "memfit.measure.engine_matrix", *jobs["ref"]], root)
    dist = json.loads(Path(jobs["dist"][2]).read_text())["cases"]
    ref = json.loads(Path(jobs["ref"][2]).read_text())["cases"]

    rows = []
    for method in ("full", "lora"):
        ddp = dist[f"ddp/{method}"]["ranks"][0]
        ddp_po = ddp["parameters"] + ddp["optimizer"]
        for eng, sets in ENGINES.items():
            case = dist[f"{eng}/{method}"]
            r0 = case["ranks"][0]
            po = r0["parameters"] + r0["optimizer"]
            diff = max(abs(a - b) for a, b in zip(case["losses"], ref[method]["losses"]))
            rows.append({"engine": eng, "method": method, "parameters": r0["parameters"],
                         "optimizer": r0["optimizer"], "gradients": r0["gradients"],
                         "params_plus_optimizer": po, "vs_ddp": po / ddp_po,
                         "estimate_weights_plus_optimizer": _estimate(model_dir, [f"method={method}", *sets], args.steps),
                         "ranks_equal": case["ranks"][0] == case["ranks"][1], "max_loss_diff": diff})
    seconds = time.time() - t0
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps({"rows": rows, "seconds": seconds}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    from memfit.cli.output import human_bytes

    t = Table(title=f"per-rank model states, 2 CPU processes (gloo), tiny Llama h={args.hidden} "
                    f"L={args.layers}, fp32, {args.steps} steps")
    for col in ("engine", "method", "params/rank", "optimizer/rank", "grads seen", "params+opt vs DDP",
                "estimate params+opt", "max |Δloss| vs 1 proc"):
        t.add_column(col, justify="left" if col in ("engine", "method") else "right")
    for r in rows:
        est = r["estimate_weights_plus_optimizer"]
        t.add_row(r["engine"], r["method"], human_bytes(r["parameters"]), human_bytes(r["optimizer"]),
                  human_bytes(r["gradients"]) if r["gradients"] else "-", f"{100 * r['vs_ddp']:.0f}%",
                  human_bytes(est) if est is not None else "-", f"{r['max_loss_diff']:.1e}")
    Console(width=150).print(t)
    print(f"{seconds:.0f} s (2 launches)" + (f"; outputs in {root}" if args.keep else ""))


if __name__ == "__main__":
    main()
