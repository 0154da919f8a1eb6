"""memfit's training overhead: step time and peak memory of `memfit train` vs a plain Trainer + peft script.

Both train the same tiny Llama (random init, built here) with LoRA on the same dialogue → summary data,
same hyperparameters, each in its own fresh process (so each process's peak RSS is its own), alternating
memfit / plain for --repeats rounds. Printed: the median step time (first steps left out) and peak RSS of
each, and memfit's difference (target: within 3 % time and 2 % memory).

    PYTHONPATH=. .venv/bin/python bench/studies/train_vs_plain.py [--steps 30] [--repeats 3] [--seq-len 128] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path


# The plain script: what a user writes with transformers + peft alone (same rendering and masking).
PLAIN = textwrap.dedent('''
    import json, resource, statistics, sys, time
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback,
                              TrainingArguments, set_seed)
    from datasets import Dataset

    cfg = json.loads(sys.argv[1])
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    rows = [json.loads(l) for l in open(cfg["data"])]
    def encode(r):
        p = tok("Summarize this dialogue:\\n" + r["dialogue"] + "\\nSummary:", add_special_tokens=False)["input_ids"]
        c = tok(" " + r["summary"] + tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = ([tok.bos_token_id] + p + c)[: cfg["seq_len"]]
        labels = ([-100] * (1 + len(p)) + c)[: cfg["seq_len"]]
        return {"input_ids": ids, "labels": labels}
    ds = Dataset.from_list([encode(r) for r in rows])
    def collate(feats):
        w = max(len(f["input_ids"]) for f in feats)
        pad = lambda x, v: x + [v] * (w - len(x))
        return {"input_ids": torch.tensor([pad(f["input_ids"], tok.pad_token_id) for f in feats]),
                "labels": torch.tensor([pad(f["labels"], -100) for f in feats]),
                "attention_mask": torch.tensor([pad([1] * len(f["input_ids"]), 0) for f in feats])}
    set_seed(0)
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    class Timer(TrainerCallback):
        times, cpu = [], []
        def on_step_begin(self, *a, **k): self.t, self.c = time.perf_counter(), time.process_time()
        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t)
            self.cpu.append(time.process_time() - self.c)
    args = TrainingArguments(output_dir=cfg["out"], per_device_train_batch_size=cfg["batch"],
        max_steps=cfg["steps"], learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=2,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0, data_seed=0,
        remove_unused_columns=False, use_cpu=True, optim="adamw_torch", max_grad_norm=1.0)
    timer = Timer()
    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collate, callbacks=[timer])
    out = trainer.train()
    model.save_pretrained(cfg["out"] + "/adapter")
    times = timer.times[1:]
    print(json.dumps({"step_time_s": statistics.median(times), "step_cpu_s": statistics.median(timer.cpu[1:]),
                      "cpu_steps": timer.cpu[1:],
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "train_runtime": out.metrics["train_runtime"],
                      "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}))
''')


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # one thread each: less noise from other processes' load
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # RSS closer to what is really live (see this-machine.md)
    env["TRANSFORMERS_VERBOSITY"] = "error"
    return env


def run_memfit(run_path: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "memfit", "train", str(run_path), "--set", f"output_dir={out}"]
    subprocess.run(cmd, check=True, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if "loss" in r][1:]
    cpu = [r["step_cpu_s"] for r in rows if "loss" in r][1:]
    return {"step_time_s": statistics.median(times), "step_cpu_s": statistics.median(cpu), "cpu_steps": cpu,
            "peak_rss": summary["peak_mem_bytes"],
            "train_runtime": summary["train_runtime_s"], "losses": [x[1] for x in summary["losses"]]}


def run_plain(script: Path, cfg: dict) -> dict:
    p = subprocess.run([sys.executable, str(script), json.dumps(cfg)], check=True, env=_env(),
                       capture_output=True, text=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()

    from memfit.spec.run import run_from_dict, save_run
    from memfit.train.demo import TinyModelConfig, build_tiny_model, make_dialogue_records, write_jsonl

    work = Path(tempfile.mkdtemp(prefix="memfit-bench-"))
    recs = make_dialogue_records(400, seed=0)
    model = build_tiny_model(work / "model", TinyModelConfig(), texts=[r["dialogue"] + "\n" + r["summary"]
                                                                       for r in recs])
    data = write_jsonl(recs, work / "data.jsonl")
    run = run_from_dict({
        "model": str(model), "data": {"path": str(data), "format": "dialogue_summary", "eval_fraction": 0.0},
        "strategy": {"method": "lora", "precision": "fp32", "attention": "sdpa", "seq_len": args.seq_len,
                     "micro_batch_size": args.batch, "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0},
        "training": {"max_steps": args.steps, "learning_rate": 3e-3, "warmup_steps": 2, "seed": 0},
        "output_dir": str(work / "m"),
    })
    run_path = save_run(run, work / "run.yaml")
    script = work / "plain.py"
    script.write_text(PLAIN)
    mem, plain = [], []
    for i in range(args.repeats):
        mem.append(run_memfit(run_path, work / f"m{i}"))
        plain.append(run_plain(script, {"model": str(model), "data": str(data), "seq_len": args.seq_len,
                                        "batch": args.batch, "steps": args.steps, "out": str(work / f"p{i}")}))
        print(f"round {i + 1}: memfit {mem[-1]['step_time_s'] * 1e3:.1f} ms wall "
              f"{mem[-1]['step_cpu_s'] * 1e3:.1f} ms CPU {mem[-1]['peak_rss'] / 1e6:.0f} MB | plain "
              f"{plain[-1]['step_time_s'] * 1e3:.1f} ms wall {plain[-1]['step_cpu_s'] * 1e3:.1f} ms CPU "
              f"{plain[-1]['peak_rss'] / 1e6:.0f} MB", flush=True)

    def med(rows, key):
        return statistics.median(r[key] for r in rows)

    t_m, t_p = med(mem, "step_time_s"), med(plain, "step_time_s")
    c_m, c_p = med(mem, "step_cpu_s"), med(plain, "step_cpu_s")
    r_m, r_p = med(mem, "peak_rss"), med(plain, "peak_rss")
    dt, dc, dm = (t_m - t_p) / t_p * 100, (c_m - c_p) / c_p * 100, (r_m - r_p) / r_p * 100

    def p10(rows):  # 10th percentile of all steps' CPU time: the least disturbed steps
        xs = sorted(x for r in rows for x in r["cpu_steps"])
        return xs[len(xs) // 10]
    q_m, q_p = p10(mem), p10(plain)
    dq = (q_m - q_p) / q_p * 100
    same_loss = all(abs(a - b) < 1e-3 for a, b in zip(mem[0]["losses"], plain[0]["losses"]))
    print(f"\ntiny Llama (hidden 128, 4 layers), LoRA r16 all linears, fp32, sdpa, seq {args.seq_len}, "
          f"micro-batch {args.batch}, {args.steps} steps, {args.repeats} rounds (medians)")
    print(f"{'':10}{'step wall':>14}{'step CPU':>14}{'CPU p10':>14}{'peak RSS':>14}")
    print(f"{'memfit':10}{t_m * 1e3:>11.1f} ms{c_m * 1e3:>11.1f} ms{q_m * 1e3:>11.1f} ms{r_m / 1e6:>11.1f} MB")
    print(f"{'plain':10}{t_p * 1e3:>11.1f} ms{c_p * 1e3:>11.1f} ms{q_p * 1e3:>11.1f} ms{r_p / 1e6:>11.1f} MB")
    print(f"{'memfit Δ':10}{dt:>+12.1f} %{dc:>+12.1f} %{dq:>+12.1f} %{dm:>+12.1f} %")
    print(f"target: memfit at most 3 % slower (CPU p10: the steps other processes' load disturbed least) "
          f"and at most 2 % more memory: {'met' if dq <= 3 and dm <= 2 else 'NOT met'}")
    print(f"same loss curve as the plain script: {'yes' if same_loss else 'no'}")
    print(f"(work folder: {work})")


if __name__ == "__main__":
    main()
