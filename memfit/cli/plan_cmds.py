"""CLI commands for the plan side: ``estimate``, ``plan`` and ``matrix`` (registered by memfit.cli.app).

Thin: parse flags, call memfit.estimate / memfit.plan, format with memfit.cli.plan_view. No torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from memfit.cli import flags
from memfit.cli.flags import int_list, pattern, positive, str_list
from memfit.cli.phase_opts import EvalBatchOpt, EvalExamplesOpt, EvalLogitsOpt, SaveModeOpt, run_phases
from memfit.errors import ConfigError, IncompatibleError
from memfit.methods import METHODS
from memfit.spec import context

M = "Model and hardware"
S = "Strategy (one flag per key)"
P = "Search"
OUT = "Output"

ModelOpt = typer.Option(..., "--model", "-m", help="Preset name, model folder, config.json, or Hub id "
                        "owner/name[@revision] (config.json only, into the HF cache).", rich_help_panel=M)
GpusOpt = typer.Option(None, "--gpus", help="GPU pool, e.g. 8xV100-32GB, 2x8xA100-80GB, 2xRTX3090-24GB@pcie3x8 "
                       "(a PCIe link below x16), or 'local'.", rich_help_panel=M)
CpuRamOpt = typer.Option(None, "--cpu-ram", help="CPU RAM per node, e.g. 128GB (default: catalog/detected).",
                         rich_help_panel=M)
NodesOpt = typer.Option(None, "--nodes", help="Nodes of the pool (same as 2x8xGPU).", rich_help_panel=M)
MarginOpt = typer.Option(0.05, "--margin", help="Fraction of each GPU's memory kept free.", rich_help_panel=M)
ProfileOpt = typer.Option(None, "--profile", help="Calibrated constants (JSON from `memfit calibrate`).",
                          rich_help_panel=M)
JsonOpt = typer.Option(False, "--json", help="Print JSON only.", rich_help_panel=OUT)
RopeOpt = typer.Option(None, "--rope-scaling", help="The run file's rope_scaling, e.g. '{rope_type: yarn, factor: "
                       "4.0}': named in the note past a RoPE model's trained length (plan --emit writes it).",
                       rich_help_panel=M)


def _strategy_options() -> dict[str, Any]:
    return dict(
        method=typer.Option(None, "--method", help=" | ".join(METHODS), rich_help_panel=S),
        zero=typer.Option(None, "--zero", help="DeepSpeed ZeRO stage 0 (DDP) | 1 | 2 | 3", rich_help_panel=S),
        fsdp=typer.Option(None, "--fsdp", help="false | full_shard | shard_grad_op", rich_help_panel=S),
        fsdp_version=typer.Option(None, "--fsdp-version", help="1 (FullyShardedDataParallel, accelerate's "
                                  "FSDP plugin) | 2 (fully_shard; the default). plan: search only this "
                                  "version's FSDP (default: both)", rich_help_panel=S),
        fsdp_sync_each_batch=typer.Option(None, "--fsdp-sync-each-batch/--fsdp-no-sync", help="FSDP with "
                                          "--grad-accum > 1: reduce every micro-batch, gradients sharded (the "
                                          "default) or the HF Trainer's no_sync (whole gradients held).",
                                          rich_help_panel=S),
        offload=typer.Option(None, "--offload", help="none | optimizer | optimizer+params", rich_help_panel=S),
        gradient_checkpointing=typer.Option(None, "--gradient-checkpointing/--no-gradient-checkpointing",
                                            help="Recompute activations in backward.", rich_help_panel=S),
        hf_legacy_checkpoint=typer.Option(None, "--hf-legacy-checkpoint/--no-hf-legacy-checkpoint",
                                          help="With checkpointing: price transformers < 4.52's reentrant "
                                          "checkpoint around each decoder layer (planning another stack; memfit "
                                          "trains with its own).", rich_help_panel=S),
        attention=typer.Option(None, "--attention", help="eager | sdpa | fa2", rich_help_panel=S),
        optimizer=typer.Option(None, "--optimizer", help="adamw | adamw8bit | sgd", rich_help_panel=S),
        precision=typer.Option(None, "--precision", help="fp32 | fp16-mixed | bf16-mixed | bf16 "
                               "(default: bf16-mixed where supported, else fp16-mixed; fp32 on CPU)",
                               rich_help_panel=S),
        lora_r=typer.Option(None, "--lora-r", help="LoRA rank.", rich_help_panel=S),
        lora_alpha=typer.Option(None, "--lora-alpha", help="LoRA alpha.", rich_help_panel=S),
        lora_targets=typer.Option(None, "--lora-targets", help="Comma-separated module names "
                                  "(default: attention+MLP linears of the model).", rich_help_panel=S),
        quant_storage=typer.Option(None, "--quant-storage", help="QLoRA storage dtype uint8|bf16|fp16|fp32 "
                                   "(default: the parameter dtype under ZeRO-3/FSDP, else uint8).",
                                   rich_help_panel=S),
        meft_neurons=typer.Option(None, "--meft-neurons", help="MEFT key-value pairs per layer.", rich_help_panel=S),
        meft_top_k=typer.Option(None, "--meft-top-k", help="MEFT active neurons per token.", rich_help_panel=S),
        meft_experts=typer.Option(None, "--meft-experts", help="MEFT key experts: auto (~sqrt(neurons)) or a "
                                  "number.", rich_help_panel=S),
        lora_dropout=typer.Option(None, "--lora-dropout", help="LoRA dropout (0 saves the dropout copies).",
                                  rich_help_panel=S),
        double_quant=typer.Option(None, "--double-quant/--no-double-quant", help="QLoRA double quantisation.",
                                  rich_help_panel=S),
        lora_rslora=typer.Option(None, "--lora-rslora/--no-lora-rslora", help="rsLoRA scaling alpha/sqrt(r).",
                                 rich_help_panel=S),
        lora_modules_to_save=typer.Option(None, "--lora-modules-to-save", help="Modules trained whole beside "
                                          "LoRA, e.g. embed_tokens,lm_head.", rich_help_panel=S),
        lora_rank_pattern=typer.Option(None, "--lora-rank-pattern", help="Per-module ranks, e.g. q_proj=64,"
                                       "down_proj=8.", rich_help_panel=S),
        lora_alpha_pattern=typer.Option(None, "--lora-alpha-pattern", help="Per-module alphas, e.g. q_proj=128.",
                                        rich_help_panel=S),
        peft_config=typer.Option(None, "--peft-config", help="Any PEFT method: an adapter_config.json (or its "
                                 "folder); implies --method peft (PEFT counts the adapter; needs the train extra).",
                                 rich_help_panel=S),
        loss=typer.Option(None, "--loss", help="standard | chunked (output projection + cross-entropy over "
                          "token chunks, recomputed in backward: no full [tokens, vocab] logits).",
                          rich_help_panel=S),
        sequence_parallel=typer.Option(None, "--sequence-parallel", help="Ulysses: ranks sharing one sequence "
                                       "(DeepSpeed ZeRO; 1: off). plan: search only this degree.",
                                       rich_help_panel=S),
        context_parallel=typer.Option(None, "--context-parallel", help="torch context parallelism: ranks "
                                      "sharing one sequence (FSDP2, CUDA; 1: off). plan: search only this degree.",
                                      rich_help_panel=S),
        activation_offload=typer.Option(None, "--activation-offload", help="none | checkpointed (the "
                                        "checkpointed layers' inputs in CPU memory) | all (every saved tensor).",
                                        rich_help_panel=S),
        tiled_mlp=typer.Option(None, "--tiled-mlp/--no-tiled-mlp", help="DeepSpeed's TiledMLP: the MLP in "
                               "sequence tiles (ZeRO).", rich_help_panel=S),
        liger=typer.Option(None, "--liger/--no-liger", help="Liger Kernel (GPUs): its RMSNorm, fused gate "
                           "activation, RoPE and fused linear cross-entropy (so --loss chunked).", rich_help_panel=S),
        allocator=typer.Option(None, "--allocator", help="default | expandable_segments (the CUDA caching "
                               "allocator's mode; memfit train sets PYTORCH_CUDA_ALLOC_CONF): expandable "
                               "segments hold no cached working sets.", rich_help_panel=S),
    )


def _fixed_keys(**flags: Any) -> dict[str, Any]:
    """The strategy keys the user gave, in Strategy's names."""
    names = {"zero": "zero_stage"}
    keys: dict[str, Any] = {}
    for flag, value in flags.items():
        if value is None:
            continue
        key = names.get(flag, flag)
        if key == "fsdp":
            value = False if str(value).lower() in ("false", "no", "0", "none", "off") else value
        if key == "meft_experts" and str(value).isdigit():
            value = int(value)
        if key in ("lora_targets", "lora_modules_to_save"):
            value = tuple(t.strip() for t in value.split(",") if t.strip())
            if not value:
                raise ConfigError(f"--{key.replace('_', '-')}: give comma-separated module names, e.g. q_proj,v_proj")
        if key in ("lora_rank_pattern", "lora_alpha_pattern"):
            value = pattern(value, f"--{key.replace('_', '-')}")
        keys[key] = value
    if "peft_config" in keys:  # a PEFT config is read by method=peft only
        keys.setdefault("method", "peft")
    return keys


def _load(model: str, gpus: Optional[str], cpu_ram: Optional[str], nodes: Optional[int],
          profile: Optional[Path]) -> tuple[Any, Any, Any]:
    from memfit.spec.hardware import parse_hardware
    from memfit.spec.model import resolve_model

    if nodes is not None and nodes < 1:
        raise ConfigError(f"--nodes {nodes}: must be a positive integer")
    if gpus is not None and not gpus.strip():
        raise ConfigError("--gpus is empty; give a pool such as 8xA100-80GB or 2x8xV100-32GB, or local")
    spec = resolve_model(model)
    hw = parse_hardware(gpus or "local", cpu_ram=cpu_ram, nodes=nodes)
    from memfit.cli.hardware_cmds import with_local_rates

    return spec, with_local_rates(hw), _profile(profile)


def _profile(path: Optional[Path]) -> Any:
    if path is None:
        return None
    from memfit.estimate.constants import Profile

    return Profile.load(path)


def estimate_cmd(
    model: str = ModelOpt, gpus: Optional[str] = GpusOpt, cpu_ram: Optional[str] = CpuRamOpt,
    nodes: Optional[int] = NodesOpt,
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per sequence.", rich_help_panel=S),
    batch_size: int = typer.Option(1, "--batch-size", help="Micro-batch per GPU.", rich_help_panel=S),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Gradient accumulation steps.", rich_help_panel=S),
    activation_formula: Optional[str] = typer.Option(
        None, "--activation-formula", help="derived (default: from the model's real blocks) | korthikanti "
        "(GPT-style s·b·h·(34+5as/h), as arXiv 2406.02290 uses)", rich_help_panel=M),
    rope_scaling: Optional[str] = RopeOpt,
    margin: float = MarginOpt, profile: Optional[Path] = ProfileOpt, json_: bool = JsonOpt,
    eval_batch_size: Optional[int] = EvalBatchOpt, eval_keep_logits: bool = EvalLogitsOpt,
    eval_examples: Optional[int] = EvalExamplesOpt, save_mode: Optional[str] = SaveModeOpt,
    **strategy_flags: Any,
) -> None:
    """Estimate per-GPU memory, CPU RAM and step time of ONE combination."""
    from memfit.cli import plan_view
    from memfit.plan.single import estimate_one

    spec, hw, prof = _load(model, gpus, cpu_ram, nodes, profile)
    notes = context.notes(spec, seq_len, flags.rope_scaling(rope_scaling))  # RoPE past its trained length
    keys = _fixed_keys(**strategy_flags)
    keys.update(seq_len=seq_len, micro_batch_size=batch_size, grad_accum=grad_accum)
    result = estimate_one(spec, hw, keys, margin=margin, profile=prof, activation_formula=activation_formula,
                          phases=run_phases(eval_batch_size, eval_keep_logits, eval_examples, save_mode))
    if result.rule_reasons:
        raise IncompatibleError(" Also: ".join(result.rule_reasons))
    if json_:
        plan_view.print_json({**result.to_dict(), "notes": notes})
    else:
        plan_view.show_estimate(result, hw, notes)


def plan_cmd(
    model: str = ModelOpt, gpus: Optional[str] = GpusOpt, cpu_ram: Optional[str] = CpuRamOpt,
    nodes: Optional[int] = NodesOpt,
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per sequence.", rich_help_panel=S),
    batch_size: int = typer.Option(1, "--batch-size", help="Micro-batch per GPU.", rich_help_panel=S),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Gradient accumulation steps.", rich_help_panel=S),
    methods: Optional[str] = typer.Option(None, "--methods", help="Methods to search, e.g. full,lora "
                                          "(default: full,lora,qlora,meft).", rich_help_panel=P),
    zero_stages: Optional[str] = typer.Option(None, "--zero-stages", help="Only these DeepSpeed stages "
                                              "(0 = DDP), no FSDP, e.g. 2,3.", rich_help_panel=P),
    no_offload: bool = typer.Option(False, "--no-offload", help="Never offload to CPU.", rich_help_panel=P),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="Search the GPU count: one GPU kind, e.g. "
                                      "RTX3090-24GB (with --max-gpus).", rich_help_panel=P),
    max_gpus: int = typer.Option(8, "--max-gpus", help="Largest GPU count tried with --gpu.", rich_help_panel=P),
    gpu_hour_price: Optional[float] = typer.Option(None, "--gpu-hour-price", help="Price per GPU-hour.",
                                                   rich_help_panel=P),
    tokens: Optional[int] = typer.Option(None, "--tokens", help="Tokens to train on (total time and cost).",
                                         rich_help_panel=P),
    steps: Optional[int] = typer.Option(None, "--steps", help="Optimizer steps (for total time).",
                                        rich_help_panel=P),
    top: int = typer.Option(8, "--top", help="Candidates shown in the table.", rich_help_panel=OUT),
    emit: Optional[Path] = typer.Option(None, "--emit", help="Write run.yaml (+ deepspeed.json or "
                                        "accelerate.yaml) for the recommendation into this folder.",
                                        rich_help_panel=OUT),
    rope_scaling: Optional[str] = RopeOpt,
    margin: float = MarginOpt, profile: Optional[Path] = ProfileOpt, json_: bool = JsonOpt,
    eval_batch_size: Optional[int] = EvalBatchOpt, eval_keep_logits: bool = EvalLogitsOpt,
    eval_examples: Optional[int] = EvalExamplesOpt, save_mode: Optional[str] = SaveModeOpt,
    **strategy_flags: Any,
) -> None:
    """Try every combination of levers and recommend the fastest that fits (or search the GPU count)."""
    from memfit.cli import plan_view
    from memfit.plan.search import plan

    if gpu is not None and gpus is not None:
        raise ConfigError("--gpu (search the count) and --gpus (a fixed pool) both given; give one")
    fixed = _fixed_keys(**strategy_flags)
    scaling = flags.rope_scaling(rope_scaling)
    kwargs = dict(methods=str_list(methods), zero_stages=int_list(zero_stages, "--zero-stages"),
                  allow_offload=not no_offload, seq_len=seq_len, micro_batch_size=batch_size,
                  grad_accum=grad_accum, margin=margin, fixed=fixed,
                  phases=run_phases(eval_batch_size, eval_keep_logits, eval_examples, save_mode))
    if gpu is not None:
        from memfit.plan.gpu_count import gpu_count_search
        from memfit.spec.model import resolve_model

        spec = resolve_model(model)
        if context.refusal(spec, seq_len):  # the rules' _context holds at every count: refused once
            raise IncompatibleError(context.refusal(spec, seq_len))
        prof = _profile(profile)
        result = gpu_count_search(spec, gpu, max_gpus=max_gpus, cpu_ram=cpu_ram, price=gpu_hour_price,
                                  tokens=tokens, steps=steps, profile=prof, **kwargs)
        written = _emit(emit, result.best.recommended, spec, model, result.best.plan.hardware, cpu_ram, scaling) \
            if emit is not None and result.best is not None else []
        if json_:
            plan_view.print_json({**result.to_dict(), "emitted": [str(p) for p in written]})
        else:
            plan_view.show_gpu_count(result, written)
        return
    from memfit.plan.gpu_count import check_run_args, run_length

    check_run_args(tokens, steps, gpu_hour_price)
    spec, hw, prof = _load(model, gpus, cpu_ram, nodes, profile)
    result = plan(spec, hw, profile=prof, **kwargs)
    if scaling:  # the why's context note names the run's rope_scaling instead of the config's
        mine, config = context.notes(spec, seq_len, scaling), context.notes(spec, seq_len)
        result.why = [mine[0] if line in config else line for line in result.why]
    length = None
    if result.recommended is not None and (tokens or steps):
        length = run_length(result.recommended, hw.world_size, tokens=tokens, steps=steps, price=gpu_hour_price)
    if not result.candidates and all(r.kind == "rule" for r in result.rejected):
        raise IncompatibleError("no combination can run here: " + result.rejected[0].reasons[0])
    written = []
    if emit is not None:
        if result.recommended is None:
            raise ConfigError(f"--emit {emit}: nothing fits, so there is nothing to write; see `memfit plan` "
                              "without --emit for what is closest")
        written = _emit(emit, result.recommended, spec, model, hw, cpu_ram, scaling)
    if json_:
        out = result.to_dict()
        if written:
            out["emitted"] = [str(p) for p in written]
        if length:
            out["run"] = length
        plan_view.print_json(out)
    else:
        plan_view.show_plan(result, top=top, emitted=written, run=length)


def _emit(out: Path, est: Any, spec: Any, model_ref: str, hw: Any, cpu_ram: Optional[str],
          scaling: Optional[dict] = None) -> list[Path]:
    from memfit.distributed.emit import emit

    written = emit(out, est.strategy, model_ref=model_ref, hardware=hw, cpu_ram=cpu_ram)
    if scaling:  # run.yaml carries --rope-scaling as its rope_scaling
        from memfit.spec.run import load_run, save_run

        save_run(load_run(written[0]).model_copy(update={"rope_scaling": scaling}), written[0])
    return written


def matrix_cmd(
    gpus: str = typer.Option(..., "--gpus", help="GPU pool, e.g. 8xV100-32GB.", rich_help_panel=M),
    cpu_ram: Optional[str] = CpuRamOpt, nodes: Optional[int] = NodesOpt,
    models: Optional[str] = typer.Option(None, "--models", help="Comma-separated presets/folders/Hub ids "
                                         "(default: llama-2-7b,llama-2-13b,llama-2-70b,falcon-180b).",
                                         rich_help_panel=P),
    seq_lens: Optional[str] = typer.Option(None, "--seq-lens", help="Comma-separated sequence lengths "
                                           "(default: 256,512,1024,2048,4096).", rich_help_panel=P),
    methods: Optional[str] = typer.Option(None, "--methods", help="Methods to search (default: full,lora, "
                                          "the levers of arXiv 2406.02290).", rich_help_panel=P),
    param_offload: bool = typer.Option(False, "--param-offload", help="Also try parameter offload "
                                       "(ZeRO-Infinity / FSDP offload).", rich_help_panel=P),
    no_offload: bool = typer.Option(False, "--no-offload", help="Never offload to CPU.", rich_help_panel=P),
    with_fsdp: bool = typer.Option(False, "--fsdp", help="Also try FSDP (default: DDP and DeepSpeed ZeRO, as "
                                   "the study).", rich_help_panel=P),
    zero_stages: Optional[str] = typer.Option(None, "--zero-stages", help="DeepSpeed stages to try (0 = DDP), "
                                              "e.g. 2,3.", rich_help_panel=P),
    max_nodes: Optional[int] = typer.Option(None, "--max-nodes", help="Retry cells that fit nowhere on up to "
                                            "this many nodes.", rich_help_panel=P),
    batch_size: int = typer.Option(1, "--batch-size", help="Micro-batch per GPU.", rich_help_panel=S),
    lora_r: Optional[int] = typer.Option(None, "--lora-r", help="LoRA rank.", rich_help_panel=S),
    loss: Optional[str] = typer.Option(None, "--loss", help="Hold the loss: standard | chunked (default: "
                                       "search both).", rich_help_panel=S),
    png: Optional[Path] = typer.Option(None, "--png", help="Also draw the matrix into this image file.",
                                       rich_help_panel=OUT),
    margin: float = MarginOpt, profile: Optional[Path] = ProfileOpt, json_: bool = JsonOpt,
) -> None:
    """Model size × context length table of the fastest recipe that fits (like arXiv 2406.02290 Fig. 4)."""
    from memfit.cli import plan_view
    from memfit.cli.extras import require
    from memfit.plan.matrix import DEFAULT_MODELS, DEFAULT_SEQ_LENS, STUDY_METHODS, STUDY_ZERO_STAGES, matrix
    from memfit.spec.hardware import parse_hardware

    from memfit.cli.hardware_cmds import with_local_rates

    hw = with_local_rates(parse_hardware(gpus, cpu_ram=cpu_ram, nodes=nodes))
    prof = _profile(profile)
    offloads = ("none",) if no_offload else ("none", "optimizer", "optimizer+params") if param_offload \
        else ("none", "optimizer")
    lens = int_list(seq_lens, "--seq-lens") or list(DEFAULT_SEQ_LENS)
    for s in lens:
        positive("--seq-lens", s)
    fixed = {k: v for k, v in (("lora_r", lora_r), ("loss", loss)) if v is not None} or None
    if png is not None:
        require("matrix --png", "plot")
    with plan_view.progress("planning the matrix", quiet=json_):
        m = matrix(hw, str_list(models) or DEFAULT_MODELS, lens,
                   methods=str_list(methods) or STUDY_METHODS, offloads=offloads,
                   zero_stages=None if with_fsdp and zero_stages is None
                   else int_list(zero_stages, "--zero-stages") or STUDY_ZERO_STAGES,
                   micro_batch_size=positive("--batch-size", batch_size), margin=margin, profile=prof,
                   fixed=fixed, max_nodes=max_nodes)
    written = None
    if png is not None:
        from memfit.plan.picture import draw

        written = draw(m, png)
    if json_:
        out = m.to_dict()
        if written:
            out["png"] = str(written)
        plan_view.print_json(out)
    else:
        plan_view.show_matrix(m, png=written)


def _with_strategy_flags(fn: Any) -> Any:
    """Append the strategy flags to ``fn``'s signature (typer reads the signature)."""
    import inspect

    sig = inspect.signature(fn, eval_str=True)
    kinds = {"zero": int, "fsdp_version": int, "lora_r": int, "lora_alpha": int, "meft_neurons": int,
             "meft_top_k": int, "lora_dropout": float, "gradient_checkpointing": bool, "double_quant": bool,
             "lora_rslora": bool, "fsdp_sync_each_batch": bool, "hf_legacy_checkpoint": bool, "sequence_parallel": int,
             "context_parallel": int, "tiled_mlp": bool, "liger": bool}
    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt,
                               annotation=Optional[kinds.get(name, str)])
             for name, opt in _strategy_options().items()]
    params = [p for p in sig.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params] + extra

    def wrapper(**kwargs: Any) -> None:
        fn(**kwargs)

    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    wrapper.__doc__ = fn.__doc__
    wrapper.__name__ = fn.__name__
    return wrapper


def register(app: typer.Typer) -> None:
    """Add ``estimate``, ``plan`` and ``matrix`` to ``app``."""
    app.command("estimate")(_with_strategy_flags(estimate_cmd))
    app.command("plan")(_with_strategy_flags(plan_cmd))
    app.command("matrix")(matrix_cmd)
