"""``memfit launch``: one command per node starts that node's training processes (torchrun)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer


def launch_command(
    run_file: Path = typer.Argument(..., help="Run file (YAML)."),
    nproc: Optional[int] = typer.Option(None, "--nproc",
                                        help="Processes (GPUs) on this node (default: run file's distributed.nproc)."),
    nodes: Optional[int] = typer.Option(None, "--nodes", help="Nodes in the job (default: distributed.nodes)."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank",
                                            help="This node's rank, 0..nodes-1 (default: distributed.node_rank)."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr",
                                              help="Node 0's address (default: distributed.master_addr)."),
    master_port: Optional[int] = typer.Option(None, "--master-port",
                                              help="Free TCP port on node 0 (default: distributed.master_port, else a "
                                              "free port on one node, 29500 across nodes)."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help="KEY=VALUE override (repeatable)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest complete checkpoint."),
    single_host: bool = typer.Option(False, "--single-host",
                                     help="Every node rank runs on this machine (test a multi-node config on one "
                                     "host; allows --master-addr 127.0.0.1)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the command and the engine config; start nothing."),
    as_json: bool = typer.Option(False, "--json", help="With --dry-run: print JSON."),
) -> None:
    """Train RUN on this node's processes; run the same command on every node with its --node-rank."""
    from memfit.distributed.config import world_size
    from memfit.distributed.launch import launch_command as build, layout_overrides, rendezvous_port
    from memfit.spec.run import load_run

    overrides = list(overrides or [])
    d = load_run(run_file, overrides).distributed
    layout = dict(nproc=d.nproc if nproc is None else nproc, nodes=d.nodes if nodes is None else nodes,
                  node_rank=d.node_rank if node_rank is None else node_rank,
                  master_addr=d.master_addr if master_addr is None else master_addr,
                  master_port=d.master_port if master_port is None else master_port)
    layout["master_port"] = rendezvous_port(layout["master_port"], layout["nodes"])
    cmd = build(run_file, overrides=overrides, resume=resume, single_host=single_host, **layout)
    run = load_run(run_file, [*overrides, *layout_overrides(**layout)])
    if dry_run:
        _show_plan(run, cmd, as_json)
        return
    from memfit.cli.extras import require_for_runs

    require_for_runs("launch", [run])
    from memfit.cli.output import err_console

    def banner(run) -> None:
        err_console.print(f"[bold]memfit launch[/bold] {run.strategy.label()}: node {layout['node_rank']} of "
                          f"{layout['nodes']}, {layout['nproc']} process(es) here, world size "
                          f"{world_size(run)}, rendezvous {layout['master_addr']}:{layout['master_port']}")

    code = launch_reported(run_file, overrides=overrides, resume=resume, single_host=single_host,
                           on_start=banner, **layout)
    raise typer.Exit(code)


def launch_reported(run_file, *, on_start=None, **kwargs) -> int:
    """:func:`memfit.distributed.launch.launch` as every command runs it (``memfit launch``, ``memfit
    train --nproc N``, ``memfit demo --nproc N``): torchrun's output passed through, one ``error:`` line
    naming the rank that failed first, and after a SIGINT / SIGTERM the line saying every process of
    this node ended. Both say how to resume. Returns the exit status."""
    import sys

    from memfit.cli.output import err_console
    from memfit.distributed.launch import STOP_CODES, launch

    again = "the same command and --resume" + (" on every node" if kwargs.get("nodes", 1) > 1 else "")

    def failed(cause: str) -> None:
        err_console.print(f"error: {cause}; the run folder keeps its newest complete checkpoint: continue "
                          f"with {again}", markup=False, highlight=False, soft_wrap=True)

    code = launch(run_file, on_start=on_start, on_output=sys.stderr.write, on_failure=failed, **kwargs)
    names = {c: name for name, c in STOP_CODES.items()}
    if code in names:  # torchrun stopped this node's processes
        err_console.print(f"stopped ({names[code]}): every process on this node ended; continue with "
                          f"{again}", markup=False, highlight=False, soft_wrap=True)
    return code


def _show_plan(run, cmd: list[str], as_json: bool) -> None:
    import shlex

    from memfit.distributed.config import accelerate_config, world_size
    from memfit.distributed.engines import for_run
    from memfit.resolve import resolve

    resolved = resolve(run)  # the pool and model the launched processes will be predicted on
    device = "cpu" if resolved.hardware.gpu.is_cpu else "cuda"
    ds = for_run(run).config(run, device=device, hidden_size=resolved.model.hidden) \
        if run.strategy.zero_stage else None
    if as_json:
        from memfit.cli.output import print_json

        print_json({"command": cmd, "world_size": world_size(run), "engine": run.strategy.engine,
                    "deepspeed_config": ds, "accelerate_config": accelerate_config(run, device=device)})
        return
    from rich.table import Table

    from memfit.cli.output import console

    d = run.distributed
    table = Table(title=f"memfit launch (dry run): {run.strategy.label()}", show_header=False)
    table.add_row("engine", run.strategy.engine)
    table.add_row("layout", f"{d.nodes} node(s) x {d.nproc} process(es) = world size {world_size(run)}")
    table.add_row("this node", f"node_rank {d.node_rank}, rendezvous {d.master_addr}:{d.master_port}")
    if ds:
        z = ds["zero_optimization"]
        table.add_row("DeepSpeed", f"ZeRO-{z['stage']}, offload optimizer: {'offload_optimizer' in z}, "
                                   f"params: {'offload_param' in z}, reduce bucket {z['reduce_bucket_size']}")
    console.print(table)
    console.print(shlex.join(cmd), soft_wrap=True, highlight=False)


def register(app: typer.Typer) -> None:
    """Add ``launch`` to `app`."""
    app.command("launch")(launch_command)
