"""``plan --emit``: write the files that run a recommendation: ``run.yaml`` (what ``memfit train``
reads), plus the engine's own files (``deepspeed.json`` for ZeRO, ``accelerate.yaml`` for FSDP), as the
engine registry writes them. The run file is read back through :func:`memfit.resolve.resolve`, so the
files describe the pool the run will be predicted and launched on. Every write is atomic."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from memfit.errors import MemfitError
from memfit.spec.run import DistributedSpec, RunSpec, save_run
from memfit.spec.strategy import Strategy

RUN_FILE = "run.yaml"


def _write_atomic(path: Path, text: str) -> Path:
    from memfit.io import write_text

    return write_text(path, text)


def run_spec_for(strategy: Strategy, *, model_ref: str, hardware: Any, hardware_ref: Optional[str] = None,
                 cpu_ram: Optional[str] = None, output_dir: Optional[str] = None) -> RunSpec:
    """The run file for ``strategy``: model, pool, CPU RAM, the strategy, and one process per GPU."""
    # one process per GPU, or per CPU "device" of an NxCPU pool
    name = Path(model_ref).name or "model"
    return RunSpec(
        model=model_ref,
        hardware=hardware_ref or hardware.text(),
        cpu_ram=cpu_ram,
        strategy=strategy,
        distributed=DistributedSpec(nproc=hardware.gpus_per_node, nodes=hardware.nodes),
        output_dir=output_dir or f"runs/{name}-{strategy.label().replace(':', '-').replace('+', '-')}",
    )


def emit(out_dir: str | Path, strategy: Strategy, *, model_ref: str, hardware: Any,
         hardware_ref: Optional[str] = None, cpu_ram: Optional[str] = None) -> list[Path]:
    """Write run.yaml (+ deepspeed.json or accelerate.yaml) into ``out_dir``; return the paths written."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise MemfitError(f"--emit {out}: exists and is not a folder; give a folder path")
    run = run_spec_for(strategy, model_ref=model_ref, hardware=hardware, hardware_ref=hardware_ref,
                       cpu_ram=cpu_ram)
    from memfit.distributed.engines import for_run
    from memfit.resolve import resolve

    written = [save_run(run, out / RUN_FILE)]
    resolved = resolve(run)
    files = for_run(run).emitted_files(run, device="cpu" if resolved.hardware.gpu.is_cpu else "cuda",
                                       hidden_size=resolved.model.hidden)
    written += [_write_atomic(out / name, text) for name, text in files.items()]
    return written
