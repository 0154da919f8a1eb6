"""CPU RAM per node, and the verdict: why a run does not fit."""

from __future__ import annotations

from memfit.estimate.setup import Setup
from memfit.estimate.states import States


def cpu_lines(run: Setup, states: States, meft_store: float) -> tuple[dict[str, float], float]:
    """(CPU RAM lines per node, the steady-state part): the processes' baseline + max(steady state with
    offload, model loading)."""
    p, procs, gpu = run.profile, run.hardware.gpus_per_node, run.gpu
    # DeepSpeed's offload stages through pinned buffers of its own; FSDP's pinned blocks (the shards and the
    # _cpu_grad staging each unit pre-allocates) are the offloaded lines themselves (memfit.estimate.pinned)
    pinned = p.pinned_buffer_bytes if run.offload_optimizer and not gpu.is_cpu and not run.fsdp else 0.0
    steady = procs * (states.cpu_optim + states.cpu_grads + states.cpu_params + pinned + meft_store)
    # memfit's trainer loads full fine-tuning under mixed precision in fp32 (autocast keeps fp32 masters)
    load_b = 4.0 if run.precision == "fp32" or (run.method.trains_base and run.precision in ("fp16-mixed",
                                                                                          "bf16-mixed")) else 2.0
    total = run.total_params
    if gpu.is_cpu:
        loading = 0.0  # the model is loaded into the same RAM it trains in ("gpu" lines)
    elif run.engine.partitioned_loading or (run.method.quantized and not run.fsdp):
        loading = procs * p.checkpoint_shard_bytes  # zero.Init / device_map: one shard at a time
    elif run.fsdp and run.method.quantized:
        # FSDP + QLoRA, RAM-efficient: rank 0 quantises each tensor as it is read and keeps the quantised
        # model on the CPU, the other ranks start on the meta device (Answer.AI's fsdp_qlora train.py
        # load_and_quantize_parallel, low_memory; sync_module_states then broadcasts): the NF4 model at its
        # storage + one checkpoint shard being read, once per node — the published 70B runs trained on
        # 2 x 24 GB with 128 GB of RAM, where a 16-bit copy (141 GB) would not load
        loading = states.weights_all + p.checkpoint_shard_bytes
    elif run.fsdp:
        loading = total * load_b  # cpu_ram_efficient_loading + sync_module_states (memfit's FSDP config, both
        # versions and sharding modes): rank 0 materialises one copy per node, the others start on meta
    else:
        loading = procs * total * load_b  # every process builds a full copy before moving it to its GPU
    if gpu.is_cpu:  # no CUDA libraries or context; torchrun ranks add a process group and engine imports
        baseline = procs * (p.process_baseline_bytes_cpu + (p.process_baseline_dist_cpu if run.world > 1 else 0.0))
    else:
        baseline = procs * p.process_baseline_bytes
    return {"process_baseline": baseline, "model_loading": loading, "offloaded_optimizer": procs * states.cpu_optim,
            "offloaded_gradients": procs * states.cpu_grads, "offloaded_params": procs * states.cpu_params,
            "pinned_buffers": procs * pinned, "meft_store": procs * meft_store,
            "total": baseline + max(steady, loading)}, steady


def node_ram(per_node: int, device_bytes: float, host_bytes: float) -> float:
    """Resident memory of one node's processes on the CPU pseudo-device, where the "device" is the host's RAM:
    each of its ``per_node`` processes holds its "device" lines (``device_bytes``: its tensors, + glibc's heap
    holes where they are counted) and its share of the host lines (``host_bytes`` = ``cpu_bytes.total``, per
    node: process baselines + offload). The planner's fits-check and ``memfit measure``'s RSS comparison both
    use this figure."""
    return per_node * device_bytes + host_bytes


def verdict(run: Setup, gpu_total: float, cpu_total: float, gpu_loading: float, cuda_ctx: float, margin: float,
            usable: float, gpu_phase: str = "train_step", cpu_phase: str = "train_step") -> list[str]:
    """Why the run does not fit (empty: it fits). ``gpu_total`` / ``cpu_total``: the largest run phase's
    figures (memfit.estimate.phases), named by ``gpu_phase`` / ``cpu_phase``."""
    from memfit.estimate.phases import NAMES

    gpu, hardware, per_node = run.gpu, run.hardware, run.hardware.gpus_per_node
    reasons = []
    if gpu.is_cpu:  # one RAM holds every process's "device" lines and the process/offload lines
        need = node_ram(per_node, gpu_total, cpu_total)
        if need > usable:
            procs_txt = f"{per_node} x " if per_node > 1 else ""
            reasons.append(f"RAM: needs {need / 1e9:.2f} GB (model {procs_txt}{gpu_total / 1e9:.2f} + process/offload "
                           f"{cpu_total / 1e9:.2f}), usable {usable / 1e9:.2f} GB; "
                           f"over by {(need - usable) / 1e9:.2f} GB")
        return reasons
    when = "" if gpu_phase == "train_step" else f" while {NAMES[gpu_phase]}"
    if gpu_total > usable and gpu_phase == "load" and gpu_loading + cuda_ctx >= gpu_total - 1.0:
        reasons.append("GPU memory while loading: quantising to NF4 holds "
                       f"{gpu_total / 1e9:.2f} GB "
                       f"per GPU before training starts, "
                       f"usable {usable / 1e9:.2f} GB; over by {(gpu_total - usable) / 1e9:.2f} GB")
    elif gpu_total > usable:
        reasons.append(f"GPU memory{when}: needs {gpu_total / 1e9:.2f} GB per GPU, usable {usable / 1e9:.2f} GB "
                       f"({gpu.name} x (1 - margin {margin:g})); over by {(gpu_total - usable) / 1e9:.2f} GB")
    if cpu_total > hardware.cpu_ram_bytes:
        when = "" if cpu_phase in ("train_step", "load") else f" while {NAMES[cpu_phase]}"
        reasons.append(f"CPU RAM{when}: needs {cpu_total / 1e9:.2f} GB per node, have "
                       f"{hardware.cpu_ram_bytes / 1e9:.2f} GB (set --cpu-ram if the node has more); "
                       f"over by {(cpu_total - hardware.cpu_ram_bytes) / 1e9:.2f} GB")
    return reasons
