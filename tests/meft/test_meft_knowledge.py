"""bench/studies/meft_knowledge.py in miniature: the facts are deterministic and split by entity into validation and
test, recall is exact match, the shipped base loads from safetensors, the rate is picked on validation recall,
a run through memfit's training path stores facts the untrained model does not know, MEFT's device bytes
match the estimator, and (the CI smoke run) MEFT learns from the shipped base."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.studies import meft_knowledge_data as D

ROOT = Path(__file__).resolve().parents[2]

SMALL = D.TaskSize(old_entities=20, new_entities=6, copy_train=8, copy_eval=8)


def test_facts_are_deterministic_and_disjoint():
    a, b = D.make_task(SMALL, seed=3), D.make_task(SMALL, seed=3)
    assert a == b
    assert a != D.make_task(SMALL, seed=4)
    assert len(a["new_facts"]) == 6 * len(D.RELATIONS)
    old = {r["prompt"] for r in a["pretrain"]}
    assert not old & {r["prompt"] for r in a["new_facts"]}  # the new facts' questions are never pre-trained
    copies = [r["prompt"] for k in ("copy_train", "copy_eval") for r in a[k]]
    assert len(set(copies)) == len(copies)
    # every new fact is trained; a fixed quarter of the new entities (rounded up) is the validation split
    val, test = {r["entity"] for r in a["new_val"]}, {r["entity"] for r in a["new_test"]}
    assert len(val) == 2 and len(test) == 4 and not val & test
    assert a["new_val"] + a["new_test"] == [r for r in a["new_facts"] if r["entity"] in val] + \
        [r for r in a["new_facts"] if r["entity"] in test]
    # the pre-training set does not depend on how many new entities there are; a larger set extends a smaller
    big = D.make_task(D.TaskSize(old_entities=20, new_entities=24, copy_train=8, copy_eval=8), seed=3)
    assert big["pretrain"] == a["pretrain"] and big["new_facts"][: len(a["new_facts"])] == a["new_facts"]
    assert big["copy_eval"] == a["copy_eval"] and len({r["entity"] for r in big["new_val"]}) == 6
    tok = D.build_tokenizer()
    for r in a["new_facts"][:4] + a["copy_eval"][:2]:  # every word is one known token
        ids = tok(r["prompt"] + r["completion"], add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids
        assert len(ids) == len((r["prompt"] + r["completion"]).split())


def test_exact_match_on_a_hand_made_case():
    import torch

    targets = torch.tensor([[-100, 5, 2, -100], [-100, 7, 2, -100], [-100, -100, 9, 2]])
    predicted = torch.tensor([[1, 5, 2, 4], [0, 7, 3, 0], [8, 8, 9, 2]])
    assert D.exact_match(predicted, targets) == [True, False, True]  # row 2: answer right, no end-of-sequence

    tok = D.build_tokenizer()
    rec = {"prompt": "Q : what is the city of baba ? A :", "completion": " city3"}
    ids, mask, tgt = D.encode([rec, {"prompt": "Q : repeat c a ? A :", "completion": " c a"}], tok)
    city3, eos = tok.convert_tokens_to_ids("city3"), tok.eos_token_id
    row = tgt[0].tolist()
    n_prompt = 1 + len(rec["prompt"].split())  # <s> + the question's words
    assert row[: n_prompt - 1] == [-100] * (n_prompt - 1)
    assert row[n_prompt - 1: n_prompt + 1] == [city3, eos]  # the positions that predict the answer
    assert ids[0, n_prompt].item() == city3 and mask[1].sum().item() == 1 + 8 + 2 + 1

    class Oracle(torch.nn.Module):
        """Predicts the next input token (so it 'knows' every answer in the batch it is given)."""

        def __init__(self, vocab, wrong_row=None):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.vocab, self.wrong_row = vocab, wrong_row

        def forward(self, input_ids, attention_mask=None):
            nxt = torch.roll(input_ids, -1, dims=1)
            if self.wrong_row is not None:
                nxt[self.wrong_row] = 0
            return type("Out", (), {"logits": torch.nn.functional.one_hot(nxt, self.vocab).float()})

    recs = [rec, rec]
    assert D.recall(Oracle(len(tok)), tok, recs) == 1.0
    assert D.recall(Oracle(len(tok), wrong_row=1), tok, recs, batch=2) == 0.5


def test_a_run_stores_facts_and_meft_bytes_match_the_estimator(tmp_path):
    """A tiny random Llama trained through a run file and memfit.train.api.train on 24 facts: full
    fine-tuning stores facts the untrained model does not know; short MEFT runs' device bytes of trainable
    state (default buffer, and ``meft.buffer_size`` = all rows) match memfit's estimator within 5 % and its
    counters report bytes moved."""
    pytest.importorskip("transformers")
    from bench.studies import meft_knowledge as B

    task = D.make_task(D.TaskSize(old_entities=4, new_entities=6, copy_train=4, copy_eval=4), seed=0)
    (tmp_path / "task.json").write_text(json.dumps(task))
    D.write_jsonl(task["new_facts"], tmp_path / "finetune.jsonl")
    base = D.build_model(tmp_path / "base", D.ModelSize(hidden=32, intermediate=64, layers=1, heads=2))
    full = B.Method("full", "full", {"method": "full"}, (1e-2,))
    meft = B.Method("meft", "MEFT", {**B.MEFT, "meft_neurons": 64, "meft_top_k": 8, "meft_experts": "auto",
                                     "meft_n_probe": 4}, (1e-2,))
    whole = B.Method("meft-buf", "MEFT, buffer of all rows", {**meft.strategy, "meft_buffer_size": 64}, (1e-2,))
    jobs = B.finetune_jobs(tmp_path, str(base), B.Setup(batch=24, steps=60), [full]) + \
        B.finetune_jobs(tmp_path, str(base), B.Setup(batch=24, steps=4), [meft, whole])
    tok = D.build_tokenizer()
    from transformers import AutoModelForCausalLM

    before = D.recall(AutoModelForCausalLM.from_pretrained(str(base)), tok, task["new_test"])
    trained, sparse, buffered = (j.result for j in B.run_jobs(jobs, 1))
    assert trained["steps"] == 60 and trained["recall"] >= before + 0.25, (before, trained["recall"])  # test facts
    assert trained["recall_val"] is not None and trained["recall_all"] >= before
    assert sparse["moved_bytes_per_step"] > 0 and sparse["measured"]["host_bytes"] > 0
    assert sparse["measured"]["parts"]["meft_buffers"] > 0
    for run in (sparse, buffered):  # estimator vs measured, MEFT with the default buffer and with meft.buffer_size
        pred = run["predicted"]["device_bytes"]
        assert abs(run["measured"]["device_bytes"] - pred) <= 0.05 * pred, (run["measured"], pred)
    assert buffered["meft"]["buffer_rows"] == 64 and sparse["meft"]["buffer_rows"] == 16  # default: neurons / 4
    assert buffered["measured"]["parts"]["meft_buffers"] == 4 * sparse["measured"]["parts"]["meft_buffers"]
    assert (tmp_path / "results" / f"{jobs[1].key}.json").is_file()


def test_shipped_base_is_safetensors_and_what_made_json_says():
    """The base every bench run starts from ships with the bench: weights in safetensors (no pickle), its
    config the bench's ModelSize, its tokenizer the task's vocabulary, its sha256 as made.json records."""
    import hashlib

    pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from bench.studies import meft_knowledge_base as MB

    made = json.loads((MB.ASSET / "made.json").read_text())
    for name, digest in made["sha256"].items():
        assert hashlib.sha256((MB.ASSET / name).read_bytes()).hexdigest() == digest, name
    assert not [p for p in MB.ASSET.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    weights = load_file(str(MB.ASSET / "model.safetensors"))
    size, cfg = D.ModelSize(), AutoConfig.from_pretrained(str(MB.ASSET))
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (size.hidden, size.intermediate,
                                                                                size.layers)
    assert made["model"] == {k: getattr(size, k) for k in made["model"]}
    assert sum(w.numel() for w in weights.values()) == 220_352 and all(w.dtype == torch.float32
                                                                       for w in weights.values())
    assert AutoTokenizer.from_pretrained(str(MB.ASSET)).get_vocab() == D.build_tokenizer().get_vocab()


def test_the_rate_is_picked_on_validation_recall():
    from bench.studies import meft_knowledge as B

    def job(lr, val, test, nll=1.0):
        return B.Job("k", "m", lr, 0, {}, "", 1, result={"recall_val": val, "recall": test, "val_nll": nll,
                                                             "final_loss": 1.0})

    assert B.pick_lr([job(1e-3, 0.5, 0.9), job(1e-2, 0.6, 0.1)]) == 1e-2   # test recall does not pick
    assert B.pick_lr([job(1e-3, 0.6, 0.1, nll=2.0), job(3e-3, 0.6, 0.1, nll=1.5)]) == 3e-3  # tie: lower NLL
    assert set(B.GRID) == {1e-3, 3e-3, 1e-2, 3e-2} and all(m.lrs == B.GRID for m in B.METHODS)


def test_quick_check_fails_when_meft_stops_learning():
    from bench.studies import meft_knowledge as B

    rows = lambda recall: [{"method": "meft-k12", "recall": recall}]  # noqa: E731
    assert B.quick_check(rows(0.40), step0=0.01)[0]
    assert not B.quick_check(rows(0.15), step0=0.01)[0]              # learned less than 20 points
    assert not B.quick_check(rows(0.40), step0=0.25)[0]              # 15 points above a higher step 0
    assert not B.quick_check([{"method": "lora-r2", "recall": 0.9}], step0=0.0)[0]  # MEFT did not run


@pytest.mark.slow
def test_quick_bench_meft_learns(tmp_path):
    """bench/studies/meft_knowledge.py --quick (the CI smoke run, ~20 s on 2 cores): from the shipped base, MEFT top-k
    12 stores the 128 facts (300 steps, seed 0); the bench exits non-zero unless its test-entity recall is at
    least 20 points above the base's step-0 recall of the same facts."""
    import os
    import subprocess

    pytest.importorskip("transformers")
    from bench.studies import meft_knowledge as B

    out = tmp_path / "quick.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "bench.studies.meft_knowledge", "--quick", "--jobs", "1",
                           "--workdir", str(tmp_path / "work"), "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    meft, step0 = doc["rows"][0], doc["pretrain"]["recall"]
    assert doc["pretrain"]["source"] == "shipped" and meft["method"] == "meft-k12"
    assert meft["recall"] >= step0 + B.QUICK_GAIN, (meft["recall"], step0)


def test_shape_check_reads_the_papers_claims_from_the_rows():
    """bench/studies/meft_knowledge.py prints the issue's checklist as PASS/FAIL lines; each line can fail."""
    from bench.studies.meft_knowledge_report import shape_check

    def row(method, recall, pm=0.02, control=1.0, dev=1.0, pred=None):
        return {"method": method, "recall": recall, "recall_pm": pm, "control": control,
                "device_meas": dev, "device_pred": dev if pred is None else pred}

    good = [row("lora-r2", 0.40, dev=0.079), row("lora-r8", 0.70, dev=0.315),
            row("lora-r32", 0.95, dev=1.26), row("pa-dense", 0.80, dev=1.05),
            row("meft-k12", 0.55, dev=0.098), row("meft-k4", 0.30, dev=0.098), row("meft-k12-e1", 0.50, dev=0.066),
            row("meft-k32-buf256", 0.79, dev=0.295), row("full", 0.99, dev=3.5)]
    lines = shape_check(good, "128 facts, d=64, 600 steps")
    assert "in this miniature's regime of 128 facts, d=64, 600 steps" in lines[2]
    assert len(lines) == 8 and all(line.startswith("PASS") for line in lines), lines
    bad = {r["method"]: dict(r) for r in good}
    bad["meft-k12"].update(recall=0.43, recall_pm=0.05)          # ahead of LoRA by less than the spread
    bad["meft-k32-buf256"].update(recall=0.70)                   # 10 points below the dense PA, = LoRA r=8
    bad["meft-k12"].update(control=0.95)                         # sparsity cost the control 5 points
    bad["meft-k12-e1"].update(device_pred=0.075)                 # estimator 14 % off
    failed = [line for line in shape_check(list(bad.values())) if line.startswith("FAIL")]  # no regime named
    assert [f.split(":")[0] for f in failed] == [
        "FAIL  MEFT at the same K within 3 points of the dense PA at <= 50 % of its device bytes",
        "FAIL  MEFT beats LoRA at equal device bytes by more than the spread",
        "FAIL  MEFT beats LoRA at equal device bytes by more than the spread",
        "FAIL  control shows no loss from sparsity",
        "FAIL  estimator vs measured device bytes within 5 % for every MEFT configuration"], failed
    # top-k below 3 % is the knowledge ablation: its control is printed beside the line, not judged
    low_k4 = {r["method"]: dict(r) for r in good}
    low_k4["meft-k4"].update(control=0.95)
    line = [x for x in shape_check(list(low_k4.values())) if "control" in x][0]
    assert line.startswith("PASS") and "meft-k4 (below 3 %, the knowledge ablation) 95.0 %" in line, line
