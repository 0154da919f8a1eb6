"""The measured process: ``python -m memfit.measure.worker SPEC.json`` (one per rank under torchrun).

SPEC holds the run (a RunSpec as a dict), warm-up and measured step counts and where each rank writes
its figures. The worker trains the run through memfit's own trainer (``memfit.train.api.train``) with
the probe attached as a callback, on random token ids (within the model's vocabulary) of exactly
``micro_batch × seq_len`` per micro-step, for ``warmup + steps`` optimizer steps (and one more that ends the
last timed iteration), no checkpoints. No
tokenizer is involved (a model folder without one measures the same shapes); the probe asserts every step
ran the planned shapes.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any, Callable, Optional

_WORDS = ("alpha beta gamma delta model memory tensor layer train plan measure adapter window batch "
          "token sequence gradient optimizer shard offload kernel cache vector matrix scale").split()


def synthetic_text_records(n: int, seq_len: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` records of random words, each long enough to fill ``seq_len`` tokens of any tokenizer."""
    rng = random.Random(seed)
    words = max(64, 2 * seq_len)  # a word is at least one token
    return [{"text": " ".join(rng.choice(_WORDS) + str(rng.randrange(100)) for _ in range(words))}
            for _ in range(n)]


def vocab_size_of(model_path: str) -> Optional[int]:
    from memfit.spec.model import hub_config_file, hub_id

    p = Path(model_path)
    hub = hub_id(str(model_path))
    cfg = hub_config_file(hub) if hub is not None else p if p.name == "config.json" else p / "config.json"
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return None
    v = data.get("vocab_size") or (data.get("text_config") or {}).get("vocab_size")
    return int(v) if v else None


def synthetic_token_data(n: int, seq_len: int, vocab: int, seed: int = 0):
    """(train_ds, None, DataReport): ``n`` rows of exactly ``seq_len`` random ids in ``[0, vocab)``."""
    from datasets import Dataset

    from memfit.train.data import DataReport

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ids = [rng.randrange(vocab) for _ in range(seq_len)]
        rows.append({"input_ids": ids, "labels": ids})
    report = DataReport(source="synthetic token ids", format="token_ids", examples=n, train_examples=n,
                        train_tokens=n * seq_len)
    return Dataset.from_list(rows), None, report


def logits_predicate(vocab: Optional[int], micro_batch: int, seq_len: int,
                     loss: str = "standard") -> Optional[Callable[[int], bool]]:
    """True for a tensor whose byte size is one of the output layer's b·s·V (or b·(s−1)·V) tensors; with
    ``loss="chunked"`` one chunk's c·V (and the shorter last chunk's), c = loss_chunk_tokens."""
    if not vocab:
        return None
    rows = {micro_batch * s for s in (seq_len, seq_len - 1)}
    if loss == "chunked":
        from memfit.spec.strategy import loss_chunk_tokens

        n = micro_batch * seq_len
        c = loss_chunk_tokens(vocab, n)
        rows = {c, n % c} - {0}
    sizes = {r * vocab * e for r in rows for e in (2, 4)}
    return lambda nbytes: nbytes in sizes


def prepare_run(spec: dict[str, Any], workdir: Path):
    """The RunSpec the worker trains: warmup+steps steps (+1 that ends the last timed iteration), no
    checkpoints, no eval (data: synthetic ids)."""
    from memfit.spec.run import run_from_dict

    base = run_from_dict(spec["run"], source="measure spec")
    from memfit.measure.baton import timed_steps
    from memfit.measure.probe import settles_malloc

    turn = int((spec.get("baton") or {}).get("turn", 1))
    steps = timed_steps(int(spec["warmup"]), int(spec["steps"]), turn, settles_malloc())[1]
    raw = base.model_dump(mode="json")
    raw["data"] = {"path": None, "format": "text", "eval_fraction": 0.0, "packing": False}
    raw["training"].update({"max_steps": steps, "epochs": None, "checkpoint_interval": 0,
                            "eval_interval": 0, "logging_interval": 1})
    raw["output_dir"] = str(workdir / "train")
    return run_from_dict(raw, source="measure spec")


def _gate(baton: Optional[dict]):
    """The step gate of an interleaved measurement (memfit.measure.baton), when the spec names one."""
    if not baton:
        return None
    from memfit.measure.baton import Gate

    return Gate(baton["folder"], baton["name"], int(baton.get("turn", 1)))


def main(argv: list[str]) -> int:
    spec_path = Path(argv[0])
    spec = json.loads(spec_path.read_text())
    workdir = spec_path.parent
    if spec.get("mode") == "trace":  # an estimate from a traced step, no training
        from memfit.measure.callback import write_json_atomic
        from memfit.measure.trace import traced_step
        from memfit.spec.run import run_from_dict

        run = run_from_dict(spec["run"], source="trace spec")
        write_json_atomic(traced_step(run.model, run.strategy), Path(spec["out"].replace("{rank}", "0")))
        return 0
    run = prepare_run(spec, workdir)

    import torch

    if spec.get("threads"):  # the runner's count (memfit.spec.threads.run_threads), which it predicted at:
        import os  # in the environment too, so the trainer keeps it rather than pick by the load average

        from memfit.spec.threads import ENV

        torch.set_num_threads(int(spec["threads"]))
        os.environ[ENV] = str(int(spec["threads"]))
    from memfit.measure.callback import ProbeCallback
    from memfit.train.api import train

    from memfit.errors import ConfigError

    s = run.strategy
    vocab = vocab_size_of(run.model)
    if not vocab:
        raise ConfigError(f"model: {run.model} has no vocab_size in config.json; measure feeds random "
                          "token ids below it")
    world = run.distributed.nproc * run.distributed.nodes
    n = s.micro_batch_size * s.grad_accum * world * run.training.max_steps + 2
    data = synthetic_token_data(n, s.seq_len, vocab, seed=run.training.seed)
    cb = ProbeCallback(warmup=int(spec["warmup"]), steps=int(spec["steps"]), out_path=spec["out"],
                       logits_bytes=logits_predicate(vocab, s.micro_batch_size, s.seq_len, s.loss),
                       categories=bool(spec.get("categories", True)),
                       expect_shape=(s.micro_batch_size, s.seq_len), gate=_gate(spec.get("baton")))
    train(run, callbacks=[cb], data=data)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
