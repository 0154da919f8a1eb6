"""MEFT (:mod:`memfit.meft`): a sparse adapter beside every FFN, its parameters and Adam state in CPU
memory, updated by its own CPU AdamW; plain DDP only."""

from __future__ import annotations

from typing import Any

from memfit.methods.base import AdapterMemory, Method, Parameters, Traffic, enable_checkpointing
from memfit.methods.meft.memory import meft_experts, meft_memory, meft_traffic_bytes
from memfit.methods.meft.config import MeftSettings
from memfit.methods.types import ModelLike, NumbersLike, ProfileLike, StrategyLike

# MEFT keeps fp32 keys/values, their gradients and Adam's two moments in CPU memory.
MEFT_CPU_BYTES_PER_PARAM = 16


class Meft(Method):
    name = family = "meft"
    output = "meft"
    fields = tuple(MeftSettings.model_fields)  # memfit/methods/meft/config.py

    # ---------------------------------------------------------------- the estimator's terms
    def parameters(self, model: ModelLike, strategy: StrategyLike, profile: ProfileLike, numbers: NumbersLike,
                   half: float) -> Parameters:
        """The router (hidden x experts per layer) is trained on the GPU; the adapter lives on the CPU."""
        experts = meft_experts(strategy.meft_neurons, strategy.meft_experts)
        return Parameters(float(model.layers * model.hidden * experts), float(model.parameters) * half,
                          tensors=float(model.layers),  # one router per layer
                          outside=2.0 * model.layers * strategy.meft_neurons * model.hidden)  # keys and values

    def adapter_memory(self, model: ModelLike, strategy: StrategyLike, profile: ProfileLike, numbers: NumbersLike,
                       params: Parameters, *,
                       compute_bytes: float, cast_bytes: float, mask_bytes: float, rank_bytes: float,
                       on_cpu: bool) -> AdapterMemory:
        buffers, saved, host, rows = meft_memory(model, strategy, profile, compute_bytes, on_cpu)
        moved = meft_traffic_bytes(model, strategy, profile)
        return AdapterMemory(0.0, buffers, saved, host, rows, router=params.trainable, traffic=Traffic(
            moved["h2d"], moved["d2h"], meft_experts(strategy.meft_neurons, strategy.meft_experts)))

    def plan_note(self, estimate: Any) -> str:
        """What MEFT buys (its trainable share, kept off the GPU) and what it is for, with memfit's own result."""
        e, model = estimate, estimate.model
        share = e.trainable_parameters / model.parameters if model.parameters else 0.0
        return (f"MEFT trains {e.trainable_parameters / 1e9:.2f} B parameters ({share:.0%} of the model) while "
                f"its adapter store ({e.cpu.get('meft_store', 0.0) / 1e9:.1f} GB) stays in CPU RAM and only the "
                f"activated rows travel ({e.gpu.get('meft_buffers', 0.0) / 1e9:.2f} GB of buffers on the GPU): its "
                "case is knowledge-heavy data (the paper: NQ, SQuAD, ToolBench); memfit's miniature (3 seeds, rates "
                "picked on held-out facts) matched a dense adapter of the same size at 28% of its GPU bytes (32 of 256 "
                "neurons active per token, buffered) and, against a LoRA of about equal GPU bytes, tied at 128 facts; "
                "at 512 facts it recalled more at the smallest size (70% vs 59%) and tied at 4x those bytes "
                "(docs/meft.md).")

    def rules(self, model: Any, hardware: Any, strategy: Any) -> list[str]:
        s = strategy
        if s.zero_stage or s.fsdp:
            return [f"method=meft with {s.engine}: MEFT keeps its adapter and optimizer in CPU memory and "
                    "updates them with its own CPU Adam, so it runs with plain DDP only; set zero_stage=0 "
                    "and fsdp=false"]
        if s.meft_top_k > s.meft_neurons:
            return [f"method=meft: meft_top_k={s.meft_top_k} exceeds meft_neurons={s.meft_neurons} (a token "
                    "cannot activate more neurons than exist); lower --meft-top-k or raise --meft-neurons"]
        if s.optimizer != "adamw":
            return [f"method=meft with optimizer={s.optimizer}: MEFT's CPU-resident adapter is updated by a "
                    "CPU AdamW; use optimizer=adamw"]
        ram = hardware.cpu_ram_bytes
        if ram and model.hidden and model.layers:
            ranks = hardware.gpus_per_node  # each process keeps its own store (NxCPU pools share one RAM)
            need = 2 * model.hidden * s.meft_neurons * model.layers * MEFT_CPU_BYTES_PER_PARAM * ranks
            if need > ram:
                return [f"method=meft: the CPU store of {s.meft_neurons} neurons x {model.layers} layers needs "
                        f"{need / 1e9:.1f} GB of CPU RAM per node ({ranks} process(es)), the node has "
                        f"{ram / 1e9:.1f} GB; lower meft_neurons or give more --cpu-ram"]
        return []

    def config(self, strategy: Any):
        from memfit.meft import MeftConfig

        s = strategy
        return MeftConfig(neurons=s.meft_neurons, top_k=s.meft_top_k, experts=s.meft_experts, n_probe=s.meft_n_probe,
                          buffer_size=s.meft_buffer_size)

    def build(self, model: Any, run: Any, engine: Any) -> tuple[Any, list[str]]:
        from memfit.meft import add_meft

        for p in model.parameters():
            p.requires_grad_(False)
        if run.strategy.gradient_checkpointing:
            enable_checkpointing(model)
        return add_meft(model, self.config(run.strategy)) or model, []

    def optimizer(self, model: Any, training: Any) -> Any:
        from memfit.meft import build_meft_optimizer

        # The Trainer's own clipping only sees device parameters: the MEFT optimizer clips the CPU tables too.
        return build_meft_optimizer(model, lr=training.learning_rate, weight_decay=training.weight_decay,
                                    max_grad_norm=training.max_grad_norm or None)

    def callbacks(self, model: Any) -> list[Any]:
        from transformers import TrainerCallback

        from memfit.meft import traffic

        class MeftTraffic(TrainerCallback):
            """Adds MEFT's CPU↔device traffic counters (memfit.meft.traffic) to each log line."""

            def on_log(self, args, state, control, logs=None, **kw):
                if logs is not None:
                    data = traffic(model)
                    data = data.to_dict() if hasattr(data, "to_dict") else data
                    logs.update({f"meft_{k}": v for k, v in data.items() if isinstance(v, (int, float))})

        return [MeftTraffic()]

    def save(self, model: Any, tokenizer: Any, folder, state_dict=None) -> None:
        from memfit.meft import save_meft

        save_meft(model, str(folder))  # meft_adapter.safetensors + meft_config.json

    def load(self, base_model: Any, folder) -> Any:
        from memfit.meft import load_meft

        return load_meft(base_model, str(folder)) or base_model

    def parameters_outside(self, model: Any) -> int:
        from memfit.meft import meft_state

        # MEFT's keys/values live in a CPU store, not in nn.Parameters
        return int(meft_state(model).get("trainable_parameters", 0))


METHOD = Meft()
