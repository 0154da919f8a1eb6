"""Held-out configurations for bench/time_grid.py (``--held-out``): drawn with a fixed seed from a space the
development grid does not cover, measured and predicted exactly as the development grid is.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/time_grid.py --held-out --out /tmp/tg_heldout
        # 8, seed 0 (~6 min)
    PYTHONPATH=. .venv/bin/python bench/time_grid.py --held-out --out /tmp/tg_heldout --reuse  # re-predict them

The development grid (time_grid.SHAPES / CELLS) is two shapes (hidden 256 and 128, 4 layers, 8 heads, the
tokenizer's 480-token vocabulary) at sequence lengths 128, 256, 512 and 1024: the configurations the time
model and the measuring protocol were developed on. The held-out ones never share a hidden size, a layer
count, a vocabulary or a sequence length with them. They come in groups like the development grid's (a
group: one drawn shape at one drawn sequence length, the configurations ranked against each other, measured
in one calibration window); within a group, the method (full / LoRA / QLoRA), micro-batch, 1 or 2 processes
(DDP; ZeRO-2 or FSDP for full fine-tuning), checkpointing and attention (SDPA / eager) are drawn per
configuration. A configuration whose work (FLOPs per step, roughly) exceeds the largest development row's
by a margin is drawn again, so that the run stays within minutes on a 2-core machine.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import ModuleType

ARCHS = ("llama", "qwen2")
HIDDEN = (96, 160, 192, 224, 320)  # the development grid: 128, 256
LAYERS = (2, 3, 5, 6)  # the development grid: 4
HEAD_DIMS = (16, 24, 32, 40, 48, 64)  # heads = hidden / head dim
VOCAB = (768, 1024, 1536, 1920)  # the development grid: the tokenizer's 480 (memfit refuses a tokenizer < vocab / 4)
SEQ_LENS = (192, 320, 384, 640, 768)  # the development grid: 128, 256, 512, 1024
MICRO_BATCHES = (1, 2, 3, 4, 6)
METHODS = ("full", "lora", "qlora")
GROUP_SIZE = 4
MAX_WORK = 6e10  # FLOPs per step (see work()); the development grid's largest rows: 3-5e10


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def draw_shape(rng: random.Random) -> dict:
    hidden = rng.choice(HIDDEN)
    head_dim = rng.choice([d for d in HEAD_DIMS if hidden % d == 0 and hidden // d >= 2])
    heads = hidden // head_dim
    kv = rng.choice(_divisors(heads))
    ffn = 16 * round(hidden * rng.uniform(2.0, 3.5) / 16)
    return dict(arch=rng.choice(ARCHS), hidden_size=hidden, intermediate_size=ffn,
                num_hidden_layers=rng.choice(LAYERS), num_attention_heads=heads, num_key_value_heads=kv,
                vocab_size=rng.choice(VOCAB))


def draw_cell(rng: random.Random, model: str, seq: int) -> dict:
    method = rng.choice(METHODS)
    nproc = 1 if method == "qlora" else rng.choice((1, 2))  # QLoRA: one process (as in the development grid)
    engine = {}
    if nproc == 2 and method == "full":
        engine = rng.choice(({}, {"zero_stage": 2}, {"fsdp": "full_shard"}))
    return dict(model=model, seq_len=seq, micro_batch_size=rng.choice(MICRO_BATCHES), method=method,
                gradient_checkpointing=rng.random() < 0.5, attention=rng.choice(("sdpa", "eager")), nproc=nproc,
                **engine)


def work(cell: dict, shape: dict) -> float:
    """A rough FLOP count of one step (what bounds the draw; not a prediction): 6 FLOPs per parameter and
    token trained, 4 with a frozen base, + a forward with checkpointing; attention's 4·s²·h per layer and
    sequence, x3 with the backward; eager attention counted twice (its materialised scores)."""
    h, L, ffn, v = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"], shape["vocab_size"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    params = L * (2 * h * h + 2 * h * kv + 3 * h * ffn) + h * v
    tokens = cell["micro_batch_size"] * cell["seq_len"]
    per_token = (6 if cell["method"] == "full" else 4) + (2 if cell["gradient_checkpointing"] else 0)
    attention = (12 * L * cell["seq_len"] ** 2 * h * cell["micro_batch_size"]
                 * (2 if cell["attention"] == "eager" else 1))
    return per_token * params * tokens + attention


def dev_keys(shapes: dict, cells: list[dict]) -> set[tuple]:
    """(shape, sequence length) of every development configuration."""
    return {(_shape_key(shapes[c["model"]]), c["seq_len"]) for c in cells}


def _shape_key(shape: dict) -> tuple:
    return tuple(shape.get(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                        "num_attention_heads", "num_key_value_heads"))


def draw(n: int = 8, seed: int = 0, group_size: int = GROUP_SIZE) -> tuple[dict[str, dict], list[dict]]:
    """({model name: shape}, configurations): ``n`` configurations in groups of ``group_size`` (one shape and
    one sequence length each), deterministic for ``seed``."""
    rng = random.Random(f"memfit-time-grid-held-out-{seed}")
    shapes: dict[str, dict] = {}
    cells: list[dict] = []
    for g in range((n + group_size - 1) // group_size):
        name = f"s{seed}g{g}"
        shapes[name] = draw_shape(rng)
        seq = rng.choice(SEQ_LENS)
        for _ in range(min(group_size, n - len(cells))):
            for _attempt in range(1000):
                cell = draw_cell(rng, name, seq)
                if work(cell, shapes[name]) <= MAX_WORK and cell not in cells:
                    break
            else:
                raise RuntimeError(f"no configuration of {shapes[name]} at {seq} within the work bound")
            cells.append(cell)
    return shapes, cells


def build_models(root: Path, shapes: dict[str, dict]) -> None:
    """Write each drawn shape's random-weight model and the development grid's tokenizer under ``root``
    (rebuilt where a folder holds another shape)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from memfit.measure.worker import synthetic_text_records
    from memfit.train.demo import train_tokenizer

    for name, shape in shapes.items():
        folder = root / name
        cfg_path = folder / "config.json"
        if cfg_path.is_file():
            saved = json.loads(cfg_path.read_text())
            if all(saved.get(k) == v for k, v in shape.items() if k != "arch"):
                continue
            shutil.rmtree(folder)
        tok = train_tokenizer([r["text"] for r in synthetic_text_records(200, 64, seed=5)], 2048)
        kw = {k: v for k, v in shape.items() if k != "arch"}
        common = dict(max_position_embeddings=2048, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
        torch.manual_seed(0)
        cls, cfg = (LlamaForCausalLM, LlamaConfig) if shape["arch"] == "llama" else (Qwen2ForCausalLM, Qwen2Config)
        cls(cfg(**kw, **common)).save_pretrained(folder, safe_serialization=True)
        tok.save_pretrained(folder)


def use(grid: ModuleType, n: int, seed: int, models: Path) -> None:
    """Make bench/time_grid.py (``grid``) measure and report the held-out configurations: its SHAPES and CELLS
    replaced in place by the drawn ones (their models built under ``models``)."""
    shapes, cells = draw(n, seed)
    dev = dev_keys(grid.SHAPES, grid.CELLS)
    assert not any((_shape_key(shapes[c["model"]]), c["seq_len"]) in dev for c in cells)
    build_models(models, shapes)
    grid.SHAPES.clear()
    grid.SHAPES.update(shapes)
    grid.CELLS[:] = cells
    print(f"held-out configurations (seed {seed}, n={n}): " + "; ".join(
        f"{k} h{s['hidden_size']} L{s['num_hidden_layers']} "
        f"heads {s['num_attention_heads']}/{s['num_key_value_heads']} "
        f"ffn {s['intermediate_size']} vocab {s['vocab_size']} {s['arch']}" for k, s in shapes.items()))
