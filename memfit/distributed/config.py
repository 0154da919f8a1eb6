"""The engines' own configuration for a run: a DeepSpeed JSON, an accelerate config, a Trainer fsdp_config.

Plain Python, no torch: ``memfit plan --emit`` writes these files, and the trainer feeds the same dicts to
the Hugging Face Trainer (see :mod:`memfit.distributed.engines`). A user can rerun a run with the engines'
own launchers, e.g. ``accelerate launch --config_file accelerate.yaml -m memfit.train run.yaml``.

``device`` is ``"cuda"`` (the default, what a plan for GPUs emits) or ``"cpu"`` (gloo, as in CI): on CPU
there is nothing to pin or overlap, and DeepSpeed's fused CPU Adam (a C++ build) is not required.
"""

from __future__ import annotations

from typing import Any, Literal

from memfit.estimate.constants import DEFAULT_PROFILE
from memfit.spec.run import DEFAULT_PORT, RunSpec

Device = Literal["cuda", "cpu"]

# The DeepSpeed sizes written here are the estimator's (memfit.estimate.constants.Profile, with their
# sources), so the files memfit emits run what the estimate counts: the ZeRO-1/2 all-gather bucket when the
# run file sets none (zero_allgather_bucket_elements), ZeRO-3's live / reuse limits on gathered elements.
DEFAULT_ALLGATHER_BUCKET = int(DEFAULT_PROFILE.zero_allgather_bucket_elements)
STAGE3_MAX_LIVE_PARAMETERS = int(DEFAULT_PROFILE.zero3_max_live_parameters)
STAGE3_MAX_REUSE_DISTANCE = int(DEFAULT_PROFILE.zero3_max_reuse_distance)
# AdamW defaults of the Trainer (TrainingArguments.adam_beta1/2, adam_epsilon); DeepSpeed checks they match.
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8

DEEPSPEED_FILE = "deepspeed.json"
ACCELERATE_FILE = "accelerate.yaml"


def world_size(run: RunSpec) -> int:
    """Processes over all nodes: ``distributed.nproc × distributed.nodes``."""
    return run.distributed.nproc * run.distributed.nodes


def precision_flags(run: RunSpec) -> tuple[bool, bool]:
    """(bf16, fp16) as the Trainer's TrainingArguments and DeepSpeed see them."""
    p = run.strategy.precision
    return p in ("bf16-mixed", "bf16"), p == "fp16-mixed"


def reduce_bucket_size(run: RunSpec, hidden_size: int | None = None) -> int | str:
    """The run's reduce bucket (elements); default hidden², or ``"auto"`` (the Trainer fills hidden²)."""
    if run.distributed.reduce_bucket_size:
        return run.distributed.reduce_bucket_size
    return hidden_size * hidden_size if hidden_size else "auto"


def allgather_bucket_size(run: RunSpec) -> int:
    return run.distributed.allgather_bucket_size or DEFAULT_ALLGATHER_BUCKET


def _offload(device: Device) -> dict[str, Any]:
    return {"device": "cpu", "pin_memory": device == "cuda"}


def deepspeed_config(run: RunSpec, *, device: Device = "cuda", hidden_size: int | None = None) -> dict:
    """The DeepSpeed JSON for the run's ZeRO stage (1–3), offload, buckets, precision and batch.

    Batch, accumulation, clipping and precision are the run's own values (the Trainer checks they match
    its arguments). With optimizer offload on GPU the optimizer is DeepSpeed's (fused CPU AdamW, 32-bit);
    elsewhere the Trainer's optimizer is used (``zero_force_ds_cpu_optimizer: false``).
    """
    s, t = run.strategy, run.training
    if not s.zero_stage:
        raise ValueError("deepspeed_config needs strategy.zero_stage >= 1")
    bf16, fp16 = precision_flags(run)
    zero: dict[str, Any] = {"stage": s.zero_stage, "contiguous_gradients": True,
                            "overlap_comm": device == "cuda",
                            "reduce_bucket_size": reduce_bucket_size(run, hidden_size)}
    if s.zero_stage < 3:
        zero.update(allgather_partitions=True, reduce_scatter=True,
                    allgather_bucket_size=allgather_bucket_size(run))
    else:
        rb = zero["reduce_bucket_size"]
        prefetch = int(DEFAULT_PROFILE.zero3_prefetch_per_h2 * rb) if isinstance(rb, int) else "auto"
        zero.update(
            stage3_prefetch_bucket_size=prefetch,
            stage3_param_persistence_threshold=10 * hidden_size if hidden_size else "auto",
            stage3_max_live_parameters=STAGE3_MAX_LIVE_PARAMETERS,
            stage3_max_reuse_distance=STAGE3_MAX_REUSE_DISTANCE,
            # Saving gathers the full 16-bit weights (adapters included) instead of rank-local shards.
            stage3_gather_16bit_weights_on_model_save=True,
        )
    if s.offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = _offload(device)
    if s.offload == "optimizer+params":
        zero["offload_param"] = _offload(device)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": s.micro_batch_size,
        "gradient_accumulation_steps": s.grad_accum,
        "train_batch_size": s.micro_batch_size * s.grad_accum * world_size(run),
        "gradient_clipping": t.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": fp16, "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }
    if s.offload != "none" and s.optimizer == "adamw" and device == "cuda":
        cfg["optimizer"] = {"type": "AdamW", "params": {
            "lr": t.learning_rate, "betas": list(ADAM_BETAS), "eps": ADAM_EPS,
            "weight_decay": t.weight_decay, "adam_w_mode": True}}
    else:
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


def fsdp_trainer_config(run: RunSpec, device: Device = "cuda") -> dict:
    """``TrainingArguments(fsdp=True, fsdp_config=...)`` for the run: FSDP2 (``fully_shard``) or FSDP1
    (``FullyShardedDataParallel``), as ``strategy.fsdp_version`` says.

    full_shard reshards parameters after forward, shard_grad_op keeps them gathered until backward;
    offload moves parameters, gradients and optimizer state to CPU (FSDP2 ``CPUOffloadPolicy``, FSDP1
    ``CPUOffload(offload_params=True)``); rank 0 alone reads the weights and broadcasts them (RAM-efficient
    loading); checkpoints are sharded (torch.distributed.checkpoint, one folder, every rank writes its part);
    the final adapter/model is gathered into one file by the trainer (``Engine.gathered_state_dict``,
    :mod:`memfit.distributed.engines`).

    FSDP1 is configured as accelerate's FSDP plugin, fms-hf-tuning, Answer.AI's train.py and the PEFT FSDP +
    QLoRA guide run it (transformers/training_args.py reads these keys for ``version: 1``): each decoder layer
    its own unit (TRANSFORMER_BASED_WRAP; memfit adds PEFT's ``fsdp_auto_wrap_policy`` for adapter methods,
    so adapters are units of their own: memfit.distributed.engines.fsdp), ``use_orig_params``,
    ``limit_all_gathers``, BACKWARD_PRE prefetch, no forward prefetch, ``sync_module_states`` with
    ``cpu_ram_efficient_loading``. On the CPU (gloo) FSDP1 refuses ``sync_module_states`` (it broadcasts from
    a GPU: torch/distributed/fsdp/_init_utils.py ``_check_module_states_for_sync_module_states``), and
    accelerate refuses RAM-efficient loading without it, so every rank loads there.
    """
    s = run.strategy
    if not s.fsdp:
        raise ValueError("fsdp_trainer_config needs strategy.fsdp")
    if s.fsdp_version == 1:
        sync = device == "cuda"
        return {
            "version": 1,
            "reshard_after_forward": s.fsdp,  # FSDP1: the sharding strategy's name (full_shard | shard_grad_op)
            "cpu_offload": s.offload != "none",
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "use_orig_params": True,
            "limit_all_gathers": True,
            "backward_prefetch": "BACKWARD_PRE",
            "forward_prefetch": False,
            "sync_module_states": sync,
            "cpu_ram_efficient_loading": sync,
            "state_dict_type": "SHARDED_STATE_DICT",
        }
    return {
        "version": 2,
        "reshard_after_forward": s.fsdp == "full_shard",
        "cpu_offload": s.offload != "none",
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "cpu_ram_efficient_loading": True,
        "state_dict_type": "SHARDED_STATE_DICT",
    }


def _accelerate_fsdp_section(run: RunSpec, device: Device, layer_cls: str | None) -> dict:
    """``fsdp_config`` of an accelerate config file (key names of accelerate 1.15's
    commands/config/cluster.py and utils/launch.py, which exports them as FSDP_* for the plugin)."""
    s = run.strategy
    f = fsdp_trainer_config(run, device)
    if s.fsdp_version == 1:
        out: dict[str, Any] = {
            "fsdp_version": 1,
            "fsdp_reshard_after_forward": s.fsdp.upper(),  # FSDP1: FULL_SHARD | SHARD_GRAD_OP
            "fsdp_offload_params": f["cpu_offload"],
            "fsdp_auto_wrap_policy": f["auto_wrap_policy"],
        }
        if layer_cls:
            out["fsdp_transformer_layer_cls_to_wrap"] = layer_cls
        out.update({
            "fsdp_use_orig_params": f["use_orig_params"],
            "fsdp_sync_module_states": f["sync_module_states"],
            "fsdp_cpu_ram_efficient_loading": f["cpu_ram_efficient_loading"],
            "fsdp_backward_prefetch": f["backward_prefetch"],
            "fsdp_forward_prefetch": f["forward_prefetch"],
            "fsdp_state_dict_type": f["state_dict_type"],
            "fsdp_activation_checkpointing": False,
        })
        return out
    return {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": f["reshard_after_forward"],
        "fsdp_offload_params": f["cpu_offload"],
        "fsdp_auto_wrap_policy": f["auto_wrap_policy"],
        "fsdp_cpu_ram_efficient_loading": f["cpu_ram_efficient_loading"],
        "fsdp_state_dict_type": f["state_dict_type"],
        "fsdp_activation_checkpointing": False,
    }


def accelerate_config(run: RunSpec, *, device: Device = "cuda",
                      deepspeed_config_file: str | None = None, layer_cls: str | None = None) -> dict:
    """An ``accelerate launch --config_file`` mapping for the run (one file per node: machine_rank).

    With ``deepspeed_config_file`` the DeepSpeed section points at that JSON (what memfit writes next to
    it); without, the equivalent plugin keys are inlined. ``layer_cls``: the decoder layer's class name
    (FSDP1's ``fsdp_transformer_layer_cls_to_wrap``; without it accelerate reads ``_no_split_modules``).
    """
    s, d = run.strategy, run.distributed
    bf16, fp16 = precision_flags(run)
    n = world_size(run)
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "num_machines": d.nodes,
        "num_processes": n,
        "machine_rank": d.node_rank,
        "main_process_ip": d.master_addr,
        "main_process_port": DEFAULT_PORT if d.master_port is None else d.master_port,
        "rdzv_backend": "static",
        "same_network": True,
        "mixed_precision": "bf16" if bf16 else "fp16" if fp16 else "no",
        "use_cpu": device == "cpu",
        "debug": False,
    }
    if s.zero_stage:
        cfg["distributed_type"] = "DEEPSPEED"
        if deepspeed_config_file:
            ds: dict[str, Any] = {"deepspeed_config_file": deepspeed_config_file}
        else:
            ds = {"zero_stage": s.zero_stage, "gradient_accumulation_steps": s.grad_accum,
                  "gradient_clipping": run.training.max_grad_norm,
                  "offload_optimizer_device": "cpu" if s.offload != "none" else "none",
                  "offload_param_device": "cpu" if s.offload == "optimizer+params" else "none"}
            if s.zero_stage == 3:
                ds["zero3_save_16bit_model"] = True
        if s.zero_stage == 3:
            ds["zero3_init_flag"] = True
        cfg["deepspeed_config"] = ds
    elif s.fsdp:
        cfg["distributed_type"] = "FSDP"
        cfg["fsdp_config"] = _accelerate_fsdp_section(run, device, layer_cls)
    else:
        cfg["distributed_type"] = ("MULTI_CPU" if device == "cpu" else "MULTI_GPU") if n > 1 else "NO"
    return cfg
