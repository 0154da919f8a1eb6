"""Estimator vs the allocator-level peak per rank under DDP, FSDP2 and DeepSpeed ZeRO-1/2/3 on this CPU.

Run: PYTHONPATH=. .venv/bin/python bench/studies/estimate_vs_probe_dist.py [--engines ddp,fsdp,zero2]
Each engine runs a tiny random Llama (fp32, AdamW, micro-batch 2, seq 512) in 2 gloo processes under
torchrun; rank 0 measures one step (after a warm-up step) with memfit's TensorMemoryProbe and compares
it with ``memory.gpu_allocated_bytes`` for the ``2xCPU`` pool. ~30 s per engine on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

RAW = {"hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8, "num_key_value_heads": 2,
       "num_hidden_layers": 4, "vocab_size": 2000}
STRATEGY = {"ddp": {}, "fsdp": {"fsdp": "full_shard"}, "fsdp_sgo": {"fsdp": "shard_grad_op"},
            "zero1": {"zero_stage": 1}, "zero2": {"zero_stage": 2}, "zero3": {"zero_stage": 3}}


def optimizer_step(model, opt, ids):
    """One plain training step as a closure: forward with labels, backward, the optimizer, gradients freed."""
    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _free_fsdp1_stale_grads(model) -> None:
    """FSDP1 (use_orig_params) keeps each FlatParameter's sharded gradient after ``zero_grad(set_to_none=True)``
    until the root's next pre-forward frees it, first thing in the step (torch/distributed/fsdp/_runtime_utils.py
    ``_root_pre_forward`` -> ``_reset_flat_param_grad_info_if_needed``). The CPU probe cannot see frees of
    blocks allocated before its window, so it would count them through the whole step: free them as FSDP1
    does, before the window opens."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for unit in FSDP.fsdp_modules(model):
        flat = unit._flat_param
        if flat is not None and flat.grad is not None and all(p.grad is None for p in flat._params or ()):
            flat.grad = None


def second_step_peak(model, step) -> float:
    """The allocator peak of a training step after one warm-up step (memfit's TensorMemoryProbe, CPU)."""
    from memfit.measure.probe import TensorMemoryProbe

    model.train()
    step()
    _free_fsdp1_stale_grads(model)
    with TensorMemoryProbe("cpu", categories=False) as probe:
        step()
    return float(probe.result().peak_allocated_bytes)


def worker(engine_name: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**RAW, attn_implementation="sdpa"))
    ids = torch.randint(0, RAW["vocab_size"], (2, 512))
    if engine_name.startswith("zero"):
        import deepspeed

        h2 = RAW["hidden_size"] ** 2
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
               "zero_allow_untested_optimizer": True,
               "zero_optimization": {"stage": int(engine_name[-1]), "reduce_bucket_size": h2,
                                     "allgather_bucket_size": int(2e8),
                                     "stage3_prefetch_bucket_size": int(0.9 * h2),
                                     "stage3_param_persistence_threshold": 10 * RAW["hidden_size"]}}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)

        def step() -> None:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
    else:
        dist.init_process_group("gloo")
        if engine_name == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            reshard = engine_name == "fsdp"
            for layer in model.model.layers:
                fully_shard(layer, reshard_after_forward=reshard)
            fully_shard(model, reshard_after_forward=reshard)
        step = optimizer_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4), ids)

    measured = second_step_peak(model, step)
    if dist.get_rank() == 0:
        from memfit.estimate import estimate
        from memfit.spec.hardware import parse_hardware
        from memfit.spec.model import model_from_config
        from memfit.spec.strategy import Strategy

        spec = model_from_config({"model_type": "llama", **RAW}, name="tiny")
        st = Strategy(method="full", precision="fp32", seq_len=512, micro_batch_size=2, **STRATEGY[engine_name])
        predicted = estimate(spec, parse_hardware("2xCPU"), st).to_dict()["memory"]["gpu_allocated_bytes"]
        print(f"RESULT {engine_name:9} {measured / 1e6:10.1f} {predicted / 1e6:10.1f} "
              f"{100 * (predicted / measured - 1):+6.1f}%", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default=",".join(STRATEGY))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    print(f"{'engine':16} {'measured MB':>10} {'pred MB':>10} {'error':>7}   (rank 0, 2 gloo processes)")
    for i, name in enumerate(args.engines.split(",")):
        if name not in STRATEGY:
            print(f"unknown engine {name!r}; choose from {', '.join(STRATEGY)}")
            return 2
        out = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", str(29650 + i), __file__,
                              "--worker", name], capture_output=True, text=True, timeout=600)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        print(lines[0][7:] if lines else f"{name:9} failed (exit {out.returncode}): {out.stderr.strip()[-300:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
