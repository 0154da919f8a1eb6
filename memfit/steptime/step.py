"""Time of one optimizer step (= grad_accum micro-batches on every GPU / process), from its parts.

A micro-batch is priced by memfit.steptime.micro on a catalog GPU (GEMMs by shape, attention by length,
bytes by transfer size, the host's dispatch) or by memfit.steptime.measured at measured speeds (this CPU, a
calibrated GPU). Per step then: the optimizer (AdamW per parameter and per tensor), gradient clipping and
accumulation (memfit.steptime.loop), the engine's collectives less what overlaps (memfit.steptime.comm),
offload traffic and the CPU optimizer, MEFT's transfers and CPU search, the engines' host work
(memfit.steptime.host on GPUs, memfit.steptime.engine_host on CPUs) and the Trainer's own loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from memfit.engines import EngineCost
from memfit.methods import METHODS
from memfit.methods.base import Traffic, weight_tensors
from memfit.spec.hardware import HardwareSpec
from memfit.spec.strategy import Strategy
from memfit.steptime.constants import TimeProfile
from memfit.spec.model import ModelSpec
from memfit.steptime.comm import collective_calls, comm_parts, exposed_comm, fsdp2_copy_bytes
from memfit.steptime.cpu import mmap_threshold, step_fresh_bytes
from memfit.steptime.engine_host import engine_host_seconds
from memfit.steptime.host import step_host_seconds
from memfit.steptime.loop import optimizer_seconds, trainer_loop_ops
from memfit.steptime.layer import micro_work, shape_for
from memfit.steptime.price import device_for, price
from memfit.steptime.speeds import Speeds, speeds_for
from memfit.steptime.work import extra_work


def _meft_seconds(model: ModelSpec, st: Strategy, p: TimeProfile, sp: Speeds, traffic: Traffic, rows: float,
                  cpu: bool) -> float:
    """MEFT's own time per step: its rows moved (overlapped by ``meft_overlap``), the CPU's expert search and the
    CPU Adam update of the rows used."""
    ga = st.grad_accum
    moved = 0.0 if cpu else traffic.h2d / sp.h2d + traffic.d2h / sp.d2h
    experts = traffic.experts
    search = 2.0 * model.hidden * (experts + st.meft_n_probe * st.meft_neurons / experts)
    cpu_search = ga * float(st.micro_batch_size) * st.seq_len * model.layers * search / p.meft_cpu_flops
    cpu_update = ga * model.layers * 2.0 * rows * model.hidden * sp.cpu_adam_per_param
    return moved * (1.0 - p.meft_overlap) + cpu_search + cpu_update


def _host_link(model: ModelSpec, st: Strategy, p: TimeProfile, sp: Speeds, adapted: frozenset, p_t: float, n: int,
               g_comm: float, w_comm: float, gather_bytes: float, fsdp: bool, cpu: bool) -> tuple[float, float, float]:
    """(offload seconds, upload seconds, bytes) over the host link per step: offload's gradients down and
    weights up (overlapped by ``overlap_offload``), offloaded parameters per gather, and the method's blocking
    uploads (e.g. BOFT's permutation every forward)."""
    ga, pcie_b = st.grad_accum, 0.0
    if st.offload != "none":
        pcie_b += ga * p_t / n * g_comm + p_t / n * w_comm
    if st.offload == "optimizer+params":
        pcie_b += ga * (3.0 if st.gradient_checkpointing and not fsdp else 2.0) * gather_bytes / n  # per gather
    seconds = (pcie_b / sp.h2d if pcie_b and not cpu else 0.0) * (1.0 - p.overlap_offload)
    # waited for: not overlapped
    uploads = 0.0 if cpu else ga * model.layers * extra_work(model, st, adapted).upload_bytes
    return seconds, uploads / sp.h2d, pcie_b + uploads


@dataclass(frozen=True)
class StepInputs:
    """What the memory side resolved that the step's time reads (memfit.estimate builds it once per estimate)."""

    engine: EngineCost           # the engine's record (memfit.engines)
    p_t: float                   # trainable parameters
    tensors: float               # their tensors, as the optimizer visits them (Parameters.tensors)
    adapted: frozenset           # the adapted linears' names (empty unless LoRA-style)
    gather_bytes: float          # bytes a full gather moves (FSDP: the compute copy; else the stored weights)
    g_comm: float                # bytes of a gradient value as reduced
    w_comm: float                # bytes of a weight value as gathered / uploaded
    shard_o: bool                # the optimizer state is sharded
    meft_rows: float = 0.0       # MEFT's rows used per layer
    router: float = 0.0          # parameters of a router run per token (MEFT's)
    meft_traffic: Optional[Traffic] = None  # the method's own host <-> device bytes per step (AdapterMemory.traffic)
    fp32_stream: bool = False    # QLoRA's fp32 residual stream (prepare_model_for_kbit_training)
    prompt_tokens: int = 0       # virtual tokens a prompt-learning method puts before every sequence (PEFT's
    #                              prompt tuning concatenates them to the input embeddings: every layer, the
    #                              attention and the head process seq_len + these; the tokens counted stay seq_len)
    reduce_bucket: float = 0.0   # DeepSpeed's reduce bucket, elements (its config: reduce_bucket_size)
    offload_bytes: float = 0.0   # activations copied to the host per micro-batch (memfit.estimate.longctx)
    grad_b: float = 4.0          # bytes of a gradient value the optimizer reads (Setup.optimizer_dtypes)
    adam_scale: float = 1.0      # AdamW's bytes per value relative to fp32 (Setup.optimizer_dtypes)


def step_time(model: ModelSpec, hw: HardwareSpec, st: Strategy, p: TimeProfile, w: StepInputs) -> dict[str, Any]:
    """The ``time`` object of the estimate (seconds per optimizer step, by part, with its basis) and the
    traffic and floor it implies: ``{"time": ..., "traffic": ..., "floor_seconds": ...}``."""
    engine, p_t, adapted, gather_bytes = w.engine, w.p_t, w.adapted, w.gather_bytes
    g_comm, w_comm, shard_o, meft_rows = w.g_comm, w.w_comm, w.shard_o, w.meft_rows
    fp32_stream, fsdp, prompt_tokens = w.fp32_stream, engine.fsdp_version > 0, w.prompt_tokens
    prec, ga = st.precision, st.grad_accum
    shape = st.model_copy(update={"seq_len": st.seq_len + prompt_tokens}) if prompt_tokens else st
    n, cpu = hw.world_size, bool(hw.gpu.is_cpu)
    sp = speeds_for(hw, prec, st.attention, p)
    e = 4.0 if prec == "fp32" else 2.0
    tensors_t = w.tensors
    group = st.sequence_parallel * st.context_parallel  # ranks sharing each sequence (st: one rank's share)
    work = micro_work(model, shape_for(model, shape, e, adapted, meft_rows, w.router, fp32_stream, engine, tensors_t,
                                       group <= hw.gpus_per_node, w.offload_bytes), shape)
    mb = price(work, device_for(sp, p))
    off_opt = st.offload != "none"
    local = p_t / (n if shard_o else 1)
    # FSDP2's optimizer steps a shard of every tensor (DTensors); DeepSpeed a flat partition
    tensors = tensors_t / (n if shard_o and not fsdp else 1)
    no_sync = fsdp and not getattr(st, "fsdp_sync_each_batch", True)  # accelerate's no_sync (estimate.peak)
    optim_s = optimizer_seconds(sp, engine, p_t, n, tensors, local, ga, off_opt, no_sync, w.grad_b, w.adam_scale)
    if sp.first_touch and METHODS[st.method].trains_base and not off_opt:  # CPU: fresh gradients and AdamW temporaries
        share = n if shard_o else 1  # full fine-tuning's large tensors: the embedding, the head, the linears
        big = [model.vocab * model.hidden / share] * (1 if model.tie_embeddings else 2) + \
            [lin.parameters / share for lin in model.linears] * model.layers
        optim_s += sp.first_touch * step_fresh_bytes(big, mmap_threshold(), 2.0 if prec == "bf16" else 4.0)
    cpu_opt_s = (p_t / n) * sp.cpu_adam_per_param if off_opt else 0.0
    parts = comm_parts(engine, 0.0, gather_bytes, p_t, g_comm, w_comm, ga, st.gradient_checkpointing, fsdp,
                       no_sync) if n > 1 else {}
    cbytes = sum(parts.values())
    comm_s = 0.0
    if cbytes:
        calls = collective_calls(engine, model.layers, cbytes, ga, st.gradient_checkpointing,
                                 tensors_t, p_t, w.reduce_bucket, fsdp, no_sync)
        comm_s = sum(b * (n - 1) / n / sp.bus(op) for op, b in parts.items()) + calls * sp.collective_latency
    copies_s = 0.0
    if fsdp and n > 1 and sp.gpu is not None and getattr(st, "fsdp_version", 2) == 2:  # FSDP2's copy-in / -out
        unit = gather_bytes / (model.layers + 2)
        copies_s = fsdp2_copy_bytes(engine, gather_bytes, n, p_t, g_comm, e, ga, no_sync) / sp.gpu.bandwidth(unit)
    exposed = exposed_comm(comm_s, ga * mb.overlap_window + copies_s, engine, p, cpu, model.layers)
    offload_s, upload_s, pcie_b = _host_link(model, st, p, sp, adapted, p_t, n, g_comm, w_comm, gather_bytes, fsdp, cpu)
    traffic = {"h2d": 0.0, "d2h": 0.0, "comm_bytes_per_gpu": cbytes, "offload_pcie_bytes": pcie_b}
    meft_s = 0.0
    if w.meft_traffic is not None:
        traffic["h2d"], traffic["d2h"] = w.meft_traffic.h2d, w.meft_traffic.d2h
        meft_s = _meft_seconds(model, st, p, sp, w.meft_traffic, meft_rows, cpu)
    engine_s = step_host_seconds(engine, tensors_t, p) if sp.gpu else 0.0
    engine_s += 0.0 if sp.overlap_dispatch or off_opt else engine_host_seconds(  # CPU, no offload: measured
        engine, fsdp, tensors_t, weight_tensors(model), p_t, g_comm, gather_bytes, n, ga,
        sp.op_seconds, sp.bandwidth, p)
    trainer_ops = trainer_loop_ops(p, ga, len(adapted) * model.layers)
    trainer_s = trainer_ops * sp.op_seconds + (p.trainer_step_collectives * sp.collective_latency if n > 1 else 0.0)
    step = ga * mb.seconds + copies_s + optim_s + exposed + offload_s + upload_s + cpu_opt_s + meft_s + trainer_s \
        + engine_s
    flops = ga * (mb.dense_flops + mb.attention_flops + mb.adapter_flops)
    tokens = n * st.micro_batch_size * ga * st.seq_len
    time = {"step_seconds": step, "tokens_per_second": tokens / step if step > 0 else 0.0, "basis": sp.basis,
            "compute_seconds": ga * mb.seconds, "matmul_seconds": ga * mb.matmul_seconds,
            "attention_seconds": ga * mb.attention_seconds,
            "memory_bound_seconds": ga * mb.memory_bound_seconds, "dequant_seconds": ga * mb.dequant_seconds,
            "dispatch_seconds": ga * mb.dispatch_seconds, "optimizer_seconds": optim_s,
            "sequence_exchange_seconds": ga * mb.exchange_seconds, "activation_copy_seconds": ga * mb.copy_seconds,
            "trainer_seconds": trainer_s, "trainer_ops": trainer_ops, "comm_seconds": comm_s,
            "comm_exposed_seconds": exposed,
            "offload_seconds": offload_s, "upload_seconds": upload_s, "cpu_optimizer_seconds": cpu_opt_s,
            "meft_seconds": meft_s, "engine_seconds": engine_s, "fsdp_copy_seconds": copies_s,
            "flops_per_gpu": flops, "dense_flops": ga * mb.dense_flops,
            "attention_flops": ga * mb.attention_flops, "adapter_flops": ga * mb.adapter_flops,
            "achieved_flops_per_second": flops / (ga * mb.seconds) if mb.seconds > 0 else 0.0}
    return {"time": time, "traffic": traffic, "floor_seconds": flops / sp.peak}
