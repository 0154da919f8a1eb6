"""estimate(model, hardware, strategy) -> Estimate: memory per GPU, CPU RAM per node, step time.

``Estimate.to_dict()`` is the ``memfit estimate --json`` contract (see docs/estimator.md). GPU lines:
formula lines (weights, gradients, optimizer, activations, logits, lora_intermediates, meft_buffers),
engine lines derived from the engine's configuration (gathered_params, comm_buffers), the
``peak_concurrency`` adjustment (what is not live at the same time) and one ``overhead`` line (CUDA context +
NCCL buffers + allocator fragmentation, itemised in ``memory.gpu_overhead_bytes``). The numeric lines of
``gpu_bytes`` other than ``total`` sum to ``total``.

The parts: :mod:`~memfit.estimate.setup` (the call's facts), each method's own terms in the registry
(:mod:`memfit.methods`: trained and frozen bytes, adapter tensors, MEFT's buffers and traffic),
:mod:`~memfit.estimate.states` (model states, engine buffers), :mod:`~memfit.estimate.saved` (what the
forward saves), :mod:`~memfit.estimate.peak` (the phases' peak, fragmentation), :mod:`~memfit.estimate.host`
(CPU RAM, verdict) and :mod:`~memfit.steptime.step` (step time).
"""

from __future__ import annotations

from typing import Optional

from memfit.estimate import cuda as CU
from memfit.estimate import longctx as LC
from memfit.estimate import phases as RP
from memfit.steptime import step as T
from memfit.estimate.constants import Profile
from memfit.estimate.host import cpu_lines, verdict
from memfit.estimate.meft import meft_traffic_bytes  # noqa: F401  (memfit.estimate's public name)
from memfit.estimate.peak import fragmentation, step_peak, step_temporaries
from memfit.estimate.result import Estimate
from memfit.estimate.saved import saved_tensors
from memfit.estimate.setup import Setup, profile_for
from memfit.estimate.states import engine_buffers, model_states
from memfit.methods import METHODS
from memfit.spec.hardware import HardwareSpec
from memfit.spec.model import ModelSpec, lora_target_reason
from memfit.spec.phases import DEFAULT_PHASES, RunPhases
from memfit.spec.strategy import Strategy


def estimate(model: ModelSpec, hardware: HardwareSpec, strategy: Strategy, profile: Optional[Profile] = None,
             margin: float = 0.05, activation_formula: Optional[str] = None, distributed=None,
             phases: Optional[RunPhases] = None) -> Estimate:
    """Estimate one combination. ``activation_formula``: None/"derived" or "korthikanti" (GPT-style).
    ``distributed``: the run's ``distributed`` settings (reduce/allgather bucket sizes) for DeepSpeed.
    ``phases``: the run's ``eval`` and ``save`` keys (memfit.spec.phases; None: memfit train's defaults)."""
    profile = profile_for(profile, model, strategy, activation_formula, distributed, margin)
    method = METHODS[strategy.method]
    # sequence / context parallelism: each rank runs seq_len / N tokens of a sample (memfit.estimate.longctx)
    run = Setup(model, hardware, LC.local(strategy), profile, method)
    gpu = run.gpu

    # ---- what is trained, what is frozen, at what storage (the method's own terms) -----------------
    params = method.parameters(model, strategy, profile, run.numbers, run.value_b)
    reasons: list[str] = []
    if params.targets is not None and not params.trainable:
        reasons.append(lora_target_reason(model, params.targets))
    states = model_states(run, params)

    # ---- activations, logits, the method's tensors; the engine's buffers ---------------------------
    backend = CU.sdpa_backend(gpu, model, run.precision, strategy.attention)  # the kernel SDPA runs on this GPU
    attention = CU.attention_for_memory(backend, strategy.attention)
    lc = LC.long_context(run, saved_tensors(run, params, attention), strategy.seq_len)
    saved = lc.saved
    adapter = saved.adapter
    bufs = engine_buffers(run, params, states.weights_all)
    step_temp = step_temporaries(run, params, bufs.step_temp)

    # ---- what is live at the same time: the step's peak (memfit.estimate.peak) -----------------------
    static = (states.weights - states.autocast_copy + states.optim + (adapter.buffers - adapter.buffers_saved)
              + bufs.gathered + bufs.comm - bufs.layer_bufs - bufs.tail_bufs - bufs.root_bufs - bufs.root_grad)
    peak = step_peak(run, states, bufs, saved, step_temp, attention, params)
    # the activations line: the saved tensors + the working memory the peak phase holds beyond them
    acts = saved.act_in + saved.act_layers + saved.act_tail + peak.held
    adapter_acts = adapter.intermediates + adapter.buffers_saved
    grads_line = max(states.grads, peak.accum_grads)  # FSDP + accumulation: the unsharded gradients (peak.py)
    lines_sum = (static + bufs.layer_bufs + bufs.tail_bufs + bufs.root_bufs + bufs.root_grad + states.autocast_copy
                 + grads_line + acts
                 + saved.logits + adapter_acts + step_temp)
    formula = static + peak.phase
    cuda_ctx = CU.context_bytes(gpu, profile)
    nccl = CU.nccl_bytes(hardware, profile)
    gap = fragmentation(run, params, saved, peak, formula)
    # the cache a card shows: whole free segments only up to the card (freed and retried when it runs out)
    frag = gap.total if gpu.is_cpu else CU.cap_cached(gap, formula, cuda_ctx + nccl, gpu.memory_bytes)
    firm = formula + cuda_ctx + nccl + gap.firm  # what the card must hold: the verdict's figure
    overhead = cuda_ctx + nccl + frag
    gpu_lines = {"weights": states.weights, "gradients": grads_line, "optimizer": states.optim,
                 "activations": acts, "logits": saved.logits, "lora_intermediates": adapter.intermediates,
                 "meft_buffers": adapter.buffers, "gathered_params": bufs.gathered, "comm_buffers": bufs.comm,
                 "step_temporaries": step_temp, "peak_concurrency": static + peak.phase - lines_sum,
                 "overhead": overhead, "total": formula + overhead}
    gpu_loading = 0.0 if gpu.is_cpu else CU.qlora_loading_peak(
        model, method.quantized, run.engine.stores_sharded, params.quant_state, run.numbers, run.value_b,
        profile)

    # ---- CPU RAM per node -------------------------------------------------------------------------
    cpu, steady = cpu_lines(run, states, adapter.host)
    if lc.host:  # offloaded activations in pinned host memory, while training
        cpu["offloaded_activations"] = hardware.gpus_per_node * lc.host
        steady += cpu["offloaded_activations"]
        cpu["total"] = cpu["process_baseline"] + max(steady, cpu["model_loading"])

    # ---- run phases: loading, the step, evaluation, the save (memfit.estimate.phases) ----------------
    train_gpu = gpu_lines["total"] if gpu.is_cpu else firm
    figures, gpu_phase, cpu_phase = RP.priced(run, RP.phase_inputs(
        run, states, bufs, saved, static, formula, gap.split, cuda_ctx + nccl, train_gpu, gpu_loading, cpu, steady,
        params, attention), phases or DEFAULT_PHASES, states.weights_all, params.trainable, cpu)

    # ---- time (memfit.steptime.step: parts at measured or catalog speeds) ----------------------
    timed = _step_time(run, params, states, bufs, adapter, lc.moved)

    # ---- verdict --------------------------------------------------------------------------------
    usable = gpu.memory_bytes * (1.0 - margin)
    # the verdict on what the card must hold in its largest run phase (the step: less the whole free segments)
    reasons += verdict(run, figures[gpu_phase][0], cpu["total"], gpu_loading, cuda_ctx, margin, usable, gpu_phase,
                       cpu_phase)
    frozen = params.frozen_bytes if not method.trains_base else run.total_params * run.value_b
    return Estimate(model=model, hardware=hardware, strategy=strategy, gpu=gpu_lines,
                    gpu_overhead={"cuda_context": cuda_ctx, "nccl_buffers": nccl, "allocator_fragmentation": frag},
                    cpu=cpu, cpu_phase=RP.NAMES[cpu_phase],
                    time=timed["time"], traffic=timed["traffic"], fits=not reasons, reasons=reasons,
                    trainable_parameters=params.trainable + params.outside,
                    floor_memory=frozen / (run.world if run.shard_weights else 1),
                    floor_seconds=timed["floor_seconds"], margin=margin, usable_gpu_bytes=usable,
                    attention_backend=backend, gpu_loading=gpu_loading,
                    gpu_needed=figures[gpu_phase][0], phases=figures, gpu_phase=gpu_phase,
                    phase_settings=RP.settings(strategy, phases or DEFAULT_PHASES))


def _step_time(run: Setup, params, states, bufs, adapter, offloaded: float) -> dict:
    """memfit.steptime.step's figures for this call's facts."""
    model, strategy, profile, method = run.model, run.strategy, run.profile, run.method
    return T.step_time(model, run.hardware, strategy, profile, T.StepInputs(
        engine=run.engine, p_t=params.trainable, tensors=params.tensors, adapted=params.adapted,
        gather_bytes=states.compute_all if run.engine.gathers_compute_copy else states.weights_all,
        g_comm=bufs.grad_comm_b, w_comm=min(run.weight_b, run.value_b), shard_o=run.shard_optim,
        reduce_bucket=profile.zero_reduce_bucket_per_h2 * model.hidden ** 2,
        meft_rows=adapter.rows, router=adapter.router, meft_traffic=adapter.traffic, offload_bytes=offloaded,
        fp32_stream=bool(params.fp32_stream), prompt_tokens=method.prompt_tokens(model, strategy),
        **run.optimizer_dtypes()))
