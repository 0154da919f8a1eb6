"""GPU check: measure real CUDA training steps of 1-3B models against memfit's estimate (one GPU).

    PYTHONPATH=. python bench/gpu_check.py --out DIR            # on a machine with one CUDA GPU; < 8 minutes
    PYTHONPATH=. python bench/gpu_check.py --replay DIR/gpu_check.json   # re-predict saved measurements (no GPU)
    PYTHONPATH=. python bench/gpu_check.py --tiny --out DIR     # the same code path on micro shapes (CPU is fine)

Models are random-weight ``save_pretrained`` folders with the real shapes of Llama-3.2-1B/3B (memory does
not depend on weight values; no hub). Each configuration runs through ``memfit measure``'s own path (a
fresh process per configuration, memfit's trainer, the probe's CUDA counters) for 1 warm-up and 2
measured optimizer steps. Printed per configuration: the predicted allocated peak (the estimate's total
less its overhead line) against ``torch.cuda.max_memory_allocated``, the measured reserved peak and the
CUDA context (``mem_get_info`` less reserved), step time, and which CUDA code paths ran. The JSON file
keeps each run and its measurement, so ``--replay`` re-predicts them with the current estimator.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


GiB = 1024 ** 3

# Real shapes (Llama-3.2 model cards' config.json values): vocabulary, tied embeddings, GQA.
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=4096),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=4096),
    "tiny": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True,
                 max_position_embeddings=512),
}

# (name, shape, strategy overrides, extra environment). Every one is bf16-mixed with AdamW unless it says.
CONFIGS = [
    ("1b-full-sdpa", "llama-3.2-1b", dict(method="full", seq_len=1024, micro_batch_size=4), {}),
    ("1b-full-gc-sdpa", "llama-3.2-1b", dict(method="full", seq_len=1024, micro_batch_size=4,
                                             gradient_checkpointing=True), {}),
    ("1b-lora-sdpa", "llama-3.2-1b", dict(method="lora", seq_len=1024, micro_batch_size=4), {}),
    ("1b-lora-gc-eager", "llama-3.2-1b", dict(method="lora", seq_len=1024, micro_batch_size=2,
                                              gradient_checkpointing=True, attention="eager"), {}),
    ("1b-lora-fa2", "llama-3.2-1b", dict(method="lora", seq_len=1024, micro_batch_size=4, attention="fa2"), {}),
    ("1b-qlora-sdpa", "llama-3.2-1b", dict(method="qlora", seq_len=1024, micro_batch_size=4), {}),
    ("1b-qlora-gc-sdpa", "llama-3.2-1b", dict(method="qlora", seq_len=2048, micro_batch_size=4,
                                              gradient_checkpointing=True), {}),
    ("3b-lora-sdpa-768x4", "llama-3.2-3b", dict(method="lora", seq_len=768, micro_batch_size=4), {}),
    ("3b-lora-sdpa-768x4-expseg", "llama-3.2-3b", dict(method="lora", seq_len=768, micro_batch_size=4),
     {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    ("3b-qlora-gc-sdpa", "llama-3.2-3b", dict(method="qlora", seq_len=2048, micro_batch_size=2,
                                              gradient_checkpointing=True), {}),
    ("3b-full-gc-sdpa", "llama-3.2-3b", dict(method="full", seq_len=2048, micro_batch_size=2,
                                             gradient_checkpointing=True), {}),
]
# The second run (after the GPU physics, the chunked loss and the token-id measure path landed).
CONFIGS_2 = [
    ("1b-lora-gc-sdpa-2048x4", "llama-3.2-1b", dict(method="lora", seq_len=2048, micro_batch_size=4,
                                                    gradient_checkpointing=True), {}),
    ("1b-lora-gc-sdpa-2048x4-chunked", "llama-3.2-1b", dict(method="lora", seq_len=2048, micro_batch_size=4,
                                                            gradient_checkpointing=True, loss="chunked"), {}),
    ("1b-qlora-sdpa-chunked", "llama-3.2-1b", dict(method="qlora", seq_len=1024, micro_batch_size=4,
                                                   loss="chunked"), {}),
    ("1b-full-gc-sdpa-expseg", "llama-3.2-1b", dict(method="full", seq_len=1024, micro_batch_size=4,
                                                    gradient_checkpointing=True),
     {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
]
# The long-context levers one GPU can exercise (issue 36; sequence / context parallelism need two): checkpointed and
# full activation offload against the same run without, and DeepSpeed's TiledMLP under ZeRO-1 on one process.
CONFIGS_LONG = [
    ("1b-lora-gc-16k", "llama-3.2-1b", dict(method="lora", seq_len=16384, micro_batch_size=1,
                                            gradient_checkpointing=True, loss="chunked"), {}),
    ("1b-lora-gc-16k-offload", "llama-3.2-1b", dict(method="lora", seq_len=16384, micro_batch_size=1,
                                                    gradient_checkpointing=True, loss="chunked",
                                                    activation_offload="checkpointed"), {}),
    ("1b-lora-gc-16k-offload-all", "llama-3.2-1b", dict(method="lora", seq_len=16384, micro_batch_size=1,
                                                        gradient_checkpointing=True, loss="chunked",
                                                        activation_offload="all"), {}),
    ("1b-full-z1-gc-16k-tiled", "llama-3.2-1b", dict(method="full", seq_len=16384, micro_batch_size=1,
                                                     gradient_checkpointing=True, loss="chunked", zero_stage=1,
                                                     tiled_mlp=True), {}),
]
TINY_CONFIGS = [
    ("tiny-full", "tiny", dict(method="full", seq_len=64, micro_batch_size=2, precision="fp32"), {}),
    ("tiny-lora-gc", "tiny", dict(method="lora", seq_len=64, micro_batch_size=2, precision="fp32",
                                  gradient_checkpointing=True), {}),
    ("tiny-lora-chunked", "tiny", dict(method="lora", seq_len=64, micro_batch_size=2, precision="fp32",
                                       loss="chunked"), {}),
]


def build_model_dir(shape: str, root: Path) -> Path:
    """A random-weight model folder of ``shape`` (bf16 on a GPU, built on the GPU) with a small local
    tokenizer; written once."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from memfit.train.demo import make_dialogue_records, train_tokenizer

    out = root / shape
    if (out / "config.json").is_file():
        return out
    texts = [r["dialogue"] + "\n" + r["summary"] for r in make_dialogue_records(200, seed=0)]
    tok = train_tokenizer(texts, 512)
    cfg = LlamaConfig(**SHAPES[shape], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = LlamaForCausalLM(cfg).to(dtype)
    tmp = root / f".{shape}.tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    del model
    if cuda:
        torch.cuda.empty_cache()
    os.replace(tmp, out)
    return out


def run_spec(model_dir: Path, overrides: dict, work: Path):
    from memfit.spec.run import run_from_dict

    strategy = {"precision": "bf16-mixed", "attention": "sdpa", "lora_r": 16, "lora_alpha": 32,
                "lora_dropout": 0.0, **overrides}
    return run_from_dict({"model": str(model_dir), "hardware": "local", "strategy": strategy,
                          "output_dir": str(work / "unused")}, source="gpu_check")


def code_paths(strategy: dict, measured: dict) -> list[str]:
    """What this configuration exercised on the device, read off the run and the measurement."""
    paths = [measured.get("method") or "?"]
    if strategy.get("method") == "qlora":
        paths.append("bitsandbytes Linear4bit (NF4) on CUDA")
    paths.append({"sdpa": "SDPA", "eager": "eager attention", "fa2": "FlashAttention-2"}
                 .get(strategy.get("attention", "sdpa"), "?"))
    if strategy.get("gradient_checkpointing"):
        paths.append("checkpointing")
    if strategy.get("loss") == "chunked":
        paths.append("chunked cross-entropy")
    return paths


def predicted_allocated(pred: dict) -> tuple[float | None, float | None, float | None]:
    """(allocated, reserved, reserved + context held against capacity) predicted per GPU. The estimate's
    allocated peak is its total less the overhead line where it has no explicit allocated figure."""
    mem = (pred or {}).get("memory", {})
    gpu = mem.get("gpu_bytes", {})
    alloc = mem.get("gpu_allocated_bytes")
    if alloc is None and gpu.get("total") is not None:
        alloc = gpu["total"] - gpu.get("overhead", 0.0)
    return alloc, mem.get("gpu_reserved_bytes"), gpu.get("total")


def row_of(name: str, run_dict: dict, measured: dict, env: dict) -> dict:
    """Predict ``run_dict`` with the current estimator and set it against ``measured``."""
    from memfit.measure.compare import error_pct
    from memfit.measure.runner import predict
    from memfit.spec.run import run_from_dict

    run = run_from_dict(run_dict, source="gpu_check")
    try:
        pred = predict(run)
    except Exception as err:  # a bench: report the estimator's failure on this row and go on
        pred, note = None, f"estimate failed: {type(err).__name__}: {err}"
    else:
        note = ""
    alloc_p, res_p, total_p = predicted_allocated(pred)
    alloc_m, res_m = measured.get("peak_allocated_bytes"), measured.get("peak_reserved_bytes")
    ctx = measured.get("cuda_context_bytes")
    smi_m = res_m + ctx if (res_m is not None and ctx is not None) else None
    t_p = ((pred or {}).get("time") or {}).get("step_seconds")
    return {
        "name": name, "env": env, "note": note, "device": measured.get("device"),
        "allocated_pred": alloc_p, "allocated_meas": alloc_m, "allocated_err_pct": error_pct(alloc_p, alloc_m),
        "reserved_pred": res_p, "reserved_meas": res_m, "reserved_err_pct": error_pct(res_p, res_m),
        "context_meas": ctx, "total_pred": total_p, "device_total_meas": smi_m,
        "total_err_pct": error_pct(total_p, smi_m),
        "step_pred_s": t_p, "step_meas_s": measured.get("step_seconds"),
        "step_err_pct": error_pct(t_p, measured.get("step_seconds")),
        "paths": code_paths(run_dict["strategy"], measured),
        "components_meas": measured.get("components"),
    }


def environment() -> dict:
    import importlib.metadata as md

    info = {"python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    for pkg in ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "flash_attn"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = None
    # read in a child process: a CUDA context in this process would count in every measured run's
    # context figure (mem_get_info sees the whole GPU)
    probe = ("import json, torch\n"
             "if torch.cuda.is_available():\n"
             "    p = torch.cuda.get_device_properties(0)\n"
             "    from memfit.spec.hardware import parse_hardware\n"
             "    print(json.dumps(dict(gpu=p.name, gpu_memory_bytes=p.total_memory, cuda=torch.version.cuda,\n"
             "        capability=f'{p.major}.{p.minor}', memfit_gpu=parse_hardware('local').gpu.name)))\n")
    got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if got.returncode == 0 and got.stdout.strip():
        info.update(json.loads(got.stdout.strip().splitlines()[-1]))
    return info


def measure_all(configs, out: Path, models: Path, budget_s: float, steps: int, categories: bool) -> dict:
    import importlib.util

    from memfit.errors import MemfitError
    from memfit.measure.runner import run_measured_process

    models.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    result = {"environment": environment(), "records": [], "skipped": []}
    t0 = time.time()
    for name, shape, overrides, env in configs:
        if time.time() - t0 > budget_s:
            result["skipped"].append({"name": name, "why": f"time budget of {budget_s:.0f} s spent"})
            continue
        if overrides.get("attention") == "fa2" and importlib.util.find_spec("flash_attn") is None:
            result["skipped"].append({"name": name, "why": "flash_attn is not installed here (FA2 not run)"})
            continue
        # built in a child process: a CUDA context in this process would count in every measured
        # run's context figure (mem_get_info sees the whole GPU)
        built = subprocess.run([sys.executable, __file__, "--build", shape, "--models", str(models)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            why = (built.stderr.strip().splitlines() or ["?"])[-1]
            result["skipped"].append({"name": name, "why": f"model build failed: {why}"})
            continue
        model_dir = models / shape
        run = run_spec(model_dir, overrides, out)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        started = time.time()
        try:
            measured = run_measured_process(run, warmup=1, steps=steps, timeout=300,
                                            categories=categories)
        except MemfitError as err:
            result["skipped"].append({"name": name, "why": str(err)[:500]})
            print(f"[{time.time() - t0:6.1f}s] {name}: FAILED {str(err)[:300]}", flush=True)
            continue
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        run_dict = run.model_dump(mode="json")
        run_dict["strategy"]["lora_targets"] = list(run.strategy.lora_targets)
        result["records"].append({"name": name, "shape": shape, "env": env, "run": run_dict,
                                  "config": json.loads((model_dir / "config.json").read_text()),
                                  "measured": measured, "wall_s": round(time.time() - started, 1)})
        print(f"[{time.time() - t0:6.1f}s] {name}: allocated {measured['peak_allocated_bytes'] / GiB:.2f} GiB",
              flush=True)
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    return result


def fmt(v, scale=GiB, nd=2):
    return "-" if v is None else f"{v / scale:.{nd}f}"


def replay_configs(result: dict, root: Path) -> None:
    """Point each saved run at a config.json of its shape under ``root`` (the measured machine's model
    folders are not here); records saved before configs were kept get one built from SHAPES."""
    env = result.get("environment", {})
    gpu = env.get("memfit_gpu")
    if gpu is None and env.get("gpu"):
        from memfit.spec.hardware import _match_detected  # the name `local` would have matched there

        gpu = _match_detected(env["gpu"], env.get("gpu_memory_bytes", 0)).name
    for rec in result["records"]:
        cfg = rec.get("config") or {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                    "hidden_act": "silu", "torch_dtype": "bfloat16", **SHAPES[rec["shape"]]}
        folder = root / rec["shape"]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(cfg))
        rec["run"] = {**rec["run"], "model": str(folder), "hardware": f"1x{gpu}" if gpu else "local"}


def report(result: dict) -> dict:
    rows = [row_of(r["name"], r["run"], r["measured"], r.get("env", {})) for r in result["records"]]
    env = result.get("environment", {})
    lines = [f"GPU check: {env.get('gpu', 'no GPU')} (cc {env.get('capability', '-')}), torch {env.get('torch')}, "
             f"transformers {env.get('transformers')}, peft {env.get('peft')}, bitsandbytes "
             f"{env.get('bitsandbytes')}, flash_attn {env.get('flash_attn')}; measured {env.get('date')}",
             f"{'config':28} {'alloc pred':>10} {'alloc meas':>10} {'err %':>7} {'resv pred':>9} {'resv meas':>9} "
             f"{'err %':>7} "
             f"{'ctx':>5} {'total pred':>10} {'smi meas':>9} {'err %':>7} {'step pred':>9} {'step meas':>9}"]
    for r in rows:
        lines.append(f"{r['name']:28} {fmt(r['allocated_pred']):>10} {fmt(r['allocated_meas']):>10} "
                     f"{r['allocated_err_pct'] if r['allocated_err_pct'] is not None else '-':>7} "
                     f"{fmt(r['reserved_pred']):>9} {fmt(r['reserved_meas']):>9} "
                     f"{r['reserved_err_pct'] if r['reserved_err_pct'] is not None else '-':>7} "
                     f"{fmt(r['context_meas']):>5} {fmt(r['total_pred']):>10} "
                     f"{fmt(r['device_total_meas']):>9} "
                     f"{r['total_err_pct'] if r['total_err_pct'] is not None else '-':>7} "
                     f"{fmt(r['step_pred_s'], 1, 3):>9} {fmt(r['step_meas_s'], 1, 3):>9}  {'; '.join(r['paths'])}"
                     + (f"  [{r['note']}]" if r["note"] else ""))
    for metric in ("allocated", "reserved", "total"):
        errs = [r[f"{metric}_err_pct"] for r in rows if r[f"{metric}_err_pct"] is not None]
        if errs:
            lines.append(f"{metric}: median |err| {statistics.median(map(abs, errs)):.1f} %, max |err| "
                         f"{max(map(abs, errs)):.1f} %, most under {min(errs):+.1f} % over {len(errs)} "
                         f"configurations")
    lines.append("GiB; smi = reserved + context (what nvidia-smi shows), held against the estimate's total")
    for s in result.get("skipped", []):
        lines.append(f"not measured: {s['name']}: {s['why']}")
    return {"rows": rows, "text": "\n".join(lines), "environment": env, "skipped": result.get("skipped", [])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out", help="folder for models and results")
    ap.add_argument("--replay", help="a saved gpu_check.json: re-predict it with the current estimator")
    ap.add_argument("--tiny", action="store_true", help="micro shapes (a CPU check of this script)")
    ap.add_argument("--second", action="store_true", help="the second set of configurations (chunked loss, "
                    "long checkpointed LoRA, expandable_segments under checkpointing)")
    ap.add_argument("--long", action="store_true", help="the long-context levers one GPU can run (activation "
                    "offload, the tiled MLP)")
    ap.add_argument("--only", help="comma-separated configuration names")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds after which no new configuration starts")
    ap.add_argument("--steps", type=int, default=2, help="measured optimizer steps per configuration")
    ap.add_argument("--models", help="folder for the generated model folders (default: OUT/models)")
    ap.add_argument("--categories", action="store_true", help="also break the peak down by category (slower)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--build", choices=sorted(SHAPES), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.build:
        build_model_dir(args.build, Path(args.models or "."))
        return 0
    if args.replay:
        import tempfile

        result = json.loads(Path(args.replay).read_text())
        replay_configs(result, Path(tempfile.mkdtemp(prefix="memfit-gpu-check-")))
    else:
        configs = TINY_CONFIGS if args.tiny else CONFIGS_2 if args.second else CONFIGS_LONG if args.long else CONFIGS
        if args.only:
            wanted = set(args.only.split(","))
            configs = [c for c in configs if c[0] in wanted]
        out = Path(args.out)
        result = measure_all(configs, out, Path(args.models) if args.models else out / "models",
                             args.budget, args.steps, args.categories)
    rep = report(result)
    print(json.dumps(rep, indent=1, default=str) if args.json else rep["text"])
    if not args.replay:
        (Path(args.out) / "gpu_check.txt").write_text(rep["text"] + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
