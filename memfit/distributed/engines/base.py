"""What every engine shares: the per-process state, leaving the process group, rank 0, the accelerate
config file, and the :class:`Engine` interface the trainer calls.

The trainer calls, in this order (``engine = engines.for_run(run)``):

1. ``engine.join(run)`` before loading weights: joins the process group where the engine needs it, so
   that ZeRO-3 loads the model already partitioned (``deepspeed.zero.Init``) and FSDP reads the weights on
   rank 0 only (RAM-efficient loading). Safe to call again for another run in the same process.
2. the method's build step asks ``engine.flattens_parameters`` (ZeRO-3 / FSDP: QLoRA must not upcast
   norms to fp32, and the 4-bit weights are placed by the engine, not by ``device_map``);
3. ``engine.trainer_kwargs(run, output_dir)`` for ``TrainingArguments`` (``deepspeed=`` or
   ``fsdp=``/``fsdp_config=``); rank 0 writes the DeepSpeed JSON / accelerate config used;
4. ``engine.gathered_state_dict(trainer, run)`` on every rank at the end (collective gathers; None
   where each rank already holds the whole model), then rank 0 saves, then ``engine.barrier()``.

GPU (NCCL) and CPU (gloo) take the same path. torch is imported inside the functions, not here.
"""

from __future__ import annotations

import atexit
import json
import os
from pathlib import Path
from typing import Any, Optional

from memfit.distributed import config as cfgs
from memfit.distributed.ranks import barrier, is_main_process, release_world_refs
from memfit.errors import MemfitError
from memfit.spec.run import RunSpec

_STATE: dict[str, Any] = {}  # what this process set up: {"prepared": bool, "hf_ds_config": ..., "atexit": bool}


def on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def device_kind() -> cfgs.Device:
    return "cuda" if on_cuda() else "cpu"




def hidden_size_of(run: RunSpec) -> Optional[int]:
    """The run's model's hidden size (bucket sizes scale with hidden²); None where it cannot be read."""
    from memfit.spec.model import resolve_model

    try:
        return resolve_model(run.model).hidden
    except MemfitError:
        return None


def shutdown() -> None:
    """Leave the process group cleanly (DeepSpeed runs can abort at interpreter exit otherwise)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            release_world_refs()
    except Exception:  # noqa: BLE001 - best effort at interpreter exit
        pass


def write_text_atomic(text: str, path: Path) -> Path:
    from memfit.io import write_text

    return write_text(Path(path), text)


def accelerate_file_text(run: RunSpec, device: cfgs.Device, deepspeed_config_file: Optional[str] = None,
                         header: bool = False, layer_cls: Optional[str] = None) -> str:
    import yaml

    acc = cfgs.accelerate_config(run, device=device, deepspeed_config_file=deepspeed_config_file,
                                 layer_cls=layer_cls)
    head = ("# Written by memfit for this run. Rerun on GPU machines with:\n"
            f"#   accelerate launch --config_file {cfgs.ACCELERATE_FILE} -m memfit.train run.yaml\n"
            "# (on the CPU, accelerate does not launch DeepSpeed: use `memfit launch run.yaml`)\n")
    return (head if header else "") + yaml.safe_dump(acc, sort_keys=False)


class Engine:
    """DDP (the default): every rank holds the whole model; the Trainer wraps it itself."""

    name = "ddp"
    sharded = False              # DeepSpeed / FSDP drive the run
    flattens_parameters = False  # ZeRO-3 / FSDP partition parameters (flattened to one dtype)

    # ---------------------------------------------------------------- files (plan --emit, launch)
    def config(self, run: RunSpec, *, device: cfgs.Device = "cuda", hidden_size: Optional[int] = None) -> dict:
        """The engine's own configuration mapping (the DeepSpeed JSON, FSDP's fsdp_config); {} for DDP."""
        return {}

    def emitted_files(self, run: RunSpec, *, device: cfgs.Device, hidden_size: Optional[int]) -> dict[str, str]:
        """{file name: text} that ``plan --emit`` writes next to run.yaml."""
        return {}

    # ---------------------------------------------------------------- the engine's own limits
    def reasons(self, run: RunSpec, *, cpu: bool) -> list[str]:
        """What this engine cannot run (installed, offload combinations, the CPU device)."""
        return []

    # ---------------------------------------------------------------- one process
    def join(self, run: RunSpec) -> None:
        """Before loading weights: drop any previous run's engine state, then join as this engine needs."""
        for key in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING",
                    "FSDP_OFFLOAD_PARAMS", "FSDP_STATE_DICT_TYPE"):
            # the Accelerator exports these and never unsets them: a later run would inherit them
            os.environ.pop(key, None)
        _STATE.pop("hf_ds_config", None)
        try:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        except ImportError:  # pragma: no cover - transformers without DeepSpeed glue
            pass
        _STATE["prepared"] = False
        from memfit.distributed.parallelism import reset_sequence_parallel

        reset_sequence_parallel()  # an earlier Ulysses run's groups and attention function
        if not _STATE.get("atexit"):  # any process group this process joins (DDP's too) is left cleanly
            atexit.register(shutdown)
            _STATE["atexit"] = True
        self._join(run)
        _STATE["prepared"] = self.sharded

    def _join(self, run: RunSpec) -> None:
        """DDP: the Trainer (accelerate) joins the group itself."""

    def trainer_kwargs(self, run: RunSpec, output_dir: Path) -> dict[str, Any]:
        """Extra ``TrainingArguments`` keyword arguments; rank 0 writes the config files used. DDP: the
        group accelerate builds gives up a collective after ``distributed.timeout_s``."""
        return {"ddp_timeout": run.distributed.timeout_s}

    def write_configs(self, run: RunSpec, output_dir: Path) -> list[Path]:
        """The config files this run uses, in ``output_dir`` (rank 0)."""
        return []

    def prepare_trainer(self, trainer: Any, run: RunSpec) -> None:
        """After the Trainer is built, before it wraps the model (FSDP1: PEFT's wrap policy)."""

    # ---------------------------------------------------------------- saving
    def gathered_state_dict(self, trainer: Any, run: RunSpec) -> Optional[dict]:
        """The full state dict to save, gathered from the shards (every rank calls it); None when the
        unwrapped model already holds whole tensors."""
        return None

    def barrier(self) -> None:
        barrier()


def _sharded_trainer_kwargs(engine: Engine, run: RunSpec, output_dir: Path) -> dict[str, Any]:
    """What DeepSpeed and FSDP share: the process state is the one ``join`` built."""
    if not _STATE.pop("prepared", False):  # the trainer did not call join for this run
        engine.join(run)
        _STATE["prepared"] = False
    if is_main_process():
        engine.write_configs(run, Path(output_dir))
    # The Trainer must use the process state join built, not rebuild its own. (use_cpu stays the
    # trainer's: on the CPU it only turns off pinning and allows CPU bf16.)
    return {"accelerator_config": {"use_configured_state": True}, "ddp_timeout": run.distributed.timeout_s}


def dump_json(obj: Any) -> str:
    return json.dumps(obj, indent=2) + "\n"
