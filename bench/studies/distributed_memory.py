"""Per-rank model-state memory under DDP, ZeRO-1/2/3 (+offload) and FSDP2, measured on 2 CPU processes.

    PYTHONPATH=. .venv/bin/python bench/studies/distributed_memory.py [--hidden 256 --layers 4 --steps 2] [--json]
    PYTHONPATH=. .venv/bin/python bench/studies/distributed_memory.py --peak [--cases fsdp1/full,fsdp2/lora]
        # allocator peak

``--peak``: FSDP1 and FSDP2, full fine-tuning, LoRA and QLoRA (bitsandbytes' CPU NF4, storage fp32), each in its own
2-process gloo launch: a tiny random Llama (h 256, 4 layers, vocab 2000, fp32, AdamW, micro-batch 2, sequence 512),
wrapped as memfit's FSDP engines have accelerate wrap it — FSDP1: ``FullyShardedDataParallel`` with
TRANSFORMER_BASED_WRAP on the decoder layers (+ PEFT's ``fsdp_auto_wrap_policy`` for LoRA), ``use_orig_params``,
``limit_all_gathers``, BACKWARD_PRE; FSDP2: ``fully_shard`` on every decoder layer, the untied embedding, the tail
(final norm + head, ``reshard_after_forward=False``) and the root (accelerate/utils/fsdp_utils.py fsdp2_prepare_model).
Each rank measures its allocator peak over one step after a warm-up step (memfit's TensorMemoryProbe) against
``memory.gpu_allocated_bytes`` for the same strategy on the ``2xCPU`` pool. ~30 s per case on 2 cores.
Opt-in cases: ``+gc`` (memfit's checkpoint), ``+gcl`` (transformers < 4.52's: reentrant, put around each FSDP1
unit; strategy.hf_legacy_checkpoint). ``MEMFIT_PEAK_LAYERS`` / ``MEMFIT_PEAK_VOCAB`` change the tiny model's
layers / vocabulary for both sides (diagnostics: a slope in layers, a head too small to set the peak).

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

ROOT = Path(__file__).resolve().parents[2]
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


PEAK_RAW = {"hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8, "num_key_value_heads": 2,
            # diagnostics (module docstring): a slope in layers, a head too small to set the peak
            "num_hidden_layers": int(os.environ.get("MEMFIT_PEAK_LAYERS", "4")),
            "vocab_size": int(os.environ.get("MEMFIT_PEAK_VOCAB", "2000"))}
PEAK_CASES = ("fsdp1/full", "fsdp1/lora", "fsdp1/qlora", "fsdp2/full", "fsdp2/lora", "fsdp2/qlora",
              # + gradient checkpointing as the HF Trainer enables it (non-reentrant, inside each decoder layer's
              # __call__: transformers' GradientCheckpointingLayer), not in the default set (--cases)
              "fsdp1/lora+gc", "fsdp2/lora+gc", "fsdp1/full+gc", "fsdp2/full+gc",
              # + transformers < 4.52's checkpoint: reentrant, around each decoder layer's FSDP unit (here put
              # there by _legacy_checkpoint); FSDP1's reshard-only hook keeps every layer's input and gradient
              "fsdp1/lora+gcl", "fsdp1/qlora+gcl", "fsdp1/full+gcl")
DEFAULT_PEAK_CASES = PEAK_CASES[:6]


def _peak_strategy(case: str):
    from memfit.spec.strategy import Strategy

    version, method = case.split("/")
    legacy = method.endswith("+gcl")
    gc = legacy or method.endswith("+gc")
    method = method.removesuffix("+gcl").removesuffix("+gc")
    extra = {"quant_storage": "fp32"} if method == "qlora" else {}  # one dtype per flat parameter (fp32 run)
    return Strategy(method=method, precision="fp32", seq_len=512, micro_batch_size=2, fsdp="full_shard",
                    gradient_checkpointing=gc, hf_legacy_checkpoint=legacy,
                    fsdp_version=int(version[-1]), lora_dropout=0.0, lora_r=16, **extra,
                    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


def _wrap(model, case: str, peft_model):
    import functools

    import torch

    version = case.split("/")[0]
    layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    if version == "fsdp1":
        from torch.distributed.fsdp import BackwardPrefetch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        if peft_model:
            from peft.utils.other import fsdp_auto_wrap_policy

            policy = fsdp_auto_wrap_policy(model)
        else:
            policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={type(layers[0])})
        # as accelerate's plugin (memfit's config; sync_module_states needs a GPU, so off on the CPU)
        return FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True,
                    limit_all_gathers=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=False)
    from torch.distributed.fsdp import fully_shard

    base = model.get_base_model() if peft_model else model
    for layer in layers:
        fully_shard(layer)
    fully_shard(base.model.embed_tokens)  # untied: its own unit
    fully_shard([base.lm_head, base.model.norm], reshard_after_forward=False)
    fully_shard(model)
    return model


def _legacy_checkpoint(model) -> None:
    """transformers < 4.52's gradient checkpointing: the model's layer loop calls torch's reentrant checkpoint
    around each decoder layer — here around each decoder layer's FSDP unit, as it was when FSDP wrapped the
    layers (``self._gradient_checkpointing_func(decoder_layer.__call__, hidden_states, ...)``)."""
    import functools

    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    class AroundUnit(torch.nn.Module):
        def __init__(self, unit):
            super().__init__()
            self.unit = unit

        def forward(self, hidden_states, *args, **kwargs):
            return torch.utils.checkpoint.checkpoint(functools.partial(self.unit, **kwargs), hidden_states, *args,
                                                     use_reentrant=True)

    for layers in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
        for i, unit in enumerate(layers):
            if isinstance(unit, FSDP):
                layers[i] = AroundUnit(unit)


def _quantized(model):
    """The same random model reloaded through transformers' bitsandbytes NF4 path (CPU kernels), storage fp32
    as memfit's QLoRA under FSDP on the CPU (one dtype per flat parameter), compute fp32."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    with tempfile.TemporaryDirectory() as folder:
        # every rank writes its own copy (save_pretrained writes on rank 0 only under torch.distributed)
        from safetensors.torch import save_file

        model.config.save_pretrained(folder)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{folder}/model.safetensors")
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                               bnb_4bit_quant_storage=torch.float32)
        return AutoModelForCausalLM.from_pretrained(folder, quantization_config=q, dtype=torch.float32,
                                                    attn_implementation="sdpa")


def build_case(case: str):
    """(model wrapped as the case says, its AdamW, the token ids) on this rank (the process group is up)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**PEAK_RAW, attn_implementation="sdpa"))
    st = _peak_strategy(case)
    peft_model = st.method in ("lora", "qlora")
    if st.method == "qlora":
        model = _quantized(model)
    if st.gradient_checkpointing:  # as memfit's methods enable it (memfit.methods.base.GC_KWARGS); the
        # legacy one is put around the wrapped units below instead
        if not st.hf_legacy_checkpoint:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if peft_model or st.hf_legacy_checkpoint:
            model.enable_input_require_grads()
    if peft_model:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=st.lora_r, lora_alpha=st.lora_alpha, lora_dropout=0.0,
                                                 target_modules=list(st.lora_targets), task_type="CAUSAL_LM"))
    model = _wrap(model, case, peft_model)
    if st.hf_legacy_checkpoint:
        _legacy_checkpoint(model)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(1)
    return model, opt, torch.randint(0, PEAK_RAW["vocab_size"], (2, 512), generator=g)


def peak_worker(case: str) -> None:
    import torch
    import torch.distributed as dist

    from bench.studies.estimate_vs_probe_dist import optimizer_step, second_step_peak

    dist.init_process_group("gloo")
    st = _peak_strategy(case)
    model, opt, ids = build_case(case)
    measured = torch.tensor([second_step_peak(model, optimizer_step(model, opt, ids))])
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, measured)
    if dist.get_rank() == 0:
        from memfit.estimate import estimate
        from memfit.spec.hardware import parse_hardware
        from memfit.spec.model import model_from_config

        spec = model_from_config({"model_type": "llama", **PEAK_RAW}, name="tiny")
        predicted = estimate(spec, parse_hardware("2xCPU"), st).to_dict()["memory"]["gpu_allocated_bytes"]
        print("RESULT " + json.dumps({"case": case, "label": st.label(), "predicted": predicted,
                                      "measured": [int(x.item()) for x in gathered]}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def peak_main(cases: list[str], as_json: bool) -> int:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    rows = []
    for i, case in enumerate(cases):
        if case not in PEAK_CASES:
            print(f"unknown case {case!r}; choose from {', '.join(PEAK_CASES)}")
            return 2
        out = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", str(29670 + i), __file__,
                              "--peak-worker", case], capture_output=True, text=True, timeout=900, env=env,
                             cwd=ROOT)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            print(f"{case} failed (exit {out.returncode}): {out.stderr.strip()[-600:]}")
            return 1
        rows.append(json.loads(lines[0][7:]))
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'case':11} {'strategy':26} {'rank 0 MB':>10} {'rank 1 MB':>10} {'estimate MB':>11} {'error r0':>9} "
          f"{'error r1':>9}   (allocator peak per rank, 2 gloo processes)")
    for r in rows:
        m0, m1 = r["measured"]
        p = r["predicted"]
        print(f"{r['case']:11} {r['label']:26} {m0 / 1e6:10.2f} {m1 / 1e6:10.2f} {p / 1e6:11.2f} "
              f"{100 * (p / m0 - 1):+8.2f}% {100 * (p / m1 - 1):+8.2f}%")
    return 0


def main() -> None:
    if "--peak-worker" in sys.argv:
        peak_worker(sys.argv[sys.argv.index("--peak-worker") + 1])
        return
    if "--peak" in sys.argv:
        ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        ap.add_argument("--peak", action="store_true")
        ap.add_argument("--cases", default=",".join(DEFAULT_PEAK_CASES))
        ap.add_argument("--json", action="store_true")
        a = ap.parse_args()
        sys.exit(peak_main(a.cases.split(","), a.json))
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
                         "estimate_weights_plus_optimizer": _estimate(model_dir, [f"method={method}", *sets],
                                                                      args.steps),
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
