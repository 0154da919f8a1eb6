"""Checks before any weights load: can this process group run the run's strategy here?

``reasons(run)`` returns one sentence per problem, each saying what to change; ``check(run)`` raises
``IncompatibleError`` with them. It combines the planner's rules (``memfit.plan.rules.check``: FA2 on
V100/T4, bf16 on V100, QLoRA + ZeRO-3/FSDP without the quant-storage rule, ...) with what only the
launched processes know: the world size against the run file, GPUs on this node, DeepSpeed installed,
CPU RAM for the chosen offload (from ``memfit.estimate``).

Importing this module does not import torch; torch is asked only when a check needs it.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from memfit.distributed.ranks import launched_world
from memfit.errors import IncompatibleError, MemfitError
from memfit.spec.run import RunSpec


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _specs(run: RunSpec) -> tuple[Optional[Any], Optional[Any]]:
    """(ModelSpec, HardwareSpec laid out as launched) from :func:`memfit.resolve.resolve`; (None, None)
    where the model cannot be read as a spec (the model-folder check reports that)."""
    from memfit.resolve import resolve

    try:
        resolved = resolve(run)
    except MemfitError:
        return None, None
    return resolved.model, resolved.hardware


def world_reasons(run: RunSpec, world: int, local_world: int, cuda_devices: int) -> list[str]:
    """The launched layout against the run file and this node's GPUs."""
    d = run.distributed
    planned = d.nproc * d.nodes
    out = []
    if world != planned:
        out.append(
            f"{world} process(es) were launched but the run file plans distributed.nproc={d.nproc} x "
            f"nodes={d.nodes} = {planned}; set --set distributed.nproc={max(local_world, 1)} "
            f"(and distributed.nodes) to match, or launch with `memfit launch RUN --nproc {d.nproc}`")
    if cuda_devices and local_world > cuda_devices:
        out.append(f"{local_world} processes on this node but it has {cuda_devices} CUDA GPU(s); one process "
                   f"per GPU: use --nproc {cuda_devices}")
    return out


def engine_reasons(run: RunSpec, *, cpu: bool) -> list[str]:
    """The engine's own limits (installed, what runs on the CPU, offload combinations) and what no
    engine can offload (8-bit optimizer states)."""
    from memfit.distributed.engines import for_run

    out = []
    if run.strategy.offload != "none" and run.strategy.optimizer == "adamw8bit":
        out.append("optimizer=adamw8bit with offload: 8-bit optimizers need their states on the GPU; "
                   "use optimizer=adamw (32-bit AdamW) with offload")
    return for_run(run).reasons(run, cpu=cpu) + out


def cpu_adam_reason(prebuilt: bool, ninja: bool, compiler: bool) -> Optional[str]:
    """DeepSpeed's offloaded AdamW (``DeepSpeedCPUAdam``) is a C++ op: prebuilt, or JIT-built with ninja
    and a C++ compiler on first use."""
    if prebuilt or (ninja and compiler):
        return None
    missing = " and ".join(m for m, ok in (("ninja", ninja), ("a C++ compiler (c++/g++)", compiler)) if not ok)
    return (f"offload with DeepSpeed uses its C++ CPU AdamW, which is not prebuilt and cannot be built here "
            f"(missing {missing}); pip install ninja and install g++, or reinstall DeepSpeed with "
            "DS_BUILD_CPU_ADAM=1, or use offload=none")


def _cpu_adam_buildable() -> Optional[str]:
    import shutil

    try:
        from deepspeed.git_version_info import installed_ops
        from torch.utils.cpp_extension import is_ninja_available
    except ImportError:
        return None
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    return cpu_adam_reason(bool(installed_ops.get("cpu_adam")), is_ninja_available(), bool(compiler))


def rule_reasons(run: RunSpec, model: Any, hardware: Any) -> list[str]:
    """The planner's rules for this machine. On the CPU device the engines' offload is allowed here
    (it saves nothing but runs the same code as on GPUs, which is how CI tests it)."""
    from memfit.plan.rules import check

    s = run.strategy
    if hardware.gpu.is_cpu and s.offload != "none":
        s = s.model_copy(update={"offload": "none"})
    out = list(check(model, hardware, s))
    if run.save.mode in ("sharded", "adapter"):  # FSDP1 on gloo fails in the full gather only (#39)
        out = [r for r in out if not r.startswith("fsdp_version=1 on the CPU device")]
    return out


def ram_reasons(run: RunSpec, model: Any, hardware: Any) -> list[str]:
    """Offload needs the node's CPU RAM for optimizer state (and parameters): the estimator's figure."""
    if run.strategy.offload == "none" or hardware.gpu.is_cpu:
        return []
    from memfit.estimate import estimate

    need = float(estimate(model, hardware, run.strategy).cpu_total)
    have = float(hardware.cpu_ram_bytes)
    if need <= have:
        return []
    return [f"offload={run.strategy.offload}: the estimate needs {need / 1e9:.1f} GB of CPU RAM per node, "
            f"this node has {have / 1e9:.1f} GB; add nodes/processes (more shards), use "
            "offload=optimizer instead of optimizer+params, or set cpu_ram if the node has more"]


def planning_only(run: RunSpec) -> list[str]:
    """Keys that describe another stack for the estimate and that memfit's trainer does not run."""
    from memfit.spec.phases import save_mode

    out = []
    if run.strategy.hf_legacy_checkpoint:
        out.append("strategy.hf_legacy_checkpoint prices transformers < 4.52's reentrant checkpoint around each "
                   "layer (planning another stack); memfit trains with transformers 5's checkpoint inside each "
                   "layer: set it false")
    if not run.eval.loss_only:
        out.append("eval.loss_only=false prices a Trainer that gathers logits for compute_metrics (planning another "
                   "stack); memfit train has no metrics and evaluates the loss only: set it true")
    done = save_mode(run.strategy)
    runs = {done} | ({"sharded", "adapter"} if run.strategy.fsdp and run.strategy.trains_adapter else
                     {"sharded"} if run.strategy.fsdp else set())
    if run.save.mode not in runs | {None}:
        out.append(f"save.mode={run.save.mode}: memfit train saves {run.strategy.engine} with "
                   f"{run.strategy.method} as {' or '.join(sorted(runs))} (memfit.spec.phases.save_mode); leave "
                   f"save.mode unset or set it to {done}")
    return out


def reasons(run: RunSpec) -> list[str]:
    """Every reason this launch cannot run ``run``; [] when it can."""
    world, local_world = launched_world()
    cuda = _cuda_devices()
    from memfit.distributed.parallelism import reasons as parallelism_reasons

    out = world_reasons(run, world, local_world, cuda) + planning_only(run) + parallelism_reasons(run)
    out += engine_reasons(run, cpu=cuda == 0)
    s = run.strategy
    if cuda and s.zero_stage and s.offload != "none" and s.optimizer == "adamw":
        out += [r for r in [_cpu_adam_buildable()] if r]
    model, hardware = _specs(run)
    if model is not None and hardware is not None:
        out += rule_reasons(run, model, hardware)
        out += ram_reasons(run, model, hardware)
    return list(dict.fromkeys(out))


def before_launch(run: RunSpec) -> list[str]:
    """What a launcher can check before starting any process (no torch): the engines, the planner's
    rules and offload RAM for this node, processes vs this node's GPUs (nvidia-smi), the model folder."""
    if run.strategy.attention == "fa2":  # training falls back to sdpa with a note where FA2 cannot run
        run = run.model_copy(update={"strategy": run.strategy.model_copy(update={"attention": "sdpa"})})
    model, hardware = _specs(run)
    cpu = hardware is None or hardware.gpu.is_cpu
    from memfit.distributed.parallelism import reasons as parallelism_reasons

    out = planning_only(run) + parallelism_reasons(run) + engine_reasons(run, cpu=cpu)
    if model is not None and hardware is not None:
        out += rule_reasons(run, model, hardware) + ram_reasons(run, model, hardware)
    if not cpu:
        from memfit.spec.hardware import detect_local

        gpus = detect_local().gpus_per_node
        out += world_reasons(run, run.distributed.nproc * run.distributed.nodes, run.distributed.nproc, gpus)
    from memfit.resolve import model_dir

    try:
        model_dir(run.model)
    except MemfitError as err:
        out.append(str(err))
    return list(dict.fromkeys(out))


def check(run: RunSpec) -> None:
    """Raise ``IncompatibleError`` naming what to change, before anything heavy is loaded."""
    found = reasons(run)
    if found:
        raise IncompatibleError(f"strategy {run.strategy.label()} cannot run here: " + "; ".join(found))
