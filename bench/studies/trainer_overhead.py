"""The HF Trainer's own cost per step on this machine, in small-op costs (the Profile's trainer_* constants).

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/studies/trainer_overhead.py          # ~2 minutes

On a Llama of width 16 (compute is nil) every configuration runs twice: through memfit's trainer
(``memfit measure``'s path: a fresh process, 2 warm-up + 25 timed steps, the median loop iteration,
on_step_begin to the next on_step_begin, and of the step proper within it, on_step_begin -> on_step_end)
and as a bare loop in this process (forward, backward, clipping, AdamW,
zero_grad: what the Trainer runs besides its own code). The difference, in units of one small op
(``memfit.measure.kernels.op_seconds``, measured beside it), is the Trainer's loop; it grows with the
model's modules and parameters (``items``), which the Trainer walks every step — per micro-batch
``model.num_parameters(exclude_embeddings=True)`` for its FLOP count (transformers trainer.py
``floating_point_ops``), and ``model.zero_grad()`` / accelerate's ``clip_grad_norm_(model.parameters())``.
Prints per configuration the measured op-units — the whole iteration, and the part of it outside the step
proper (the Trainer's logging and the next batch's fetch, measured within the same process, so steadier than
the difference to the bare loop) — and what memfit.steptime.step predicts.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = [("full", None, 1, 2), ("full", None, 4, 2), ("full", None, 1, 6), ("lora", ["q_proj", "v_proj"], 1, 2),
         ("lora", ALL, 1, 2), ("lora", ALL, 4, 2), ("lora", ALL, 1, 6)]
REPS = int(os.environ.get("MEMFIT_BENCH_REPS", "3"))


def tiny_model(folder: Path, layers: int) -> Path:
    if (folder / "config.json").is_file():
        return folder
    from transformers import LlamaConfig, LlamaForCausalLM

    from memfit.measure.worker import synthetic_text_records
    from memfit.train.demo import train_tokenizer

    tok = train_tokenizer([r["text"] for r in synthetic_text_records(200, 64, seed=5)], 2048)
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def bare_seconds(folder: Path, method: str, targets, ga: int) -> float:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from memfit.measure.kernels import Timer

    model = LlamaForCausalLM.from_pretrained(folder)
    if method == "lora":
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    mask = torch.ones_like(ids)

    def step() -> None:
        for _ in range(ga):
            model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return Timer("cpu")(step, reps=25, cap=3.0)


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from memfit.measure.kernels import Timer, op_seconds
    from memfit.measure.runner import predict, run_measured_process
    from memfit.spec.run import run_from_dict

    root = Path(tempfile.mkdtemp(prefix="memfit-trainer-overhead-"))
    results: list[dict] = []
    print(f"{'case':34s} {'iter ms':>8s} {'bare ms':>8s} {'op us':>6s} {'ops':>5s} {'outside':>7s} "
          f"{'predicted ops':>13s}")
    for method, targets, ga, layers in CASES:
        folder = tiny_model(root / f"l{layers}", layers)
        strategy = {"method": method, "seq_len": 16, "micro_batch_size": 1, "grad_accum": ga, "precision": "fp32",
                    "lora_dropout": 0.0, **({"lora_targets": targets} if targets else {})}
        run = run_from_dict({"model": str(folder), "hardware": "local", "strategy": strategy,
                             "output_dir": str(root / "out")})
        ops, outside, windows, bares = [], [], [], []
        for _ in range(REPS):
            m = run_measured_process(run, warmup=2, steps=25, categories=False, threads=1)
            window = m["step_seconds"]
            bare, op = bare_seconds(folder, method, targets, ga), op_seconds("cpu", Timer("cpu"))
            ops.append((window - bare) / op)
            outside.append((window - m["step_window_seconds"]) / op)
            windows.append(window)
            bares.append(bare)
        t = predict(run)["time"]
        name = f"{method} {len(targets or [])} targets ga {ga} layers {layers}"
        results.append({"case": name, "items": items_of(folder, method, targets), "ga": ga, "ops": ops,
                        "outside_ops": outside})
        print(f"{name:34s} {1e3 * min(windows):8.2f} {1e3 * min(bares):8.2f} {1e6 * op:6.1f} "
              f"{statistics.median(ops):5.0f} {statistics.median(outside):7.0f} "
              f"{t.get('trainer_ops', float('nan')):13.0f}", flush=True)
    print(json.dumps(results))
    return 0


def items_of(folder: Path, method: str, targets) -> int:
    """Modules + parameter tensors of the model as the Trainer holds it (what its walks visit)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder)
    if method == "lora":
        model = get_peft_model(model, LoraConfig(r=16, target_modules=targets))
    return len(list(model.named_modules())) + len(list(model.named_parameters()))


if __name__ == "__main__":
    sys.exit(main())
