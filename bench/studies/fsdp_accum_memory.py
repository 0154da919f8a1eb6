"""FSDP with gradient accumulation as accelerate runs it (``no_sync`` for every micro-batch but the last), measured
on 2 gloo processes against memfit's estimate.

    PYTHONPATH=. .venv/bin/python bench/studies/fsdp_accum_memory.py [--cases fsdp1/full,fsdp2/full] [--accum 2] \\
        [--json]

accelerate's ``Accelerator.no_sync`` is ``FullyShardedDataParallel.no_sync`` for FSDP1 and
``set_requires_gradient_sync(False)`` for FSDP2 (accelerate/accelerator.py); under it FSDP keeps every unit's
unsharded gradient until the synchronising micro-batch (memfit/estimate/peak.py). The model, wrapping and probe are
bench/studies/distributed_memory.py's ``--peak`` setup (tiny random Llama, fp32, AdamW, micro-batch 2 x 512, wrapped as
accelerate wraps it); one optimizer step = ``--accum`` micro-batches, the first ``--accum - 1`` under no_sync.
Each rank's allocator peak over the second step (memfit's TensorMemoryProbe) against ``gpu_allocated_bytes`` of the
same strategy with ``grad_accum`` on the ``2xCPU`` pool. ~30 s per case on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CASES = ("fsdp1/full", "fsdp2/full", "fsdp1/lora", "fsdp2/lora")


def _no_sync(model, version: str):
    """accelerate's no_sync for this FSDP version (accelerate/accelerator.py Accelerator.no_sync)."""
    if version == "fsdp1":
        return model.no_sync()

    @contextlib.contextmanager
    def fsdp2():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    return fsdp2()


def worker(case: str, accum: int) -> None:
    import torch
    import torch.distributed as dist
    from bench.studies.distributed_memory import PEAK_RAW, _peak_strategy, _wrap
    from bench.studies.estimate_vs_probe_dist import second_step_peak
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**PEAK_RAW, attn_implementation="sdpa"))
    st = _peak_strategy(case).model_copy(update={"grad_accum": accum, "fsdp_sync_each_batch": False})  # no_sync
    if st.method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=st.lora_r, lora_alpha=st.lora_alpha, lora_dropout=0.0,
                                                 target_modules=list(st.lora_targets), task_type="CAUSAL_LM"))
    model = _wrap(model, case, st.method == "lora")
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
    ids = torch.randint(0, PEAK_RAW["vocab_size"], (2, 512), generator=torch.Generator().manual_seed(1))
    version = case.split("/")[0]

    def step() -> None:
        for _ in range(accum - 1):
            with _no_sync(model, version):
                model(input_ids=ids, labels=ids).loss.backward()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    measured = torch.tensor([second_step_peak(model, step)])
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, measured)
    if dist.get_rank() == 0:
        from memfit.estimate import estimate
        from memfit.spec.hardware import parse_hardware
        from memfit.spec.model import model_from_config

        spec = model_from_config({"model_type": "llama", **PEAK_RAW}, name="tiny")
        predicted = estimate(spec, parse_hardware("2xCPU"), st).to_dict()["memory"]["gpu_allocated_bytes"]
        print("RESULT " + json.dumps({"case": case, "accum": accum, "label": st.label(), "predicted": predicted,
                                      "measured": [int(x.item()) for x in gathered]}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.accum)
        return 0
    from memfit.distributed.launch import free_port

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parents[1]))
    results = []
    for case in args.cases.split(","):
        p = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), __file__,
                            "--worker", case, "--accum", str(args.accum)], env=env, capture_output=True, text=True,
                           timeout=900)
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if p.returncode or line is None:
            print(f"{case}: failed\n{p.stderr[-3000:]}", file=sys.stderr)
            return 1
        r = json.loads(line[7:])
        r["error"] = r["predicted"] / max(r["measured"]) - 1.0
        results.append(r)
        if not args.json:
            print(f"{case:11s} accum {r['accum']}: predicted {r['predicted'] / 2**20:7.1f} MiB, measured per rank "
                  f"{', '.join(f'{m / 2**20:.1f}' for m in r['measured'])} MiB, error {100 * r['error']:+.2f} %",
                  flush=True)
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
