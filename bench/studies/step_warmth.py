"""A training step right after other work against one right after its own previous step (why the baton of
bench/time_grid.py gives each process two steps per turn and times the second; docs/time.md "Interleaved
turns").

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/studies/step_warmth.py        # ~30 s

The Qwen2-style model of bench/time_grid.py with LoRA on every linear, eager attention, 1 x 128 tokens (a
small, dispatch-bound step), one thread, a bare loop (forward, backward, clipping, AdamW). Prints the median
of 15 steps after each kind of work between steps.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path



def main() -> int:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from bench.time_grid import build_models

    torch.set_num_threads(1)
    folder = build_models(Path("/tmp/memfit-time-grid-models"))["qwen2"]
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (1, 128))
    a = torch.randn(256, 256)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()

    def busy(seconds: float, matmul: bool = False) -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            if matmul:
                a @ a
    big = torch.empty(16 << 20)
    cases = [("back to back", lambda: None), ("after 0.1 s of a Python loop", lambda: busy(0.1)),
             ("after 0.1 s of 256x256 matmuls", lambda: busy(0.1, True)),
             ("after a 0.1 s sleep", lambda: time.sleep(0.1)), ("after writing 64 MB", lambda: big.fill_(1.0)),
             ("after 0.1 s of a Python loop + 1 step", lambda: (busy(0.1), step()))]
    for _ in range(3):
        step()
    for name, between in cases:
        times = []
        for _ in range(15):
            between()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        print(f"{name:40s} {1e3 * statistics.median(times):6.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
