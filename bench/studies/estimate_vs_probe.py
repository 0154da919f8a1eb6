"""Estimator vs the allocator-level peak of real training steps on this CPU (tiny random Llamas).

Run: PYTHONPATH=. .venv/bin/python bench/studies/estimate_vs_probe.py [--quick]
For each configuration it builds a tiny Llama from a config (random weights), runs one warm-up step
(AdamW, zero_grad(set_to_none=True), like the HF Trainer), then measures one step with memfit's
TensorMemoryProbe and prints the measured peak, memfit's ``memory.gpu_allocated_bytes`` and the error.
It also times one unprobed step against ``time.step_seconds`` (a rough check of the CPU FLOP/s
constants; tiny models are dominated by per-op overhead). ~1–2 minutes on 2 cores (``--quick``: the
first three configurations).
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from memfit.estimate import estimate
    from memfit.measure.probe import TensorMemoryProbe
    from memfit.spec.hardware import parse_hardware
    from memfit.spec.model import model_from_config
    from memfit.spec.strategy import Strategy

    torch.set_num_threads(1)
    small = {"hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8, "num_key_value_heads": 2,
             "num_hidden_layers": 4, "vocab_size": 2000}
    wide = {"hidden_size": 384, "intermediate_size": 1024, "num_attention_heads": 6, "num_key_value_heads": 6,
            "num_hidden_layers": 3, "vocab_size": 8000}
    # (config, method, checkpointing, attention, precision, micro-batch, seq_len[, grad_accum[, extra]])
    # precision "bf16-mixed" runs under torch.autocast with fp32 weights (full) or a bf16 base (adapters)
    cases = [
        (small, "full", False, "sdpa", "fp32", 2, 512), (small, "full", True, "sdpa", "fp32", 2, 512),
        (small, "lora", True, "sdpa", "fp32", 2, 512), (small, "lora", False, "sdpa", "fp32", 2, 512),
        (small, "full", False, "eager", "fp32", 2, 512), (wide, "full", False, "sdpa", "fp32", 1, 384),
        (wide, "full", True, "sdpa", "fp32", 1, 384), (wide, "lora", True, "eager", "fp32", 1, 384),
        (wide, "full", False, "sdpa", "bf16", 1, 384), (wide, "lora", True, "sdpa", "bf16", 1, 384),
        (small, "full", False, "sdpa", "fp32", 2, 512, 2),
        (wide, "full", False, "sdpa", "bf16-mixed", 1, 384), (wide, "lora", False, "sdpa", "bf16-mixed", 1, 384),
        (wide, "lora", False, "sdpa", "bf16-mixed", 1, 384, 1, {"lora_dropout": 0.0}),
        (wide, "lora", False, "sdpa", "bf16-mixed", 1, 384, 1, {"lora_targets": ("q_proj", "v_proj")}),
    ]
    if args.quick:
        cases = cases[:3]
    hw = parse_hardware("local")
    print(f"{'config':50} {'measured MB':>12} {'predicted MB':>13} {'error':>7} {'step s':>7} {'pred s':>7}")
    errors = []
    t0 = time.time()
    for cfg, method, gc, attn, prec, b, s, *rest in cases:
        ga = rest[0] if rest else 1
        extra = rest[1] if len(rest) > 1 else {}
        targets = tuple(extra.get("lora_targets", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                     "up_proj", "down_proj")))
        dropout = extra.get("lora_dropout", 0.05)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation=attn))
        if prec == "bf16" or (prec == "bf16-mixed" and method != "full"):
            model = model.to(torch.bfloat16)
        if method == "lora":
            model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout,
                                                     target_modules=list(targets)))
        if gc:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if method == "lora":
                model.enable_input_require_grads()
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        ids = torch.randint(0, cfg["vocab_size"], (b, s))

        def step() -> None:
            for _ in range(ga):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=prec == "bf16-mixed"):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        t_step = time.perf_counter()
        step()
        t_step = time.perf_counter() - t_step
        with TensorMemoryProbe("cpu", categories=True) as probe:
            step()
        res = probe.result()
        measured = res.peak_allocated_bytes
        spec = model_from_config({"model_type": "llama", **cfg}, name="tiny")
        st = Strategy(method=method, precision=prec, attention=attn, gradient_checkpointing=gc, seq_len=s,
                      micro_batch_size=b, grad_accum=ga, lora_dropout=dropout, lora_targets=targets)
        est = estimate(spec, hw, st)
        predicted = est.to_dict()["memory"]["gpu_allocated_bytes"]
        err = 100.0 * (predicted / measured - 1.0)
        errors.append(err)
        label = (f"h{cfg['hidden_size']} {method} {'gc' if gc else '--'} {attn} {prec} b{b} s{s}"
                 + (f" ga{ga}" if ga > 1 else "") + "".join(f" {k}={v}" for k, v in extra.items()))
        print(f"{label:50} {measured / 1e6:12.1f} {predicted / 1e6:13.1f} {err:+6.1f}% "
              f"{t_step:7.3f} {est.step_seconds:7.3f}")
    print(f"error range {min(errors):+.1f}% .. {max(errors):+.1f}% over {len(errors)} configurations "
          f"({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
