"""The Hugging Face ``Trainer`` for a RunSpec: TrainingArguments from the strategy, atomic checkpoints."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from transformers import Trainer, TrainingArguments

from memfit.errors import IncompatibleError
from memfit.train.checkpoint import AtomicCheckpointMixin

OPTIMIZERS = {"adamw": "adamw_torch", "adamw8bit": "adamw_bnb_8bit", "sgd": "sgd"}


class MemfitTrainer(AtomicCheckpointMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints appear only when complete, and which reports each
    training micro-batch's (rows, padded length) to ``batch_sink`` (a shape read: no device sync)."""

    batch_sink: Optional[Callable[[int, int], None]] = None
    sequence_shards: int = 1  # strategy.sequence_parallel: the adapter hands each rank 1/N of each row
    step_context: Optional[Callable[[], Any]] = None  # activation_offload=all: save_on_cpu (memfit.train.longctx)

    def training_step(self, model, inputs, num_items_in_batch=None):
        ids = inputs.get("input_ids") if self.batch_sink is not None and hasattr(inputs, "get") else None
        if ids is not None and getattr(ids, "ndim", 0) == 2:  # under Ulysses a rank holds 1/N of the row
            self.batch_sink(int(ids.shape[0]), int(ids.shape[1]) * self.sequence_shards)
        if self.step_context is not None:  # forward, loss and backward: what the forward saves is packed
            with self.step_context():
                return super().training_step(model, inputs, num_items_in_batch)
        return super().training_step(model, inputs, num_items_in_batch)


def precision_flags(precision: str) -> dict[str, bool]:
    """TrainingArguments autocast flags; pure ``bf16`` runs in the weights' dtype without autocast."""
    return {"bf16": precision == "bf16-mixed", "fp16": precision == "fp16-mixed"}


def training_arguments(run, output_dir: Path, has_eval: bool, engine: Any) -> TrainingArguments:
    """TrainingArguments for ``run``; the run's engine (memfit.distributed.engines) adds its own."""
    import torch

    s, t = run.strategy, run.training
    if s.optimizer == "adamw8bit" and importlib.util.find_spec("bitsandbytes") is None:
        raise IncompatibleError("strategy.optimizer=adamw8bit needs bitsandbytes; install it or use adamw")
    eval_strategy = "steps" if (has_eval and t.eval_interval) else "no"
    save = t.checkpoint_interval > 0
    report_to = ["tensorboard"] if importlib.util.find_spec("tensorboard") else "none"
    kwargs: dict[str, Any] = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=s.micro_batch_size,
        per_device_eval_batch_size=run.eval.batch_size or s.micro_batch_size,  # the run file's eval.batch_size
        gradient_accumulation_steps=s.grad_accum,
        max_steps=-1 if t.epochs else t.max_steps,
        num_train_epochs=t.epochs or 1.0,
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler,
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        optim=OPTIMIZERS[s.optimizer],
        logging_strategy="steps",
        logging_steps=t.logging_interval,
        logging_first_step=True,
        eval_strategy=eval_strategy,
        eval_steps=t.eval_interval or None,
        save_strategy="steps" if save else "no",
        save_steps=t.checkpoint_interval if save else 500,
        seed=t.seed,
        data_seed=t.seed,
        report_to=report_to,
        disable_tqdm=True,
        remove_unused_columns=False,
        include_num_input_tokens_seen="non_padding",
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),
        **precision_flags(s.precision),
    )
    kwargs.update(liger_kwargs(s))
    kwargs.update(engine.trainer_kwargs(run, Path(output_dir)))
    return TrainingArguments(**kwargs)


def liger_kwargs(s) -> dict[str, Any]:
    """``liger: true``: the Trainer applies Liger Kernel to the model (transformers 5.24 trainer.py
    ``apply_liger_kernel(self.model, args.liger_kernel_config)`` → liger_kernel's ``_apply_liger_kernel_to_instance``):
    RMSNorm, RoPE, the fused gate activation and the fused linear cross-entropy. Under the tiled MLP its SwiGLU
    stays off: Liger would replace the MLP forward memfit tiles (memfit.train.longctx). A CUDA GPU and the
    liger-kernel package (Triton) are needed; the plan's rules refuse it on the CPU."""
    if not s.liger:
        return {}
    if importlib.util.find_spec("liger_kernel") is None:
        raise IncompatibleError("strategy.liger=true needs the liger-kernel package (Triton kernels for GPUs): "
                                "pip install liger-kernel, or set liger: false")
    return {"use_liger_kernel": True,
            "liger_kernel_config": {"rope": True, "rms_norm": True, "swiglu": not s.tiled_mlp,
                                    "cross_entropy": False, "fused_linear_cross_entropy": True}}


def collator(run, tokenizer):
    """Right-padding collator. Sequence and context parallelism split each row's tokens over N ranks: every batch
    carries position_ids, no padding mask (pads sit after every real token and are labelled -100, so under the
    causal mask they change no loss) and a width divisible by the split:
    - Ulysses (N = sequence_parallel): UlyssesSPDataLoaderAdapter requires position_ids and a width divisible by
      N (deepspeed/runtime/sequence_parallel/ulysses_sp.py:666, :707) and its attention drops any mask
      (ulysses_sp.py:546); on the CPU every batch is padded to seq_len, because the adapter gathers each SP
      rank's batch at its own length (ulysses_sp.py:688-692) and gloo's all_gather takes equal shapes only
      ("ProcessGroupGloo::allgather: invalid tensor size"; NCCL takes uneven ones);
    - torch context parallelism (N = context_parallel): 2N load-balanced chunks per row, and a mask other than
      causal is refused (transformers/trainer.py:2457-2469)."""
    import torch

    from memfit.train.data import Collator

    pad = tokenizer.pad_token_id if tokenizer is not None else 0
    s = run.strategy
    if s.sequence_parallel > 1:
        sp = s.sequence_parallel
        width = None if torch.cuda.is_available() else -(-s.seq_len // sp) * sp
        return Collator(pad, pad_to_multiple_of=sp, positions=True, width=width, mask=False)
    if s.context_parallel > 1:
        return Collator(pad, pad_to_multiple_of=2 * s.context_parallel, positions=True, mask=False)
    return Collator(pad)


def build_trainer(run, engine, model, tokenizer, train_ds, eval_ds, output_dir: Path,
                  callbacks: Sequence = (), optimizer: Optional[Any] = None) -> MemfitTrainer:
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    args = training_arguments(run, output_dir, has_eval=eval_ds is not None, engine=engine)
    trainer = MemfitTrainer(
        model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
        data_collator=collator(run, tokenizer),
        processing_class=tokenizer,
        callbacks=list(callbacks), optimizers=(optimizer, None),
    )
    # memfit shows its own progress; the Trainer's printer would dump every log dict.
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    trainer.sequence_shards = run.strategy.sequence_parallel
    trainer.batch_sink = next((cb.record_batch for cb in callbacks if hasattr(cb, "record_batch")), None)
    engine.prepare_trainer(trainer, run)  # before the Trainer wraps the model (FSDP1: PEFT's wrap policy)
    return trainer
