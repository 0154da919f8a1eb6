"""Run phases: loading, the training step, evaluation and the checkpoint save, each a per-GPU peak and a per-node
CPU RAM figure; the verdict holds the largest (#39). ("Phase" inside the step is memfit.estimate.peak's.)

Each term read in the engines' code at the pinned versions (site-packages paths):

- **Evaluation** (transformers 5.24 ``trainer.py``): ``evaluate`` runs ``evaluation_loop`` with
  ``prediction_loss_only=True if self.compute_metrics is None`` (memfit train passes none), under
  ``torch.no_grad`` (``prediction_step``): nothing is saved for backward, so a layer's forward set is freed as the
  next runs; gradients are None (the optimizer zeroed them with ``set_to_none``), the optimizer's states and the
  engine's units stay. At the loss: the 16-bit logits, their fp32 upcast and log-softmax (8 B per logit). With
  ``prediction_loss_only`` off every batch's logits are padded, gathered from all ranks
  (``gather_for_metrics``) and kept on the GPU (``all_preds.add``) until ``eval_accumulation_steps`` moves them to
  the CPU, where ``get_arrays`` leaves every rank all of them as fp32 numpy (numpy has no bf16).
- **Checkpoint save**, ``full``: FSDP1 ``FULL_STATE_DICT`` with ``offload_to_cpu=True, rank0_only=True``
  (accelerate 1.15 ``Accelerator.get_state_dict``; torch ``fsdp/_state_dict_utils.py``
  ``_full_pre_state_dict_hook`` unshards one unit at a time on the GPU and copies it to rank 0's CPU), FSDP2
  ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``, DeepSpeed ZeRO-3
  ``_zero3_consolidated_16bit_state_dict`` (16-bit, gathered module by module): rank 0's RAM holds the whole state
  dict at its flat dtype (accelerate upcasts trained flat parameters to fp32) while the offloaded shards stay
  (pytorch#137151, Lightning#20312). Unsharded engines hand safetensors the GPU tensors, which
  ``_flatten_as_ptr`` moves to the CPU and keeps alive for one file (``save_pretrained``'s ``max_shard_size``,
  50 GB: ``Profile.save_shard_bytes``). ``adapter``: the trained parameters only (PEFT's adapter save; ZeRO-3
  ``exclude_frozen_parameters=True``). ``sharded``: each rank writes its own shards (FSDP
  ``SHARDED_STATE_DICT`` through torch.distributed.checkpoint, which copies item by item: one unit's shard).
- **Loading**: ``memory.cpu_bytes.model_loading`` (memfit.estimate.host) and QLoRA's quantise-on-load
  (memfit.estimate.cuda.qlora_loading_peak); FSDP1 with parameter offload pins each unit's shard at its lazy
  init (``_flat_param.py`` ``init_flat_param_attributes``) while the unpinned shard stays the flat parameter's data
  until the unit's first reshard (``_use_sharded_flat_param``): for the first step both are held.
"""

from __future__ import annotations

import json

import math
from typing import NamedTuple

from memfit.errors import ConfigError
from memfit.estimate import fsdp1 as F1
from memfit.spec.phases import RunPhases, save_mode

# run phase -> the word memory.cpu_peak_phase used before run phases (kept) and the table's name
NAMES = {"load": "loading", "train_step": "training", "eval": "evaluation", "save": "saving"}


class PhaseInputs(NamedTuple):
    """What the training step's estimate already computed that the other phases read (bytes per GPU / node)."""
    weights: float       # the weights line (what loading leaves on the GPU)
    static: float        # the step's static lines (weights, optimizer states, engine buffers)
    at_rest: float       # the same between steps (SHARD_GRAD_OP's parameters resharded after the backward)
    layer_bufs: float    # engine buffers held while a decoder layer's forward runs (its gathered unit + prefetch)
    held_bufs: float     # engine buffers held through the forward (FSDP's root / tail unit; autocast's copies)
    layer_set: float     # one layer's live set in a no_grad forward at the training micro-batch (forward_set)
    hidden: float        # one hidden-wide tensor of the training micro-batch
    logits: float        # the logits line of the training micro-batch (loss, without a fused head gradient)
    split: float         # block splitting's waste, a fraction of allocated (memfit.estimate.cuda.gap_parts)
    fixed: float         # CUDA context + NCCL buffers
    train_gpu: float     # the training step's verdict figure (gpu_needed)
    gpu_loading: float   # tensors while quantising on load (0 where loading holds no more than training)
    baseline: float      # the processes' baseline (per node)
    steady: float        # offloaded lines during training (per node)
    loading: float       # model loading (per node)
    unpinned: float      # FSDP1 + parameter offload: the unpinned shards its lazy init keeps (per node)
    adapter_param: float = 0.0  # the largest trained adapter matrix in fp32 (lora_A / lora_B of the widest linear)


def eval_gpu(run, x: PhaseInputs, phases: RunPhases) -> float:
    """Per GPU at the evaluation's peak: the static lines, one layer's forward, the loss's logits (+ kept logits)."""
    st, ev = run.strategy, phases.eval
    b = ev.batch_size or st.micro_batch_size
    scale = b / st.micro_batch_size
    e = run.value_b
    logit_b = (0.0 if e == 4.0 else e) + 8.0  # 16-bit logits + fp32 upcast and log-softmax (phase F's form)
    # the loss: its logits terms + the hidden states still held (the embeddings' output, the last layer's, the norm's)
    logits = x.logits * scale * (1.0 if st.loss == "chunked" else logit_b / 12.0) + 3.0 * x.hidden * scale
    # Liger (liger: true): its forward fuses the loss only in training (liger_kernel/transformers/model/llama.py
    # lce_forward: skip_logits = self.training and labels given), but the Trainer asks for it in a loss-only
    # evaluation too (transformers 5.24 trainer.py prediction_step: skip_logits=True): the chunked line
    # a decoder layer's forward (its unit gathered) and the loss (the layers resharded) are not live together;
    # the root / tail units stay gathered (no backward comes to reshard them)
    forward = max(x.layer_bufs + x.layer_set * scale, logits)
    if not ev.loss_only:  # EvalLoopContainer.add: torch.cat(kept, new) each batch (eval_do_concat_batches): the
        # last add holds the n - 1 batches kept, the new one and their concatenation; the forward before it, n - 1
        n, gathered = kept_batches(run, phases), run.world * b * st.seq_len * run.model.vocab * e
        forward = max(forward + (n - 1) * gathered, 2.0 * n * gathered)
    alloc = x.static + x.held_bufs + forward
    return alloc * (1.0 + x.split) + x.fixed


def kept_batches(run, phases: RunPhases) -> int:
    """Evaluation batches whose gathered logits stay on the GPU with ``eval.loss_only: false``."""
    ev = phases.eval
    if not ev.examples:
        raise ConfigError("eval.loss_only=false keeps every evaluation batch's logits (on the GPU, then all of them "
                          "on the CPU): give eval.examples (evaluation sequences), or set eval.loss_only=true")
    b = ev.batch_size or run.strategy.micro_batch_size
    every = math.ceil(ev.examples / (b * run.world))
    return min(ev.accumulation_steps, every) if ev.accumulation_steps else every


def unit_bytes(run, weights_all: float) -> float:
    """What a full gather holds unsharded on the GPU at once. FSDP1: one unit, a decoder layer or the root
    (embeddings, head) at its flat parameter's dtype (``_unshard_fsdp_state_params`` + ``FlatParamHandle.to_cpu``:
    unsharded, copied to rank 0's CPU, freed); FSDP2: one parameter (``_state_dict_utils._gather_state_dict``:
    ``full_tensor()``); ZeRO-3: one module's own parameters in 16-bit (``_zero3_consolidated_16bit_state_dict``:
    ``GatheredParameters(module.parameters(recurse=False))``)."""
    model = run.model
    largest = max(run.numbers.largest_linear, model.embedding_parameters, model.head_parameters)
    stored = run.weight_b if run.method.trains_base else run.value_b
    if run.fsdp_version == 1:
        root = F1.root_parameters(model) * stored
        return max((weights_all - root) / max(model.layers, 1), root)
    if run.fsdp:  # FSDP2's get_model_state_dict: full_tensor() parameter by parameter, then to the CPU
        return largest * stored
    return largest * run.value_b


def save_gpu(run, x: PhaseInputs, mode: str, unit: float) -> float:
    """Per GPU while saving: the static lines + (a full gather on a sharded engine) one unit unsharded."""
    gathered = unit if mode not in ("sharded", "adapter") and (run.fsdp or run.shard_weights) else 0.0
    return (x.at_rest + gathered) * (1.0 + x.split) + x.fixed


def save_cpu(run, x: PhaseInputs, mode: str, weights_all: float, trainable: float, rank0: bool = False) -> float:
    """Per node while saving: the processes and the offloaded lines + what rank 0 (or every rank) stages;
    ``rank0``: rank 0's share alone."""
    procs = 1 if rank0 else run.hardware.gpus_per_node
    if mode == "adapter":  # FSDP: every rank gathers the adapter (memfit's engines.fsdp.adapter_state_dict): its
        # copies + the matrix being gathered and its collective's output buffer (measured on gloo, 2 ranks)
        staged = (trainable * 4.0 + (2.0 * x.adapter_param if run.fsdp else 0.0)) * (procs if run.fsdp else 1)
    elif mode == "sharded":  # torch.distributed.checkpoint writes item by item: the largest unit's shard per rank
        staged = procs * unit_bytes(run, weights_all) / run.world
    elif run.fsdp or run.shard_weights:  # the whole state dict on rank 0 (ZeRO-3: consolidated in 16-bit)
        staged = weights_all if run.fsdp else run.total_params * run.value_b
    else:  # save_pretrained moves one file's GPU tensors to the CPU and keeps them alive
        staged = min(weights_all, run.profile.save_shard_bytes)
    return x.baseline + x.steady + staged


CHECKPOINT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}


def _resident_at_load(run, x: PhaseInputs, trainable: float) -> float:
    """CPU: the weights resident once loaded. transformers 5.24 loads a safetensors checkpoint stored in the dtype it
    is loaded in without copying it (the tensors stay backed by the file's memory map, its pages resident only
    once touched, in the first step); a checkpoint in another dtype is converted into new, resident tensors. The
    adapters a method adds are new tensors (fp32)."""
    cfg = json.loads(run.model.config_json) if run.model.config_json else {}  # the config.json as read
    stored = CHECKPOINT_BYTES.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or ""))
    if stored != run.weight_b:
        return x.weights
    return 0.0 if run.method.trains_base else trainable * 4.0


def run_phases(run, x: PhaseInputs, phases: RunPhases, weights_all: float,
               trainable: float) -> dict[str, tuple[float, float]]:
    """{phase: (per-GPU bytes the card must hold, per-node CPU RAM)}; on the CPU pseudo-device (one RAM:
    memfit.estimate.host.node_ram) loading and the step hold the step's figure, evaluation and the save (rank 0)
    their allocator-level peaks."""
    mode = save_mode(run.strategy, phases.save.mode)
    train_cpu = x.baseline + x.steady
    load_cpu = x.baseline + max(x.loading, x.steady + x.unpinned)
    if run.gpu.is_cpu:  # evaluation and the save at the allocator level (rank 0's): the step's heap holes stay,
        # so the RSS verdict is the step's
        at_rest = x._replace(split=0.0, fixed=0.0)
        # loading: the weights, in a process that has imported only what loading needs (no autograd, optimizer,
        # Trainer yet: its own measured baseline; PEFT's import for the methods PEFT builds)
        p = run.profile
        load_proc = p.process_baseline_load_cpu + (p.process_peft_import_cpu if run.method.fp32_adapters else 0.0)
        load_cpu = run.hardware.gpus_per_node * load_proc + max(x.loading, x.steady + x.unpinned)
        return _in_order(phases, (_resident_at_load(run, x, trainable), load_cpu), (x.train_gpu, train_cpu),
                         lambda: (eval_gpu(run, at_rest, phases), train_cpu),
                         (save_gpu(run, at_rest, mode, unit_bytes(run, weights_all))
                          + save_cpu(run, x, mode, weights_all, trainable, rank0=True) - x.baseline - x.steady,
                          train_cpu))
    load_gpu = max(x.gpu_loading, x.weights) + x.fixed

    def evaluation() -> tuple[float, float]:
        eval_cpu = train_cpu
        if not phases.eval.loss_only:  # get_arrays: every rank holds all of the logits as fp32 numpy at the end
            kept_batches(run, phases)  # the example count is given
            eval_cpu += run.hardware.gpus_per_node * phases.eval.examples * run.strategy.seq_len \
                * run.model.vocab * 4.0
        return eval_gpu(run, x, phases), eval_cpu

    return _in_order(phases, (load_gpu, load_cpu), (x.train_gpu, train_cpu), evaluation,
                     (save_gpu(run, x, mode, unit_bytes(run, weights_all)),
                      save_cpu(run, x, mode, weights_all, trainable)))


def _in_order(phases: RunPhases, load, step, evaluation, save) -> dict[str, tuple[float, float]]:
    """The phases in their order; evaluation priced only where the run evaluates (``eval.enabled``)."""
    out = {"load": load, "train_step": step}
    if phases.eval.enabled:
        out["eval"] = evaluation()
    out["save"] = save
    return out


ORDER = ("train_step", "load", "eval", "save")  # ties go to the training step


def priced(run, x: PhaseInputs, phases: RunPhases, weights_all: float, trainable: float,
           cpu: dict) -> tuple[dict, str, str]:
    """(the phases' figures, the phase setting the GPU peak, the one setting the CPU peak); ``cpu["total"]``
    becomes the largest phase's CPU RAM (the verdict's)."""
    figures = run_phases(run, x, phases, weights_all, trainable)
    # the CPU device's RAM verdict stays the step's: glibc keeps the step's heap (evaluation and the save are priced
    # at the allocator level there, for memfit measure's comparisons)
    gpu_phase = "train_step" if run.gpu.is_cpu else peak_phase(figures, 0)
    cpu_phase = peak_phase(figures, 1)
    cpu["total"] = figures[cpu_phase][1]
    return figures, gpu_phase, cpu_phase


def peak_phase(figures: dict, which: int) -> str:
    """The run phase with the largest figure (0: per-GPU, 1: per-node CPU RAM); the training step on a tie."""
    return max((k for k in ORDER if k in figures), key=lambda k: figures[k][which])


def forward_set(run, params, tokens: float, resid_b: float, attention: str) -> float:
    """One decoder layer's live set in a forward under ``torch.no_grad`` (nothing kept for backward), measured on
    the demo model (fp32, 8 x 128: the profiler's live blocks at the peak): inside the MLP its three
    intermediate-wide tensors (gated: the activation, the up projection and their product; two otherwise), or the
    attention's (eager: the fp32 scores and their softmax copy), + four hidden-wide ones (the embeddings' output,
    which LlamaModel.forward keeps in ``inputs_embeds``, the residual, the attention's output added, the norm's
    output); with adapters the widest adapted linear's lora_B output before it is added (dropout is off in
    ``model.eval()``). MoE experts run one after another on their share of the tokens."""
    model, e = run.model, run.value_b
    width = model.intermediate if not model.experts else (
        model.intermediate - model.experts_per_token * model.moe_intermediate
        + model.experts_per_token * model.moe_intermediate / model.experts)
    mlp = (3 if model.mlp in ("swiglu", "geglu") else 2) * tokens * width * e
    seq, d = run.strategy.seq_len, model.head_dim
    if attention == "eager":  # transformers' eager_attention_forward: q·kᵀ and its scaled copy, the causal mask
        # (batch x s x s), repeat_kv's copies of k and v at every head (grouped-query models), q and k after RoPE
        attn = tokens * model.heads * seq * 2.0 * e + tokens * seq * e + tokens * (model.heads + model.kv_heads) * d * e
        attn += 2.0 * tokens * model.heads * d * e if model.kv_heads < model.heads else 0.0
    else:  # q, k, v and the rotary copies of q and k
        attn = tokens * (2 * model.heads + 3 * model.kv_heads) * d * e
    adapter = max((lin.out_features for lin in model.linears if lin.name in params.adapted), default=0) * tokens * e
    return max(mlp + adapter, attn) + 4.0 * tokens * model.hidden * resid_b


def phase_inputs(run, states, bufs, saved, static: float, formula: float, split: float, fixed: float,
                 train_gpu: float, gpu_loading: float, cpu: dict, steady: float, params,
                 attention: str) -> PhaseInputs:
    """The step's figures the other run phases read (memfit.estimate.estimate's names)."""
    model, st = run.model, run.strategy
    e = run.value_b
    resid_b = 4.0 if (e == 4.0 or saved.autocast) else e
    layer = forward_set(run, params, st.micro_batch_size * st.seq_len, resid_b, attention)
    # the engine's units gathered for a forward, without the gradient buffers its layer buffers carry (FSDP1: a
    # unit's unsharded gradient + reduce-scatter output; FSDP2 and SHARD_GRAD_OP: the comm line)
    grads_in_layers = bufs.layer_comm if run.fsdp_version == 1 else (bufs.comm if run.fsdp else 0.0)
    layer_bufs = max(bufs.layer_bufs - grads_in_layers, 0.0)
    held_bufs = bufs.root_bufs + bufs.tail_bufs + states.autocast_copy
    procs = run.hardware.gpus_per_node
    unpinned = procs * (states.weights_all / run.world) if (
        run.fsdp_version == 1 and run.offload_params and not run.gpu.is_cpu) else 0.0
    # SHARD_GRAD_OP's parameters kept unsharded from the forward to the backward are resharded after it
    at_rest = static - (states.compute_all if run.strategy.fsdp == "shard_grad_op" else 0.0)
    adapter_param = 4.0 * run.strategy.lora_r * max(
        (max(lin.in_features, lin.out_features) for lin in model.linears if lin.name in params.adapted), default=0)
    return PhaseInputs(weights=states.weights, static=static, at_rest=at_rest, layer_bufs=layer_bufs,
                       held_bufs=held_bufs, layer_set=layer,
                       hidden=st.micro_batch_size * st.seq_len * model.hidden * resid_b,
                       logits=saved.logits - saved.head_grad, split=split / formula if formula else 0.0,
                       fixed=fixed, train_gpu=train_gpu, gpu_loading=gpu_loading,
                       baseline=cpu["process_baseline"], steady=steady, loading=cpu["model_loading"],
                       unpinned=unpinned, adapter_param=adapter_param if params.targets is not None else 0.0)


def settings(strategy, phases: RunPhases) -> dict:
    """The eval and save keys as priced (``--json``'s ``memory.phase_settings``; the run summary's)."""
    ev = phases.eval
    return {"eval": {"enabled": ev.enabled, "batch_size": ev.batch_size or strategy.micro_batch_size,
                     "loss_only": ev.loss_only,
                     "accumulation_steps": ev.accumulation_steps, "examples": ev.examples},
            "save": {"mode": save_mode(strategy, phases.save.mode)}}
