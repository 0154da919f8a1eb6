"""Shared tiny-model fixtures. Every model is built from a config on the CPU (no hub, no weights to fetch).

- ``tiny_model_dir(name, texts, seed=0, **sizes)``: a model folder as memfit trains it (safetensors weights
  + a byte-level BPE tokenizer trained on ``texts``), from ``memfit.train.demo.build_tiny_model``; the
  sizes default to ``MICRO``. Built once per session for the same arguments.
- ``llama_config(**sizes)``: a ``transformers.LlamaConfig`` of ``TINY_LLAMA`` sizes (plus overrides).
- ``tiny_llama(seed=0, **sizes)``: a random-init ``LlamaForCausalLM`` of that config, seeded.

torch/transformers are imported inside the fixtures, so collecting the planner's tests needs neither.
"""

from __future__ import annotations

import contextlib
import gc
import os
from pathlib import Path

import pytest

# Tests predict with the uncalibrated time model and never write a hardware profile into the user's cache
# (tests of the calibration itself turn it back on with monkeypatch, under a temporary MEMFIT_CACHE).
os.environ.setdefault("MEMFIT_HWCAL", "off")

# the micro Llama memfit's train / CLI tests run: hidden 64, 2 layers, GQA 4/2, vocabulary 512
MICRO = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)

# the plain transformers Llama the measurement and MEFT tests build in memory
TINY_LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    built: dict = {}

    def build(name: str, texts: list[str], seed: int = 0, **sizes):
        from memfit.train.demo import TinyModelConfig, build_tiny_model

        key = (name, tuple(texts), seed, tuple(sorted(sizes.items())))
        if key not in built:
            root = tmp_path_factory.mktemp(name)
            built[key] = build_tiny_model(root / "model", TinyModelConfig(**{**MICRO, **sizes}), seed=seed,
                                          texts=list(texts))
        return built[key]

    return build


@pytest.fixture(scope="session")
def llama_config():
    def make(**sizes):
        from transformers import LlamaConfig

        return LlamaConfig(**{**TINY_LLAMA, **sizes})

    return make


@pytest.fixture(scope="session")
def tiny_llama(llama_config):
    def make(seed: int = 0, attention: str | None = None, **sizes):
        import torch
        from transformers import LlamaForCausalLM

        cfg = llama_config(**sizes)
        if attention is not None:
            cfg._attn_implementation = attention
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg)

    return make


def dialogue_micro(root):
    """A micro model folder (hidden 32, 2 layers, vocab 300) and a 32-record JSON-lines dataset under ``root``:
    (model folder, data file). The methods' training tests share it."""
    from memfit.train.demo import TinyModelConfig, build_tiny_model, make_dialogue_records, write_jsonl

    recs = make_dialogue_records(32, seed=3)
    cfg = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, vocab_size=300, max_position_embeddings=64)
    model = build_tiny_model(root / "model", cfg, texts=[r["dialogue"] + "\n" + r["summary"] for r in recs])
    data = write_jsonl([{"text": r["dialogue"] + "\n" + r["summary"]} for r in recs], root / "data.jsonl")
    return model, data


def lora_dialogue_run(root, tiny_model_dir, name, *, records: int, seq_len: int, **training) -> dict:
    """The run dict the multi-process tests train: fp32 LoRA (r 4) on ``records`` dialogue records written to
    ``root``/data.jsonl, the session's tiny model ``name`` (vocab 384), constant learning rate 0.01 plus
    ``training``'s keys."""
    from memfit.train.demo import make_dialogue_records, write_jsonl

    recs = make_dialogue_records(records, seed=0)
    write_jsonl(recs, root / "data.jsonl")
    model = tiny_model_dir(name, [r["dialogue"] + "\n" + r["summary"] for r in recs], vocab_size=384)
    return {
        "model": str(model),
        "data": {"path": str(root / "data.jsonl"), "format": "dialogue_summary", "eval_fraction": 0.0},
        "strategy": {"method": "lora", "precision": "fp32", "micro_batch_size": 1, "seq_len": seq_len,
                     "lora_dropout": 0.0, "lora_r": 4, "lora_alpha": 8},
        "training": {"learning_rate": 0.01, "lr_scheduler": "constant", **training},
    }


def release_process_group(env: dict) -> None:
    """After a run in this process: leave its process group (memfit.distributed.ranks.finish), forget the groups
    DeepSpeed cached from it (deepspeed 0.19.8 utils/groups.py module globals, comm/comm.py's backend ``cdb``: a
    later DeepSpeed run in this process would otherwise ask a destroyed group for its ranks) and restore ``env``
    (the rendezvous variables the run set)."""
    import sys

    from memfit.distributed.ranks import finish

    finish()
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP",
                     "_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP", "mpu"):
            setattr(groups, name, None)
        for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                     "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
            getattr(groups, name).clear()
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None:
        comm.cdb = None
    os.environ.clear()
    os.environ.update(env)


def reference_losses(run_file, sets: list, name: str = "ref") -> list:
    """The losses of ``run_file`` with ``sets`` trained in this process on one rank (the multi-process tests'
    reference: micro-batch 2 here sees the global batches micro-batch 1 on each of two ranks sees). In-process,
    it spares a Python start and the libraries' ~10 s import; the ranks under test still run as users run them."""
    from memfit.measure.engine_matrix import run_case

    env = dict(os.environ)
    try:  # a DeepSpeed reference starts a one-rank group here: neither it nor its rendezvous variables may outlive
        # the call (the next in-process run would find a group, a child process the group's port taken)
        return run_case(Path(run_file), {"name": name, "set": sets}, world=1)["losses"]
    finally:
        release_process_group(env)


@contextlib.contextmanager
def own_heap():
    """Time a call as a fresh process spends it: the objects earlier tests left alive (models, torch's) are frozen
    out of the garbage collector's scans, which otherwise grow with them (a timed plan ran ~30 % slower late in a
    test run)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
