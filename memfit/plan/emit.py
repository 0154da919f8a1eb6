"""Write the files that run a recommendation: ``run.yaml`` (what ``memfit train`` reads), plus
``deepspeed.json`` for a ZeRO strategy or ``accelerate.yaml`` for FSDP. Every write is atomic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from memfit.errors import MemfitError
from memfit.plan import facts
from memfit.spec.run import DistributedSpec, RunSpec, save_run
from memfit.spec.strategy import Strategy

RUN_FILE = "run.yaml"


def default_mode() -> int:
    """rw for everyone the umask allows (mkstemp's temp files are 0600)."""
    from memfit.io import file_mode

    return file_mode()


def _write_atomic(path: Path, text: str) -> Path:
    from memfit.io import write_text

    return write_text(path, text)


def run_spec_for(strategy: Strategy, *, model_ref: str, hardware: Any, hardware_ref: Optional[str] = None,
                 cpu_ram: Optional[str] = None, output_dir: Optional[str] = None) -> RunSpec:
    """The run file for ``strategy``: model, pool, CPU RAM, the strategy, and one process per GPU."""
    nproc = facts.gpus_per_node(hardware)  # one process per GPU, or per CPU "device" of an NxCPU pool
    name = Path(model_ref).name or "model"
    return RunSpec(
        model=model_ref,
        hardware=hardware_ref or facts.hardware_text(hardware),
        cpu_ram=cpu_ram,
        strategy=strategy,
        distributed=DistributedSpec(nproc=nproc, nodes=facts.nodes(hardware)),
        output_dir=output_dir or f"runs/{name}-{strategy.label().replace(':', '-').replace('+', '-')}",
    )


def emit(out_dir: str | Path, strategy: Strategy, *, model: Any, model_ref: str, hardware: Any,
         hardware_ref: Optional[str] = None, cpu_ram: Optional[str] = None) -> list[Path]:
    """Write run.yaml (+ deepspeed.json or accelerate.yaml) into ``out_dir``; return the paths written."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise MemfitError(f"--emit {out}: exists and is not a folder; give a folder path")
    run = run_spec_for(strategy, model_ref=model_ref, hardware=hardware, hardware_ref=hardware_ref,
                       cpu_ram=cpu_ram)
    written = [save_run(run, out / RUN_FILE)]
    written += _engine_files(run, out, device="cpu" if facts.is_cpu(hardware) else "cuda",
                             hidden_size=facts.hidden_size(model) or None)
    return written


def _engine_files(run: RunSpec, out: Path, *, device: str, hidden_size: Optional[int]) -> list[Path]:
    from memfit.distributed import config as dist

    written = []
    if dist.uses_deepspeed(run):
        cfg = dist.deepspeed_config(run, device=device, hidden_size=hidden_size)
        written.append(_write_atomic(out / dist.DEEPSPEED_FILE, json.dumps(cfg, indent=2) + "\n"))
    elif dist.uses_fsdp(run):
        import yaml

        cfg = dist.accelerate_config(run, device=device)
        written.append(_write_atomic(out / dist.ACCELERATE_FILE, yaml.safe_dump(cfg, sort_keys=False)))
    return written
