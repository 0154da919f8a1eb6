"""Golden snapshot of estimate(...).to_dict() over a broad, fixed grid (a refactoring guard, not a test).

Run: PYTHONPATH=. python tests/golden_estimates.py /tmp/golden_before.json
     PYTHONPATH=. python tests/golden_estimates.py --compare /tmp/golden_before.json /tmp/golden_after.json
The second form prints the first differences beyond 1e-9 relative (exit 1 if any). The grid is deterministic:
every preset x method x engine x offload, each with several pseudo-random (seeded) choices of the other levers
(FSDP1 and FSDP2, transformers' legacy checkpoint under FSDP1), on catalog GPUs, 'local' uncalibrated, a
calibrated GPU (the H200 profile of bench/results) and a measured CPU (a fixed hand-made profile); then
method=peft for several PEFT types (PEFT counts them: torch + peft imported, the count cache in a temp folder).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

os.environ["MEMFIT_HWCAL"] = "off"  # 'local' without this machine's cached calibration: stable numbers
os.environ.setdefault("MEMFIT_CACHE", tempfile.mkdtemp(prefix="memfit-golden-"))  # PEFT's count cache

from memfit.errors import MemfitError  # noqa: E402
from memfit.estimate import estimate  # noqa: E402
from memfit.spec import hwprofile  # noqa: E402
from memfit.spec.hardware import HardwareSpec, cpu_device, parse_hardware  # noqa: E402
from memfit.spec.model import list_presets, resolve_model  # noqa: E402
from memfit.spec.strategy import Strategy  # noqa: E402

METHODS = ("full", "lora", "qlora", "meft", "dora")
ENGINES = ({"zero_stage": 0}, {"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3},
           {"fsdp": "full_shard"}, {"fsdp": "shard_grad_op"})
OFFLOADS = ("none", "optimizer", "optimizer+params")
HARDWARE = ("1xRTX4090-24GB", "8xA100-80GB", "2x8xV100-32GB", "local", "h200-calibrated", "cpu-measured")
REPEATS = 4
H200 = Path(__file__).resolve().parent.parent / "bench" / "results" / "gpu_time_check_h200_2026-11-30_third.json"
PEFT_CONFIGS = (  # one per kind of PEFT work: scaling vectors, delta weights, rotations, virtual tokens
    {"peft_type": "IA3", "target_modules": ["k_proj", "v_proj", "down_proj"], "feedforward_modules": ["down_proj"]},
    {"peft_type": "LOHA", "r": 8, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    {"peft_type": "BOFT", "boft_block_size": 4, "target_modules": ["q_proj", "v_proj"]},
    {"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 20, "task_type": "CAUSAL_LM"},
    {"peft_type": "VERA", "r": 256, "target_modules": ["q_proj", "v_proj"]},
)


def cpu_rates() -> "hwprofile.HardwareRates":
    """A fixed, hand-made measured-CPU profile (tests/steptime/test_time_model.py's)."""
    from tests.steptime.test_time_model import rates

    return rates(fingerprint="golden")


def pools() -> dict:
    out = {name: parse_hardware(name) for name in HARDWARE[:4]}
    raw = json.loads(H200.read_text())
    out["h200-calibrated"] = replace(parse_hardware(raw["catalog_pool"]), label="local",
                                     rates=hwprofile.HardwareRates.from_dict(raw["profile"]))
    out["cpu-measured"] = HardwareSpec(cpu_device(), gpus_per_node=2, label="local", rates=cpu_rates())
    return out


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
        "fsdp_version": rng.choice((1, 2)),
        "hf_legacy_checkpoint": rng.choice((False, False, True)),
    }


def main(out: str) -> int:
    rng = random.Random(20261130)
    models = {name: resolve_model(name) for name in list_presets()}
    hardware = pools()
    rows = []
    for name, method, engine, offload in itertools.product(models, METHODS, ENGINES, OFFLOADS):
        for _ in range(REPEATS):
            kw = {"method": method, **engine, "offload": offload, **levers(rng)}
            if not kw.get("fsdp"):
                kw.pop("fsdp_version")
            if kw.get("fsdp_version") != 1:
                kw.pop("hf_legacy_checkpoint")
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
    rows += peft_rows(models, hardware, rng)
    with open(out, "w") as fh:
        json.dump(rows, fh, sort_keys=True, default=str)
    ok = sum("estimate" in r for r in rows)
    print(f"{len(rows)} combinations, {ok} estimated, {len(rows) - ok} errors -> {out}")
    return 0


def peft_rows(models: dict, hardware: dict, rng: random.Random) -> list[dict]:
    """method=peft: each PEFT config on two presets, every pool, a few lever draws."""
    rows = []
    for cfg, name, hw_name in itertools.product(PEFT_CONFIGS, ("llama-3.2-1b", "llama-2-7b"), HARDWARE):
        lv = levers(rng)
        kw = {"method": "peft", "peft_config": cfg, **{k: lv[k] for k in ("gradient_checkpointing", "attention",
                                                                        "precision", "seq_len", "micro_batch_size")}}
        key = {"model": name, "hardware": hw_name, **kw}
        try:
            rows.append({"key": key, "estimate": estimate(models[name], hardware[hw_name], Strategy(**kw)).to_dict()})
        except (MemfitError, ValueError) as exc:
            rows.append({"key": key, "error": f"{type(exc).__name__}: {exc}"})
    return rows


def differences(a, b, where: str = "", rel: float = 1e-9):
    """Yield 'path: a -> b' for every number differing beyond ``rel`` and every other difference."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                yield (f"{where}{k}: {'missing' if k not in a else 'present'} -> "
                       f"{'missing' if k not in b else 'present'}")
            else:
                yield from differences(a[k], b[k], f"{where}{k}.", rel)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from differences(x, y, f"{where}{i}.", rel)
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        if not math.isclose(a, b, rel_tol=rel, abs_tol=1e-12):
            yield f"{where[:-1]}: {a} -> {b}"
    elif a != b:
        yield f"{where[:-1]}: {str(a)[:120]} -> {str(b)[:120]}"


def compare(before: str, after: str, most: int = 20) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (before, after))
    found = list(itertools.islice(differences(a, b), most))
    for line in found:
        print(line)
    print(f"{'differences (first ' + str(most) + ')' if found else 'identical to 1e-9 relative'}: {before} vs {after}")
    return 1 if found else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/golden.json"))
