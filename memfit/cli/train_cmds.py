"""CLI commands for the train side: ``train`` and ``demo`` (registered by memfit.cli.app).

Thin: build the RunSpec, call memfit.train.api.train, format with memfit.cli.train_view. torch and
transformers are imported inside the commands only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

from memfit.errors import ConfigError, MemfitError

SetOpt = typer.Option(None, "--set", help="Override a run-file key, e.g. --set lora.r=32 (repeatable).")
JsonOpt = typer.Option(False, "--json", help="Print the result as JSON only.")


def _optional(module: str, attr: str, what: str) -> Any:
    """An attribute of another memfit module that may not exist yet, or a clear MemfitError."""
    import importlib

    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        raise MemfitError(f"{what} is not available in this memfit ({module}.{attr} is missing)") from None


def _run_training(run, *, resume: bool, as_json: bool, callbacks: list | None = None):
    from memfit.train.quiet import quiet_libraries

    quiet_libraries()
    from memfit.train.api import train
    from memfit.train.callbacks import RichProgress

    cbs = list(callbacks or [])
    if not as_json:
        from memfit.cli.output import console

        cbs.append(RichProgress(console=console))
    return train(run, callbacks=cbs, resume=resume)


def _show(result, as_json: bool) -> None:
    if as_json:
        from memfit.cli.output import print_json

        print_json(result.to_dict() if hasattr(result, "to_dict") else result)
    else:
        from memfit.cli.train_view import print_summary

        print_summary(result)


def local_plan(model: str, seq_len: int, micro_batch_size: int, methods: Optional[list[str]] = None,
               sequences: Optional[int] = None, cpu_ram: Optional[str] = None):
    """The planner's Plan for this machine, or None while memfit.plan is not there. ``sequences``: plan
    that many sequences per optimizer step (micro-batch × accumulation chosen too); ``cpu_ram``: the RAM
    budget to plan under."""
    try:
        from memfit.plan.batch import plan_batch
        from memfit.plan.search import plan
        from memfit.spec.hardware import parse_hardware
        from memfit.spec.model import resolve_model
    except ImportError:
        return None
    kwargs: dict[str, Any] = dict(seq_len=seq_len)
    if methods:
        kwargs["methods"] = methods
    from memfit.cli.hardware_cmds import with_local_rates

    hw = with_local_rates(parse_hardware("local", cpu_ram=cpu_ram))
    if sequences:
        return plan_batch(resolve_model(model), hw, sequences=sequences, **kwargs)
    return plan(resolve_model(model), hw, micro_batch_size=micro_batch_size, **kwargs)


def print_plan(p) -> None:
    from memfit.cli.output import console

    if p is None:
        console.print("[dim]plan: the planner is not available in this memfit; training as configured[/dim]")
        return
    rec = getattr(p, "recommended", None)
    if rec is None:
        console.print("[yellow]plan: nothing fits this machine by the planner's estimate[/yellow]")
        return
    try:
        from memfit.plan.search import explain_plan

        lines = explain_plan(p)
    except (ImportError, Exception):  # the explanation is a nicety; never fail training on it
        lines = [f"recommended: {rec.strategy.label()}"]
    console.rule("plan for this machine")
    for line in lines[:8]:
        console.print(line, highlight=False)
    console.rule()


def _auto_run(model: Optional[str], data: Optional[str], out: Optional[str], seq_len: int,
              micro_batch_size: int, methods: Optional[str], overrides: list[str], as_json: bool,
              sequences: Optional[int] = None, cpu_ram: Optional[str] = None):
    from memfit.spec.run import run_from_dict

    if not model:
        raise ConfigError("--auto needs --model DIR (a local model folder with weights)")
    p = local_plan(model, seq_len, micro_batch_size, methods.split(",") if methods else None,
                   sequences=sequences, cpu_ram=cpu_ram)
    if p is None:
        raise MemfitError("--auto needs the planner (memfit.plan), which is not available in this memfit; "
                          "write a run file instead")
    if getattr(p, "recommended", None) is None:
        raise MemfitError(f"--auto: no strategy fits this machine for {model} at seq_len={seq_len}, "
                          f"micro_batch_size={micro_batch_size}; see `memfit plan --model {model} --gpus local`")
    if not as_json:
        print_plan(p)
    raw = {"model": model, "hardware": "local", "data": {"path": data}, "cpu_ram": cpu_ram,
           "strategy": p.recommended.strategy.model_dump(mode="json"),
           "output_dir": out or "runs/auto"}
    return run_from_dict(raw, overrides, source="--auto")


def train_command(
    run_file: Optional[Path] = typer.Argument(None, help="Run file (YAML); not needed with --auto."),
    overrides: Optional[List[str]] = SetOpt,
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest complete checkpoint."),
    auto: bool = typer.Option(False, "--auto", help="Ask the planner for this machine, then train."),
    model: Optional[str] = typer.Option(None, "--model", help="With --auto: local model folder."),
    data: Optional[str] = typer.Option(None, "--data", help="With --auto: JSONL file or datasets folder."),
    out: Optional[str] = typer.Option(None, "--out", help="With --auto: output folder (default runs/auto)."),
    seq_len: int = typer.Option(512, "--seq-len", help="With --auto: sequence length to plan for."),
    micro_batch_size: int = typer.Option(1, "--micro-batch-size", help="With --auto: micro-batch to plan for."),
    methods: Optional[str] = typer.Option(None, "--methods", help="With --auto: e.g. lora,qlora."),
    sequences_per_step: Optional[int] = typer.Option(None, "--sequences-per-step", help="With --auto: "
                                                     "sequences per optimizer step; the planner also picks "
                                                     "micro-batch x accumulation."),
    cpu_ram: Optional[str] = typer.Option(None, "--cpu-ram", help="With --auto: the RAM budget to plan "
                                          "under, e.g. 4GB (default: this machine's RAM)."),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="Processes on this node; >1 launches torchrun "
                                        "(default: the run file's distributed.nproc, else 1)."),
    nodes: Optional[int] = typer.Option(None, "--nodes", help="Nodes (default: distributed.nodes)."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="This node's rank (multi-node)."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="Rank-0 node address (multi-node)."),
    master_port: Optional[int] = typer.Option(None, "--master-port", help="Rendezvous port."),
    fallback: bool = typer.Option(False, "--fallback", help="On out-of-memory, retry with the next plan."),
    as_json: bool = JsonOpt,
) -> None:
    """Fine-tune a model as a run file (or --auto) describes; writes adapter/model, metrics.jsonl, summary."""
    from memfit.spec.run import load_run

    overrides = list(overrides or [])
    if auto:
        if run_file is not None:
            raise ConfigError("give either a run file or --auto, not both")
        run = _auto_run(model, data, out, seq_len, micro_batch_size, methods, overrides, as_json,
                        sequences_per_step, cpu_ram)
        run_path = None
    else:
        if run_file is None:
            raise ConfigError("missing RUN_FILE: `memfit train run.yaml` (or --auto --model DIR --data FILE)")
        run = load_run(run_file, overrides)
        run_path = run_file
    d = run.distributed
    nproc, nodes = nproc or d.nproc, nodes or d.nodes
    if (nproc > 1 or nodes > 1) and not fallback:
        if run_path is None:
            from memfit.spec.run import save_run

            run_path = save_run(run, Path(run.output_dir) / "run.yaml")
            overrides = []
        launch = _optional("memfit.distributed.launch", "launch", "multi-process training (--nproc)")
        rc = launch(str(run_path), nproc=nproc, nodes=nodes,
                    node_rank=d.node_rank if node_rank is None else node_rank,
                    master_addr=master_addr or d.master_addr, master_port=master_port or d.master_port,
                    overrides=overrides, resume=resume)  # rank 0 prints progress and the summary
        raise typer.Exit(int(rc or 0))
    if fallback:
        fn = _optional("memfit.measure.fallback", "train_with_fallback", "--fallback")
        result = fn(run, run_path=str(run_path) if run_path else None, overrides=overrides, resume=resume)
    else:
        result = _run_training(run, resume=resume, as_json=as_json)
    _show(result, as_json)


def demo_command(
    out: Path = typer.Option(Path("runs/demo"), "--out", help="Folder for the adapter, metrics and run file."),
    overrides: Optional[List[str]] = SetOpt,
    as_json: bool = JsonOpt,
) -> None:
    """The main job, offline: plan this machine, train the embedded tiny Llama on dialogue → summary data."""
    from memfit.cli.output import console, err_console
    from memfit.spec.run import run_from_dict

    from memfit.train.quiet import quiet_libraries

    quiet_libraries()
    from memfit.train.demo import demo_cache_dir, demo_run_dict, ensure_demo_assets

    status = err_console if as_json else console
    with status.status(f"preparing the embedded model and data in {demo_cache_dir()} ..."):
        model_dir, data_path = ensure_demo_assets()
    run = run_from_dict(demo_run_dict(model_dir, data_path, out), list(overrides or []), source="memfit demo")
    if not as_json:
        console.print(f"model [bold]{model_dir}[/bold] (tiny Llama, random init)  data [bold]{data_path}[/bold]")
        try:
            print_plan(local_plan(str(model_dir), run.strategy.seq_len, run.strategy.micro_batch_size))
        except MemfitError as err:
            console.print(f"[yellow]plan: {err}[/yellow]")
        console.print(f"training [bold]{run.strategy.label()}[/bold], {run.training.max_steps} steps, "
                      f"seq_len {run.strategy.seq_len}, micro-batch {run.strategy.micro_batch_size}")
    result = _run_training(run, resume=False, as_json=as_json)
    _show(result, as_json)
    if not as_json:
        console.print(f"run file: {Path(run.output_dir) / 'run.yaml'}  "
                      f"(rerun with `memfit train {Path(run.output_dir) / 'run.yaml'}`)")


def register(app: typer.Typer) -> None:
    """Add ``train`` and ``demo`` to ``app``."""
    app.command("train")(train_command)
    app.command("demo")(demo_command)
