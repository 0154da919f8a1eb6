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

    def training_step(self, model, inputs, num_items_in_batch=None):
        ids = inputs.get("input_ids") if self.batch_sink is not None and hasattr(inputs, "get") else None
        if ids is not None and getattr(ids, "ndim", 0) == 2:
            self.batch_sink(int(ids.shape[0]), int(ids.shape[1]))
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
    kwargs.update(engine.trainer_kwargs(run, Path(output_dir)))
    return TrainingArguments(**kwargs)


def build_trainer(run, engine, model, tokenizer, train_ds, eval_ds, output_dir: Path,
                  callbacks: Sequence = (), optimizer: Optional[Any] = None) -> MemfitTrainer:
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from memfit.train.data import Collator

    args = training_arguments(run, output_dir, has_eval=eval_ds is not None, engine=engine)
    trainer = MemfitTrainer(
        model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
        data_collator=Collator(tokenizer.pad_token_id if tokenizer is not None else 0),
        processing_class=tokenizer,
        callbacks=list(callbacks), optimizers=(optimizer, None),
    )
    # memfit shows its own progress; the Trainer's printer would dump every log dict.
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    trainer.batch_sink = next((cb.record_batch for cb in callbacks if hasattr(cb, "record_batch")), None)
    engine.prepare_trainer(trainer, run)  # before the Trainer wraps the model (FSDP1: PEFT's wrap policy)
    return trainer
