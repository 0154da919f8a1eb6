"""How a run's strategy becomes the Hugging Face Trainer's engines (DeepSpeed ZeRO / FSDP2), per process.

The trainer calls, in this order:

1. :func:`prepare_process` before loading weights: joins the process group, so that ZeRO-3 loads the
   model already partitioned (``deepspeed.zero.Init``) and FSDP reads the weights on rank 0 only
   (RAM-efficient loading). The model builder asks :func:`skip_kbit_preparation` whether QLoRA must skip
   ``prepare_model_for_kbit_training`` (ZeRO-3 / FSDP) and then calls :func:`enable_input_grads`.
2. :func:`trainer_engine_kwargs` for ``TrainingArguments``: ``deepspeed=`` or ``fsdp=``/``fsdp_config=``;
   writes the DeepSpeed JSON / accelerate config actually used into the output folder.
3. :func:`save_trained` at the end: gathers the sharded weights (all ranks take part) and rank 0 writes
   the adapter or model folder.

GPU (NCCL) and CPU (gloo) take the same path. On CPU, accelerate does not set up DeepSpeed or FSDP by
itself (it knows them only on accelerators), so the process state is built here and marked for the
engine (see :func:`_join_process_group`); everything after that is the libraries' own code.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
from pathlib import Path
from typing import Any, Optional

from memfit.distributed import config as cfgs
from memfit.spec.run import RunSpec

_STATE: dict[str, Any] = {}  # what this process set up: {"prepared": bool, "hf_ds_config": ...}


def on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def device_kind() -> cfgs.Device:
    return "cuda" if on_cuda() else "cpu"


def is_sharded(run: RunSpec) -> bool:
    """True when DeepSpeed or FSDP drives the run (zero_stage>=1 or fsdp)."""
    return bool(run.strategy.zero_stage or run.strategy.fsdp)


def shards_parameters(run: RunSpec) -> bool:
    """ZeRO-3 and FSDP partition the parameters themselves (not only optimizer state / gradients)."""
    return run.strategy.zero_stage == 3 or bool(run.strategy.fsdp)


def skip_kbit_preparation(run: RunSpec) -> bool:
    """QLoRA under ZeRO-3 / FSDP must not call ``prepare_model_for_kbit_training``: it upcasts norms and
    embeddings to fp32 and the engines then cannot flatten parameters of mixed dtype. Enable gradient
    checkpointing and input gradients directly instead (:func:`enable_input_grads`)."""
    return run.strategy.method == "qlora" and shards_parameters(run)


def enable_input_grads(model: Any, gradient_checkpointing: bool, gc_kwargs: Optional[dict] = None) -> None:
    """What k-bit preparation would do that sharded QLoRA still needs: checkpointing and input grads."""
    if gradient_checkpointing:
        kwargs = gc_kwargs or {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()


def hidden_size_of(run: RunSpec) -> Optional[int]:
    """hidden_size from the run's model folder (bucket sizes scale with hidden²); None if unknown."""
    p = Path(run.model).expanduser()
    p = p.parent if p.name == "config.json" else p
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return None
    h = cfg.get("hidden_size") or (cfg.get("text_config") or {}).get("hidden_size")
    return int(h) if h else None


def launched_world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def engine_deepspeed_config(run: RunSpec) -> dict:
    """The DeepSpeed config for this process: this device, the model's hidden size, the launched world."""
    ds = cfgs.deepspeed_config(run, device=device_kind(), hidden_size=hidden_size_of(run))
    s = run.strategy
    ds["train_batch_size"] = s.micro_batch_size * s.grad_accum * launched_world_size()
    return ds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_env() -> None:
    """A one-process group for DeepSpeed / FSDP started without a launcher (python -m memfit.train)."""
    env = os.environ
    if "LOCAL_RANK" in env or "RANK" in env:
        return
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(_free_port()))


def _join_process_group(run: RunSpec) -> None:
    """Build accelerate's process state for the run's engine before the Trainer does.

    On CUDA this is what accelerate does itself (NCCL; DeepSpeed's comm for ZeRO). On CPU accelerate
    would give gloo and a plain multi-CPU state, where it refuses DeepSpeed and FSDP; the state is then
    marked DEEPSPEED (engine set up by accelerate's DeepSpeed plugin) or MULTI_GPU (the only state from
    which accelerate enables its FSDP plugin). The device stays the CPU.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    s = run.strategy
    _single_process_env()
    AcceleratorState._reset_state(reset_partial_state=True)
    cuda = on_cuda()
    if s.zero_stage and cuda:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        try:
            state = PartialState()
        finally:
            del os.environ["ACCELERATE_USE_DEEPSPEED"]
    else:
        state = PartialState(cpu=not cuda)
    if not cuda:
        state.distributed_type = DistributedType.DEEPSPEED if s.zero_stage else DistributedType.MULTI_GPU
        if s.zero_stage:  # DeepSpeed's comm layer adopts the gloo group (zero.Init reads its world size)
            from deepspeed import comm

            comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)


def _fsdp_env(run: RunSpec) -> None:
    """What ``accelerate launch`` exports for FSDP; transformers reads it while loading weights."""
    f = cfgs.fsdp_trainer_config(run)
    os.environ["ACCELERATE_USE_FSDP"] = "true"
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = str(f["cpu_ram_efficient_loading"]).lower()
    os.environ["FSDP_OFFLOAD_PARAMS"] = str(f["cpu_offload"]).lower()
    os.environ["FSDP_STATE_DICT_TYPE"] = f["state_dict_type"]


def _clear_engine_env() -> None:
    # The Accelerator exports ACCELERATE_USE_DEEPSPEED / _FSDP and never unsets them: a later run in this
    # process would inherit the previous run's engine.
    for key in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING",
                "FSDP_OFFLOAD_PARAMS", "FSDP_STATE_DICT_TYPE"):
        os.environ.pop(key, None)


def prepare_process(run: RunSpec) -> None:
    """Call before loading weights. Plain runs: nothing. DeepSpeed / FSDP: join the process group;
    ZeRO-3 registers its config so ``from_pretrained`` partitions weights as it loads them; FSDP exports
    accelerate's loading settings (rank 0 reads the weights, the others start on the meta device). Safe
    to call again for another run in the same process (the previous run's engine state is dropped)."""
    _clear_engine_env()
    _STATE.pop("hf_ds_config", None)
    try:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    except ImportError:  # pragma: no cover - transformers without DeepSpeed glue
        pass
    _STATE["prepared"] = False
    if not _STATE.get("atexit"):  # any process group this process joins (DDP's too) is left cleanly
        atexit.register(shutdown)
        _STATE["atexit"] = True
    if not is_sharded(run):
        return
    if run.strategy.fsdp:  # before the process group: accelerate picks "cuda:nccl,cpu:gloo" from it
        _fsdp_env(run)
    _join_process_group(run)
    if run.strategy.zero_stage == 3:
        from transformers.integrations.deepspeed import HfDeepSpeedConfig

        # transformers holds a weak reference: keep it alive for the whole run.
        _STATE["hf_ds_config"] = HfDeepSpeedConfig(engine_deepspeed_config(run))
    _STATE["prepared"] = True


def shutdown() -> None:
    """Leave the process group cleanly (DeepSpeed runs can abort at interpreter exit otherwise)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def _write_atomic(text: str, path: Path) -> None:
    from memfit.io import write_text

    write_text(path, text)


def write_engine_configs(run: RunSpec, output_dir: Path) -> list[Path]:
    """The DeepSpeed JSON (ZeRO runs) and the accelerate config this run uses, in ``output_dir``."""
    import yaml

    out = Path(output_dir)
    written = []
    ds_file = None
    if run.strategy.zero_stage:
        ds_file = out / cfgs.DEEPSPEED_FILE
        _write_atomic(json.dumps(engine_deepspeed_config(run), indent=2) + "\n", ds_file)
        written.append(ds_file)
    acc = cfgs.accelerate_config(run, device=device_kind(),
                                 deepspeed_config_file=str(ds_file.resolve()) if ds_file else None)
    acc_file = out / cfgs.ACCELERATE_FILE
    header = ("# Written by memfit for this run. Rerun on GPU machines with:\n"
              f"#   accelerate launch --config_file {acc_file.name} -m memfit.train run.yaml\n"
              "# (on the CPU, accelerate does not launch DeepSpeed: use `memfit launch run.yaml`)\n")
    _write_atomic(header + yaml.safe_dump(acc, sort_keys=False), acc_file)
    written.append(acc_file)
    return written


def _is_main_process() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def trainer_engine_kwargs(run: RunSpec, output_dir: Path) -> dict[str, Any]:
    """Extra ``TrainingArguments`` keyword arguments for the run's sharding engine (none for DDP)."""
    if not is_sharded(run):
        return {}
    if not _STATE.pop("prepared", False):  # the trainer did not call prepare_process for this run
        prepare_process(run)
        _STATE["prepared"] = False
    if _is_main_process():
        write_engine_configs(run, output_dir)
    # The process state was built by prepare_process: the Trainer must use it, not rebuild its own.
    # (use_cpu stays the trainer's: on the CPU it only turns off pinning and allows CPU bf16.)
    kwargs: dict[str, Any] = {"accelerator_config": {"use_configured_state": True}}
    if run.strategy.zero_stage:
        ds = engine_deepspeed_config(run)
        kwargs.update(deepspeed=ds, bf16=ds["bf16"]["enabled"], fp16=ds["fp16"]["enabled"])
    else:
        kwargs.update(fsdp=True, fsdp_config=cfgs.fsdp_trainer_config(run))
    return kwargs


def gathered_state_dict(trainer: Any, run: RunSpec) -> dict:
    """The full state dict of a sharded model; every rank must call this (collective gathers)."""
    acc = trainer.accelerator
    if run.strategy.zero_stage:
        engine = trainer.model_wrapped
        if run.strategy.zero_stage == 3 and run.strategy.trains_adapter:
            # PEFT under ZeRO-3: gather only the trained (adapter) parameters, not the frozen base.
            return engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
        return acc.get_state_dict(engine)
    return acc.get_state_dict(trainer.model)


def save_trained(trainer: Any, run: RunSpec, tokenizer: Any, out: Path) -> Optional[Path]:
    """Gather and save the trained adapter (lora/qlora) or model (full) under ZeRO / FSDP.

    All ranks must call it; rank 0 writes ``out/adapter`` or ``out/model`` atomically and returns the
    path, the other ranks return None. Without the gather a ZeRO-3 rank holds only its shard and
    ``save_pretrained`` would write near-empty tensors.
    """
    import torch.distributed as dist

    from memfit.io import atomic_dir

    if run.strategy.method not in ("lora", "qlora", "full"):
        return None
    state_dict = gathered_state_dict(trainer, run)
    dst = Path(out) / ("model" if run.strategy.method == "full" else "adapter")
    saved = None
    if _is_main_process():
        model = trainer.accelerator.unwrap_model(trainer.model)
        state_dict = {k: v.detach().cpu() for k, v in state_dict.items()}
        with atomic_dir(dst) as tmp:
            model.save_pretrained(str(tmp), state_dict=state_dict, safe_serialization=True)
            if tokenizer is not None:  # measure trains on token ids, without one
                tokenizer.save_pretrained(str(tmp))
        saved = dst
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return saved
