"""CLI commands for the train side: ``train`` and ``demo`` (registered by memfit.cli.app).

Thin: build the RunSpec, call memfit.train.api.train, format with memfit.cli.train_view. torch and
transformers are imported inside the commands only.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, List, Optional

import typer

from memfit.errors import ConfigError, MemfitError

SetOpt = typer.Option(None, "--set", help="Override a run-file key, e.g. --set lora.r=32 (repeatable).")
JsonOpt = typer.Option(False, "--json", help="Print the result as JSON only.")


def _run_training(run, *, resume: bool, as_json: bool, overwrite: bool = False, plan_why=()):
    from memfit.train.quiet import quiet_libraries

    quiet_libraries()
    from memfit.train.api import train
    from memfit.train.callbacks import RichProgress

    cbs = []
    if not as_json:
        from memfit.cli.output import console

        cbs.append(RichProgress(console=console))
    try:
        return train(run, callbacks=cbs, resume=resume, overwrite=overwrite,
                     **({"plan_why": list(plan_why)} if plan_why else {}))
    finally:
        for cb in cbs:
            cb.close()  # the bar's hidden cursor comes back after an error or Ctrl-C too


@contextmanager
def _saved(run) -> Iterator[Optional[Path]]:
    """A run built from flags, as a temporary run file for the launched processes (the output folder is
    not touched before the run itself checks it); None when ``run`` is None."""
    if run is None:
        yield None
        return
    import shutil
    import tempfile

    from memfit.spec.run import save_run

    tmp = Path(tempfile.mkdtemp(prefix="memfit-launch-"))
    try:
        yield save_run(run, tmp / "run.yaml")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _show(result, as_json: bool) -> None:
    if as_json:
        from memfit.cli.output import print_json

        print_json(result.to_dict() if hasattr(result, "to_dict") else result)
    else:
        from memfit.cli.train_view import print_summary

        print_summary(result)


def local_plan(model: str, seq_len: int, micro_batch_size: int, methods: Optional[list[str]] = None,
               sequences: Optional[int] = None, cpu_ram: Optional[str] = None):
    """The planner's Plan for this machine. ``sequences``: plan that many sequences per optimizer step
    (micro-batch × accumulation chosen too); ``cpu_ram``: the RAM budget to plan under."""
    from memfit.plan.batch import plan_batch
    from memfit.plan.search import plan
    from memfit.spec.hardware import parse_hardware
    from memfit.spec.model import resolve_model

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
    from memfit.plan.search import explain_plan

    if p.recommended is None:
        console.print("[yellow]plan: nothing fits this machine by the planner's estimate[/yellow]")
        return
    lines = explain_plan(p)
    console.rule("plan for this machine")
    for line in lines[:8]:
        console.print(line, highlight=False)
    console.rule()


def _auto_run(model: Optional[str], data: Optional[str], out: Optional[str], seq_len: int,
              micro_batch_size: int, methods: Optional[str], overrides: list[str], as_json: bool,
              sequences: Optional[int] = None, cpu_ram: Optional[str] = None):
    from memfit.spec.run import run_from_dict
    from memfit.train.data import check_data

    if not model:
        raise ConfigError("--auto needs --model DIR (a local model folder with weights, or a Hub id "
                          "owner/name)")
    data_spec = run_from_dict({"model": model, "hardware": "local", "data": {"path": data}}, overrides,
                              source="--auto").data
    check_data(data_spec)  # a bad line is refused before a plan is printed, not after
    p = local_plan(model, seq_len, micro_batch_size, methods.split(",") if methods else None,
                   sequences=sequences, cpu_ram=cpu_ram)
    if p.recommended is None:
        raise MemfitError(f"--auto: no strategy fits this machine for {model} at seq_len={seq_len}, "
                          f"micro_batch_size={micro_batch_size}; see `memfit plan --model {model} --gpus local`")
    if not as_json:
        print_plan(p)
    raw = {"model": model, "hardware": "local", "data": {"path": data}, "cpu_ram": cpu_ram,
           "strategy": p.recommended.strategy.model_dump(mode="json"),
           "output_dir": out or "runs/auto"}
    return run_from_dict(raw, overrides, source="--auto"), list(p.why)


def train_command(
    run_file: Optional[Path] = typer.Argument(None, help="Run file (YAML); not needed with --auto."),
    overrides: Optional[List[str]] = SetOpt,
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest complete checkpoint."),
    auto: bool = typer.Option(False, "--auto", help="Ask the planner for this machine, then train."),
    model: Optional[str] = typer.Option(None, "--model", help="With --auto: local model folder or Hub id "
                                         "owner/name[@revision]."),
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
    loss: Optional[str] = typer.Option(None, "--loss", help="standard | chunked (same as --set "
                                       "strategy.loss=...; chunked: no full [tokens, vocab] logits)."),
    fsdp_version: Optional[int] = typer.Option(None, "--fsdp-version", help="1 | 2: FSDP1 "
                                               "(FullyShardedDataParallel) or FSDP2 (fully_shard) for an FSDP "
                                               "run (same as --set strategy.fsdp_version=...)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the finished or checkpointed run "
                                   "in output_dir (its memfit files are removed first)."),
    as_json: bool = JsonOpt,
) -> None:
    """Fine-tune a model as a run file (or --auto) describes; writes adapter/model, metrics.jsonl, summary."""
    from memfit.cli.extras import require, require_for_runs
    from memfit.spec.run import load_run

    require("train", "train")
    overrides = list(overrides or []) + ([f"strategy.loss={loss}"] if loss is not None else []) + (
        [f"strategy.fsdp_version={fsdp_version}"] if fsdp_version is not None else [])
    if auto:
        if run_file is not None:
            raise ConfigError("give either a run file or --auto, not both")
        run, plan_why = _auto_run(model, data, out, seq_len, micro_batch_size, methods, overrides, as_json,
                                  sequences_per_step, cpu_ram)
        run_path = None
    else:
        if run_file is None:
            raise ConfigError("missing RUN_FILE: `memfit train run.yaml` (or --auto --model DIR --data FILE)")
        run = load_run(run_file, overrides)
        run_path = run_file
        plan_why = []
    require_for_runs("train", [run])
    d = run.distributed
    for flag, value in (("--nproc", nproc), ("--nodes", nodes)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: must be 1 or more (processes per node / nodes)")
    nproc = d.nproc if nproc is None else nproc
    nodes = d.nodes if nodes is None else nodes
    if (nproc > 1 or nodes > 1) and not fallback:
        from memfit.cli.launch_cmds import launch_reported

        with _saved(run if run_path is None else None) as saved:
            rc = launch_reported(str(saved or run_path), nproc=nproc, nodes=nodes,
                                 node_rank=d.node_rank if node_rank is None else node_rank,
                                 master_addr=master_addr or d.master_addr,
                                 master_port=d.master_port if master_port is None else master_port,
                                 overrides=overrides if saved is None else [], resume=resume,
                                 overwrite=overwrite)  # rank 0 prints progress and the summary
        raise typer.Exit(int(rc or 0))
    if fallback:
        from memfit.train.fallback import train_with_fallback

        run = _fallback_layout(run, nproc, nodes)

        result = train_with_fallback(run, run_path=str(run_path) if run_path else None, overrides=overrides,
                                     resume=resume)
    else:
        result = _run_training(run, resume=resume, as_json=as_json, overwrite=overwrite, plan_why=plan_why)
    _show(result, as_json)


def _fallback_layout(run, nproc: int, nodes: int):
    """``run`` with the processes ``--nproc`` asked for (each --fallback attempt starts them itself, on
    this node only)."""
    if nodes > 1:
        raise ConfigError(f"--fallback with {nodes} nodes: --fallback restarts the processes itself and runs "
                          "on one node; across nodes use `memfit launch RUN --nodes N --node-rank R` on each node")
    if nproc == run.distributed.nproc:
        return run
    from memfit.spec.run import run_from_dict

    raw = run.model_dump(mode="json")
    raw["distributed"]["nproc"] = nproc
    return run_from_dict(raw)


def _earlier_demo(out: Path, model_dir: Path) -> bool:
    """``out`` holds an earlier demo run (its run file trains the embedded model): replaced without asking."""
    from memfit.spec.run import load_run

    try:
        return Path(load_run(out / "run.yaml").model).resolve() == Path(model_dir).resolve()
    except (MemfitError, OSError):
        return False


def demo_command(
    out: Path = typer.Option(Path("runs/demo"), "--out", help="Folder for the adapter, metrics and run file."),
    overrides: Optional[List[str]] = SetOpt,
    nproc: Optional[int] = typer.Option(None, "--nproc", help="Processes on this node; >1 launches torchrun "
                                        "(e.g. --nproc 2 --set strategy.zero_stage=3)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace another run in --out (an earlier "
                                   "demo run there is always replaced)."),
    as_json: bool = JsonOpt,
) -> None:
    """The main job, offline: plan this machine, train the embedded tiny Llama on dialogue → summary data."""
    from memfit.cli.extras import require

    require("demo", "train")
    from memfit.cli.output import console, err_console
    from memfit.spec.run import run_from_dict

    from memfit.train.quiet import quiet_libraries

    quiet_libraries()
    from memfit.train.demo import demo_cache_dir, demo_run_dict, ensure_demo_assets

    status = err_console if as_json else console
    with status.status(f"preparing the embedded model and data in {demo_cache_dir()} ..."):
        model_dir, data_path = ensure_demo_assets()
    if nproc is not None:
        if nproc < 1:
            raise ConfigError(f"--nproc {nproc}: must be 1 or more (processes on this node)")
        overrides = [*(overrides or []), f"distributed.nproc={nproc}"]
    run = run_from_dict(demo_run_dict(model_dir, data_path, out), list(overrides or []), source="memfit demo")
    from memfit.train.outdir import check_path

    check_path(Path(run.output_dir))
    overwrite = overwrite or _earlier_demo(Path(run.output_dir), model_dir)
    from memfit.cli.hardware_cmds import refresh_local_profile
    from memfit.spec.hwprofile import WINDOW_SECONDS

    refresh_local_profile(WINDOW_SECONDS, say=lambda line: err_console.print(line, highlight=False))
    if not as_json:
        console.print(f"model [bold]{model_dir}[/bold] (tiny Llama, random init)  data [bold]{data_path}[/bold]")
        try:
            print_plan(local_plan(str(model_dir), run.strategy.seq_len, run.strategy.micro_batch_size))
        except MemfitError as err:
            console.print(f"[yellow]plan: {err}[/yellow]")
        console.print(f"training [bold]{run.strategy.label()}[/bold], {run.training.max_steps} steps, "
                      f"seq_len {run.strategy.seq_len}, micro-batch {run.strategy.micro_batch_size}")
    if run.distributed.nproc > 1:
        from memfit.cli.launch_cmds import launch_reported

        with _saved(run) as run_path:
            rc = launch_reported(str(run_path), nproc=run.distributed.nproc, overwrite=overwrite)
        raise typer.Exit(int(rc or 0))
    result = _run_training(run, resume=False, as_json=as_json, overwrite=overwrite)
    _show(result, as_json)
    if not as_json:
        console.print(f"run file: {Path(run.output_dir) / 'run.yaml'}  "
                      f"(rerun with `memfit train {Path(run.output_dir) / 'run.yaml'}`)")


def register(app: typer.Typer) -> None:
    """Add ``train`` and ``demo`` to ``app``."""
    app.command("train")(train_command)
    app.command("demo")(demo_command)
