"""The calibration's measurements of other libraries' code rather than torch's kernels (memfit.measure.hwcal runs
them beside memfit.measure.kernels): bitsandbytes' NF4 dequantisation and ``Linear4bit`` calls, and the
dispatch cost of transformers' Llama layers and PEFT's adapters, forward + backward, at widths where compute
is nil (the host's side of a step: memfit.steptime.host / measured)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from memfit.measure.kernels import Timer


def nf4_dequant_rate(device: str, timer: Timer) -> Optional[float]:
    """bitsandbytes NF4 dequantisation, elements/s (None where bitsandbytes cannot run here). On CUDA the
    slope between a 64M and a 128M-value matrix: one 1M-value call there is all launch (the H200 read
    13 G values/s at 1024 x 1024, where the work streams at ~1e12), a cost ``nf4_call_s`` holds apart."""
    try:
        import bitsandbytes.functional as BF

        def seconds(rows: int, cols: int) -> float:
            w = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
            q, state = BF.quantize_4bit(w, quant_type="nf4")
            return timer(lambda: BF.dequantize_4bit(q, state), reps=4)
        if device != "cuda":
            return 1024 * 1024 / seconds(1024, 1024)
        small, big = seconds(8192, 8192), seconds(16384, 8192)
        return 8192 * 8192 / max(big - small, 1e-9)
    except Exception:  # no bitsandbytes, or no kernel for this device
        return None


def nf4_linear_call_seconds(device: str, timer: Timer) -> Optional[float]:
    """bitsandbytes ``Linear4bit`` forward + input gradient at a width where the work is small, less the same
    dense frozen linear: the per-call cost of its Python, quant-state handling and dequantised copy (CPU here:
    ~0.5 ms, whatever the width up to 256). None where bitsandbytes cannot run here."""
    try:
        import bitsandbytes as bnb

        dt = torch.float32 if device == "cpu" else torch.bfloat16
        dense = torch.nn.Linear(256, 256, bias=False, device=device, dtype=dt).requires_grad_(False)
        lin = bnb.nn.Linear4bit(256, 256, bias=False, compute_dtype=dt, quant_type="nf4")
        lin.weight = bnb.nn.Params4bit(dense.weight.data.to("cpu", torch.float32).clone(), requires_grad=False,
                                       quant_type="nf4")
        lin = lin.to(device)
        x = torch.randn(64, 256, device=device, dtype=dt, requires_grad=True)
        g = torch.randn(64, 256, device=device, dtype=dt)

        def run(layer: torch.nn.Module) -> Callable[[], None]:
            def step() -> None:
                layer(x).backward(g)
                x.grad = None
            return step
        t = timer.interleaved({"nf4": run(lin), "dense": run(dense)}, rounds=7)
        return max(0.0, t["nf4"] - t["dense"])
    except Exception:  # no bitsandbytes, or no kernel for this device
        return None


def model_overheads(device: str, timer: Timer) -> dict[str, float]:
    """Dispatch cost of transformers' own Llama code, forward + backward, at widths where compute is nil:
    per decoder layer (from 2 vs 4 layers), the rest of the model (embedding, mask, norm, head, loss),
    per LoRA-adapted linear (PEFT) and eager attention's extra per layer. On CUDA as memfit's trainer runs
    there: a bf16 base under bf16 autocast (its casts are host work too), LoRA's adapters left fp32."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cuda = device == "cuda"
    ids = torch.randint(0, 64, (1, 8), device=device)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    def step_of(layers: int, lora: bool = False, attn: str = "sdpa", gc: bool = False) -> Callable[[], None]:
        cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
                          vocab_size=64, num_hidden_layers=layers, max_position_embeddings=64,
                          attn_implementation=attn)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(device, torch.bfloat16 if cuda else torch.float32)
        if gc:  # as memfit's methods enable it (memfit.methods.base.GC_KWARGS: non-reentrant)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora:
            model = get_peft_model(model, LoraConfig(r=2, target_modules=targets, lora_dropout=0.0))
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]

        def step() -> None:
            with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            for p in params:
                p.grad = None
        return step
    t = timer.interleaved({"two": step_of(2), "four": step_of(4), "lora": step_of(4, lora=True),
                           "eager": step_of(4, attn="eager"), "gc": step_of(4, gc=True)}, rounds=7)
    two, four = t["two"], t["four"]
    layer = max(0.0, (four - two) / 2)
    return {"layer": layer, "model": max(0.0, two - 2 * layer),
            "adapter": max(0.0, (t["lora"] - four) / (4 * len(targets))),
            "eager_layer_extra": max(0.0, (t["eager"] - four) / 4),
            "gc_layer_extra": max(0.0, (t["gc"] - four) / 4)}
