"""Golden snapshot of estimate(...).to_dict() over a broad, fixed grid (a refactoring guard, not a test).

Run: PYTHONPATH=. python tests/golden_estimates.py /tmp/golden_before.json
Compare two snapshots byte for byte (cmp). The grid is deterministic: every preset x method x engine x
offload, each with several pseudo-random (seeded) choices of the other levers.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sys

os.environ["MEMFIT_HWCAL"] = "off"  # 'local' without this machine's cached calibration: stable numbers

from memfit.errors import MemfitError  # noqa: E402
from memfit.estimate import estimate  # noqa: E402
from memfit.spec.hardware import parse_hardware  # noqa: E402
from memfit.spec.model import list_presets, resolve_model  # noqa: E402
from memfit.spec.strategy import Strategy  # noqa: E402

METHODS = ("full", "lora", "qlora", "meft", "dora")
ENGINES = ({"zero_stage": 0}, {"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3},
           {"fsdp": "full_shard"}, {"fsdp": "shard_grad_op"})
OFFLOADS = ("none", "optimizer", "optimizer+params")
HARDWARE = ("1xRTX4090-24GB", "8xA100-80GB", "2x8xV100-32GB", "local")
REPEATS = 4


class Buckets:
    reduce_bucket_size = 50_000_000
    allgather_bucket_size = 200_000_000


def levers(rng: random.Random) -> dict:
    return {
        "gradient_checkpointing": rng.choice((False, True)),
        "attention": rng.choice(("sdpa", "eager")),
        "loss": rng.choice(("standard", "chunked")),
        "precision": rng.choice(("bf16-mixed", "fp32", "bf16-mixed", "fp32", "bf16", "fp16-mixed")),
        "seq_len": rng.choice((128, 512, 2048, 4096)),
        "micro_batch_size": rng.choice((1, 2, 8)),
        "grad_accum": rng.choice((1, 1, 4)),
        "optimizer": rng.choice(("adamw", "adamw", "adamw8bit", "sgd")),
        "lora_r": rng.choice((8, 16, 64)),
        "lora_dropout": rng.choice((0.0, 0.05)),
        "lora_targets": rng.choice((("q_proj", "v_proj"), ("all-linear",), ("q_proj", "k_proj", "v_proj", "o_proj"))),
        "quant_storage": rng.choice(("uint8", "bf16", "fp32")),
        "double_quant": rng.choice((True, False)),
        "meft_neurons": rng.choice((1024, 8192)),
        "meft_top_k": rng.choice((16, 64)),
        "meft_experts": rng.choice(("auto", 1, 4)),
    }


def main(out: str) -> int:
    rng = random.Random(20261130)
    models = {name: resolve_model(name) for name in list_presets()}
    hardware = {name: parse_hardware(name) for name in HARDWARE}
    rows = []
    for name, method, engine, offload in itertools.product(models, METHODS, ENGINES, OFFLOADS):
        for _ in range(REPEATS):
            kw = {"method": method, **engine, "offload": offload, **levers(rng)}
            hw_name = rng.choice(HARDWARE)
            extra = rng.choice(({}, {}, {"activation_formula": "korthikanti"}, {"distributed": Buckets()},
                                {"margin": 0.1}))
            key = {"model": name, "hardware": hw_name, **kw,
                   **{k: (v if k != "distributed" else "buckets") for k, v in extra.items()}}
            try:
                st = Strategy(**kw)
                d = estimate(models[name], hardware[hw_name], st, **extra).to_dict()
                rows.append({"key": key, "estimate": d})
            except (MemfitError, ValueError) as exc:
                rows.append({"key": key, "error": f"{type(exc).__name__}: {exc}"})
    with open(out, "w") as fh:
        json.dump(rows, fh, sort_keys=True, default=str)
    ok = sum("estimate" in r for r in rows)
    print(f"{len(rows)} combinations, {ok} estimated, {len(rows) - ok} errors -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/golden.json"))
