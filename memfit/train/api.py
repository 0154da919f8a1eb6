"""``train(run)``: the library entry point behind ``memfit train``, ``memfit demo`` and ``python -m memfit.train``."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional, Sequence

from memfit.distributed import engines
from memfit.distributed.faults import where
from memfit.distributed.ranks import gather_layout, layout_line, rank_info, set_collective_timeout
from memfit.distributed.watch import watch_job
from memfit.errors import IncompatibleError, MemfitError, TrainingInterrupted
from memfit.io import atomic_dir, write_json, write_text

SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"


@dataclass
class TrainResult:
    output_dir: str
    saved_to: Optional[str]            # adapter folder (lora/qlora), model folder (full) or MEFT file
    method: str
    steps: int
    first_loss: Optional[float]
    final_loss: Optional[float]
    eval_loss: Optional[float]
    losses: list[tuple[int, float]]
    step_time_s: Optional[float]       # median wall time of an optimizer step (first step left out)
    tokens_per_s: Optional[float]
    train_tokens: int
    peak_mem_bytes: int
    peak_mem_kind: str                 # cuda_max_allocated | peak_rss
    train_runtime_s: float
    resumed_from: Optional[str]
    metrics_file: str
    data: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    predicted: Optional[dict] = None   # the estimate for this run's strategy, where memfit.estimate exists
    predicted_step: Optional[dict] = None  # the step time at the padded shapes it trained (train.shapes)
    notes: list[str] = field(default_factory=list)
    report: Optional[str] = None       # report.html (memfit.train.report), where the [plot] extra is installed
    plan_why: list[str] = field(default_factory=list)  # the planner's reasons, where it chose (train --auto)
    ranks: list[dict] = field(default_factory=list)  # every process: rank, node_rank, local_rank, host

    def to_dict(self) -> dict:
        return asdict(self)


def predict(run) -> Optional[dict]:
    """The planner's estimate for this run as launched (its hardware, ``nproc`` × ``nodes`` processes);
    None when the model cannot be read as a spec."""
    from memfit.resolve import predict as estimate_run

    try:
        return estimate_run(run).to_dict()
    except MemfitError:
        return None


def all_ranks(batches: list) -> list:
    """Every process's per-step batch shapes, rank 0 first (one object gather, after training)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [batches]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, batches)
    return out


def preflight(run) -> list[str]:
    """Reasons this launch cannot run the strategy (:func:`memfit.distributed.preflight.reasons`)."""
    from memfit.distributed.preflight import reasons  # rules + world size, engines, offload RAM

    if run.strategy.attention == "fa2":  # training falls back to sdpa with a note where FA2 cannot run
        run = run.model_copy(update={"strategy": run.strategy.model_copy(update={"attention": "sdpa"})})
    return reasons(run)


def phases_note(run) -> str:
    """The summary's line on the run phases as run (the estimate priced the same: memfit.spec.phases)."""
    from memfit.spec.phases import save_mode

    return (f"run phases: evaluation batch {run.eval.batch_size or run.strategy.micro_batch_size}, loss only "
            f"(no compute_metrics); final save {save_mode(run.strategy, run.save.mode)}; checkpoints "
            f"{'sharded' if run.strategy.fsdp or run.strategy.zero_stage else 'whole'}")


def cpu_threads() -> Optional[int]:
    """On CPU, unless OMP_NUM_THREADS is set: use the cores other processes leave idle (1-minute load
    average). Oversubscribed OpenMP threads spin against each other and can make a step 10x slower.
    Processes memfit starts (its launcher, ``memfit measure``) get OMP_NUM_THREADS, the count their
    prediction is made at, so this applies to an in-process ``memfit train`` alone, whose own prediction
    reads torch's thread count after it (memfit.spec.threads.run_threads)."""
    import torch

    from memfit.spec.threads import ENV, idle_cores

    if torch.cuda.is_available() or ENV in os.environ or not hasattr(os, "getloadavg"):
        return None
    n = idle_cores(limit=torch.get_num_threads())
    torch.set_num_threads(n)
    return n


def trim_metrics(path: Path, last_step: int) -> None:
    """On resume, drop the lines an interrupted run logged after its checkpoint (they are redone)."""
    keep = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line).get("step", 0)) <= last_step:
                keep.append(line)
        except (ValueError, AttributeError):
            continue
    write_text(path, "".join(x + "\n" for x in keep), "metrics")


def save_outputs(run, model, tokenizer, out: Path, state_dict: Optional[dict] = None,
                 adapter_only: bool = False) -> Path:
    """The method's result (adapter, full model or MEFT file) in ``out/<method.output>``, atomically.
    ``state_dict``: the engine's gathered weights (ZeRO / FSDP), else the model's own; ``adapter_only``: FSDP's
    gathered adapter alone (memfit.train.adapter_save: PEFT cannot name FSDP1's nested units)."""
    from memfit.methods import for_strategy

    method = for_strategy(run.strategy)
    if state_dict is not None:
        state_dict = {k: v.detach().cpu() for k, v in state_dict.items()}
    dst = out / method.output
    with atomic_dir(dst) as tmp:
        if adapter_only:
            from memfit.train.adapter_save import save_gathered_adapter

            save_gathered_adapter(model, tokenizer, tmp, state_dict)
        else:
            method.save(model, tokenizer, tmp, state_dict)
    return dst


def train(run, *, callbacks: Sequence = (), resume: bool = False, overwrite: bool = False,
          data: Optional[tuple] = None, plan_why: Sequence[str] = ()) -> TrainResult:
    """Train ``run`` (a RunSpec) in this process; rank 0 writes metrics, checkpoints' trainer state and
    the final adapter/model. Extra ``transformers.TrainerCallback``s (e.g. a memory probe) are attached.
    ``data`` = (train_ds, eval_ds, DataReport) of token ids replaces ``run.data`` and the tokenizer
    (``memfit measure`` feeds exact shapes that way). The output folder is checked and held first
    (memfit.train.outdir): a finished run is not replaced without ``overwrite``, two runs never write
    into one folder, and a refused run leaves nothing behind. ``plan_why``: the planner's sentences for
    choosing this strategy (``train --auto``), kept in the summary and the report."""
    from memfit.train import outdir
    from memfit.train.checkpoint import checkpoints, latest_checkpoint

    main = rank_info()[0] == 0
    out = Path(run.output_dir).expanduser()
    outdir.check_path(out)
    finished = outdir.check_reuse(out, run, resume=resume, overwrite=overwrite,
                                  has_checkpoints=bool(checkpoints(out)))
    if finished is not None:
        return _already_finished(finished, out, run)
    reasons = preflight(run)
    if reasons:
        raise IncompatibleError(f"strategy {run.strategy.label()} cannot run on this machine: "
                                + "; ".join(reasons))
    ckpt = latest_checkpoint(out) if resume else None
    lock = outdir.OutputLock(out).acquire() if main else None
    state: dict = {"trainer": None, "started": False, "plan_why": [str(x) for x in plan_why]}
    try:
        return _train(run, out, ckpt, callbacks, overwrite, data, state)
    except KeyboardInterrupt:
        raise TrainingInterrupted(_interrupted_line(run, out, state)) from None
    except BaseException:
        if lock is not None:
            lock.release(refused=not state["started"])
        raise
    finally:
        if lock is not None:
            lock.release()


def _already_finished(summary: dict, out: Path, run) -> TrainResult:
    from dataclasses import MISSING

    def value(f):  # a summary from another memfit version may lack a field
        if f.name in summary:
            return summary[f.name]
        return f.default_factory() if f.default_factory is not MISSING else \
            (None if f.default is MISSING else f.default)

    result = TrainResult(**{f.name: value(f) for f in fields(TrainResult)})
    result.notes = list(result.notes or [])
    result.notes = [*result.notes, f"--resume: the run in {out} already finished at step {result.steps} "
                    f"(max_steps={run.training.max_steps}); nothing trained, nothing written"]
    return result


def _interrupted_line(run, out: Path, state: dict) -> str:
    from memfit.train.checkpoint import checkpoints

    trainer = state.get("trainer")
    step = trainer.state.global_step if trainer is not None else 0
    found = checkpoints(out) if out.is_dir() else []
    if found:
        return (f"interrupted at step {step}; last checkpoint {found[-1]}; resume with "
                f"`memfit train {out / 'run.yaml'} --resume`")
    return (f"interrupted at step {step}; no checkpoint was written (training.checkpoint_interval="
            f"{run.training.checkpoint_interval}); start again with --overwrite")


def _train(run, out: Path, ckpt: Optional[Path], callbacks: Sequence, overwrite: bool,
           data: Optional[tuple], state: dict) -> TrainResult:
    from transformers import set_seed

    from memfit.spec.run import save_run
    from memfit.methods import for_strategy
    from memfit.train.callbacks import MetricsWriter, StepStats
    from memfit.train.checkpoint import clean_staging, prepare_folders
    from memfit.train.data import prepare_datasets
    from memfit.train.allocator import apply_allocator
    from memfit.train.model import build_model
    from memfit.train.trainer import build_trainer

    rank, local_rank, world = rank_info()
    main = rank == 0
    if main:
        clean_staging(out)
    set_seed(run.training.seed)
    from memfit.distributed.engines.fsdp import with_launcher_version

    run = with_launcher_version(run)  # `accelerate launch --config_file`: the FSDP version the file names
    engine = engines.for_run(run)
    allocator_note = apply_allocator(run.strategy)  # before CUDA allocates (the process group's NCCL too)
    engine.join(run)  # DeepSpeed / FSDP: process group, ZeRO-3 partitioned loading (nothing for DDP)
    threads = cpu_threads()
    model, tokenizer, info = build_model(run, local_rank=local_rank, engine=engine, tokenizer=data is None)
    from memfit.train.longctx import install, offload_callback

    levers = install(run, model)  # activation offload, tiled MLP (sequence / context parallelism: the engine's)
    info.notes.extend(levers.notes)
    info.notes += [n for n in (allocator_note, phases_note(run)) if n]
    if threads is not None:
        info.notes.append(f"CPU threads: {threads} (idle cores by the load average; set OMP_NUM_THREADS "
                          "to choose)")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    train_ds, eval_ds, report = data if data is not None else prepare_datasets(
        run, tokenizer, info.max_positions, vocab if isinstance(vocab, int) else None)
    if not run.eval.enabled:  # eval.enabled: false, as the estimate prices it: no evaluation phase
        eval_ds = None
    stats = StepStats()
    cbs: list = [stats]
    if run.strategy.activation_offload != "none":
        cbs.append(offload_callback(levers))  # before the writer: act_offload_bytes on each train log line
    metrics_path = out / METRICS_FILE
    method = for_strategy(run.strategy)
    optimizer = method.optimizer(model, run.training)  # None: the Trainer's own (MEFT: its CPU AdamW)
    cbs.extend(method.callbacks(model))  # before the writer: they add to each log line
    if main:
        if overwrite:
            from memfit.train.outdir import clear_previous

            clear_previous(out)
        if ckpt is None and metrics_path.exists():
            metrics_path.unlink()
        elif ckpt is not None and metrics_path.exists():
            trim_metrics(metrics_path, int(ckpt.name.rsplit("-", 1)[-1]))
        cbs.append(MetricsWriter(metrics_path))
    cbs.extend(callbacks)
    trainer = build_trainer(run, engine, model, tokenizer, train_ds, eval_ds, out, callbacks=cbs, optimizer=optimizer)
    trainer.step_context = levers.step_context
    state["trainer"] = trainer
    set_collective_timeout(run.distributed.timeout_s)  # a dead or hung peer ends every rank in bounded time
    watch_job(where())  # across nodes too: a rank still alive after the job ended elsewhere ends
    agreed = prepare_folders(trainer, run, out, ckpt)  # one folder or one per node (collective)
    if main and agreed != ckpt and metrics_path.exists():
        trim_metrics(metrics_path, int(agreed.name.rsplit("-", 1)[-1]))
    ckpt = agreed
    if main:
        save_run(run, out / "run.yaml")
    state["started"] = True
    output = trainer.train(resume_from_checkpoint=str(ckpt) if ckpt else None)
    eval_loss = None
    if eval_ds is not None:  # the final evaluation, unless the schedule just did it
        done = [h for h in trainer.state.log_history
                if "eval_loss" in h and h.get("step") == trainer.state.global_step]
        eval_loss = float(done[-1]["eval_loss"] if done else trainer.evaluate()["eval_loss"])
    saved = _save_final(run, trainer, engine, tokenizer, out)
    ranks = all_ranks(stats.batches)
    result = _result(run, out, trainer, output, stats, report, info, eval_loss, saved, ckpt, main)
    result.ranks = gather_layout()
    if len(result.ranks) > 1:
        result.notes.append(layout_line(result.ranks))
    if main and result.predicted:
        from memfit.train.shapes import predict_as_ran

        result.predicted_step = predict_as_ran(run, ranks, result.predicted)
    result.plan_why = list(state.get("plan_why") or [])
    if main:
        if data is None:  # the report first (it never raises), so the summary says where it is or how to
            from memfit.train.report import report_after_training  # make it; none for measure's probes

            result.report, note = report_after_training(out, json.loads(json.dumps(result.to_dict(), default=str)))
            if note:
                result.notes.append(note)
        write_json(out / SUMMARY_FILE, result.to_dict(), "summary", default=str)
    return result


def _save_final(run, trainer, engine, tokenizer, out: Path) -> Optional[Path]:
    """The trained adapter/model; on a write failure the line says which checkpoint is still there."""
    from memfit.io import WriteError
    from memfit.train.checkpoint import checkpoints

    try:
        # ZeRO-3 / FSDP: every rank joins the gather of the sharded weights, rank 0 writes; FSDP with save.mode
        # sharded: every rank writes its shards, adapter: only the trained parameters gathered (#39)
        from memfit.spec.phases import save_mode

        mode = save_mode(run.strategy, run.save.mode)
        if run.strategy.fsdp and mode == "sharded":
            saved = engine.save_sharded(trainer, out)
            engine.barrier()
            return saved
        adapter_only = bool(run.strategy.fsdp) and mode == "adapter"
        if adapter_only:
            state_dict = engine.adapter_state_dict(trainer, run)
        else:
            state_dict = engine.gathered_state_dict(trainer, run)
        saved = None
        if trainer.is_world_process_zero():
            saved = save_outputs(run, trainer.accelerator.unwrap_model(trainer.model), tokenizer, out,
                                 state_dict, adapter_only)
        engine.barrier()
        return saved
    except WriteError as err:
        found = checkpoints(out)
        kept = (f"the last checkpoint {found[-1]} is kept (resume from it with --resume after freeing space)"
                if found else "no checkpoint was written (set training.checkpoint_interval to keep some)")
        raise WriteError(f"{err}; the trained weights of step {trainer.state.global_step} were not saved; "
                         f"{kept}") from None


def _result(run, out, trainer, output, stats, report, info, eval_loss, saved, ckpt, main) -> TrainResult:
    from memfit.train.callbacks import peak_memory_bytes

    peak, kind = peak_memory_bytes()
    losses = stats.losses
    seen = trainer.state.num_input_tokens_seen
    notes = list(info.notes)
    if report.truncated or report.dropped:
        notes.append(f"{report.truncated} of {report.examples} examples were longer than seq_len="
                     f"{run.strategy.seq_len}: {report.tokens_cut} tokens cut; {report.dropped} dropped "
                     "with nothing left to learn")
    if report.extra.get("empty"):
        notes.append(f"{report.extra['empty']} of {report.examples} examples were empty (skipped)")
    return TrainResult(
        output_dir=str(out), saved_to=str(saved) if saved else None, method=run.strategy.method,
        steps=trainer.state.global_step,
        first_loss=losses[0][1] if losses else None, final_loss=losses[-1][1] if losses else None,
        eval_loss=eval_loss, losses=losses, step_time_s=stats.median_step_time(),
        tokens_per_s=stats.tokens_per_s(seen - (getattr(trainer, "_initial_num_input_tokens_seen", 0) or 0)),
        train_tokens=report.train_tokens, peak_mem_bytes=peak, peak_mem_kind=kind,
        train_runtime_s=float(output.metrics.get("train_runtime", 0.0)),
        resumed_from=str(ckpt) if ckpt else None, metrics_file=str(out / METRICS_FILE),
        data=report.to_dict(), model=info.to_dict(), predicted=predict(run) if main else None, notes=notes,
    )
