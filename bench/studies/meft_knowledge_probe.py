"""The callback bench/studies/meft_knowledge.py attaches to each memfit training run: time per step (process CPU
time and wall), trainable-state bytes measured on the live tensors after the second optimizer step, MEFT's
bytes moved per step (its own transfer counters), and at the end closed-book recall on the new facts and
the control task, scored on the trained model in place (:func:`scores`: ``recall`` is the test entities'
recall, the figure reported; ``recall_val`` the validation entities', which picks the learning rate)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from transformers import TrainerCallback

from bench.studies.meft_knowledge_bytes import measured, measured_grad_bytes
from bench.studies.meft_knowledge_data import answer_nll, build_tokenizer, recall

_TASKS: dict = {}


def load_task(workdir: Path) -> dict:
    key = str(workdir)
    if key not in _TASKS:
        _TASKS[key] = json.loads((workdir / "task.json").read_text())
    return _TASKS[key]


def scores(model, task: dict, eval_batch: int) -> dict:
    """Closed-book recall of the new facts (test entities: ``recall``; validation entities: ``recall_val``;
    all: ``recall_all``), the control task, the trained copy strings, and the answer's NLL (all / validation)."""
    tok = build_tokenizer()
    val = task.get("new_val", [])
    test = task.get("new_test", task["new_facts"])  # a task without the split: every new fact is a test fact
    return {"recall": recall(model, tok, test, eval_batch),
            "recall_val": recall(model, tok, val, eval_batch) if val else None,
            "recall_all": recall(model, tok, task["new_facts"], eval_batch),
            "control": recall(model, tok, task["copy_eval"], eval_batch),
            "copy_trained": recall(model, tok, task["copy_train"], eval_batch),
            "answer_nll": answer_nll(model, tok, task["new_facts"], eval_batch),
            "val_nll": answer_nll(model, tok, val, eval_batch) if val else None}


class Probe(TrainerCallback):
    """``curve_every``: also score recall (and the answer's NLL) every that many steps (0: at the end only)."""

    def __init__(self, method: str, task: dict, eval_batch: int, measure_at: int = 2, curve_every: int = 0):
        self.method, self.task, self.eval_batch, self.measure_at = method, task, eval_batch, measure_at
        self.curve_every, self.curve = curve_every, []
        self.cpu: list = []
        self.wall: list = []
        self.moved: list = []
        self.grad_bytes = 0
        self.bytes: dict = {}
        self.scores: dict = {}
        self.meft: dict = {}
        self._t = (0.0, 0.0)

    def on_step_begin(self, args, state, control, **kw):
        self._t = (time.process_time(), time.perf_counter())

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        if state.global_step + 1 == self.measure_at:
            self.grad_bytes = measured_grad_bytes(model)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
        self.cpu.append(time.process_time() - self._t[0])
        self.wall.append(time.perf_counter() - self._t[1])
        if state.global_step == self.measure_at:
            self.bytes = measured(model, optimizer, self.grad_bytes, self.method)
        if self.method == "meft":
            from memfit.meft import traffic

            t = traffic(model)
            self.moved.append(int(t["h2d"]) + int(t["d2h"]))
        if self.curve_every and state.global_step % self.curve_every == 0:
            s = scores(model, self.task, self.eval_batch)
            self.curve.append({"step": state.global_step, **{k: s[k] for k in ("recall", "recall_val",
                                                                                 "recall_all", "answer_nll")}})

    def on_train_end(self, args, state, control, model=None, **kw):
        self.scores = scores(model, self.task, self.eval_batch)
        if self.method == "meft":
            from memfit.meft import meft_state, traffic

            st = meft_state(model)
            last = traffic(model)  # the last optimizer step's counters
            self.meft = {k: st[k] for k in ("experts", "n_probe", "buffer_rows", "trainable_parameters",
                                            "last_union", "last_dropped", "last_keys_scored")}
            self.meft["step_counters"] = {k: v for k, v in last.items() if isinstance(v, (int, float))}

    def summary(self) -> dict:
        later = slice(1, None) if len(self.cpu) > 1 else slice(None)  # the first step warms up
        return {**self.scores, "measured": self.bytes, "meft": self.meft, "curve": self.curve,
                "cpu_ms_per_step": 1e3 * statistics.median(self.cpu[later]) if self.cpu else None,
                "wall_ms_per_step": 1e3 * statistics.median(self.wall[later]) if self.wall else None,
                "moved_bytes_per_step": statistics.median(self.moved[later]) if self.moved else 0,
                "steps": len(self.cpu)}
