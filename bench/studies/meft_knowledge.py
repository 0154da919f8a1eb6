"""MEFT's claim in miniature (issue 24; the fair protocol of issue 38): more knowledge stored per device byte
than LoRA?

A closed-book knowledge task generated here (bench/studies/meft_knowledge_data.py). The base, a small Llama-shaped
model pre-trained on the facts of other entities in the same question/answer templates and on a copy task,
is shipped with the bench (bench/studies/assets/meft_base/, safetensors; meft_knowledge_base.py) so that every
machine starts from the same weights; ``--pretrain`` makes a fresh one through ``memfit train`` instead.
Each method stores the facts of new entities, mixed with new copy examples, through memfit's own training
path (a run file per run, read by ``memfit.spec.run.load_run`` and trained by ``memfit.train.api.train``,
the function behind ``memfit train``). Same data, steps, batch and learning-rate grid (GRID) for every
method. Every new fact is trained on; the rate is picked on seed 0 by the recall of the validation entities'
facts (a fixed quarter of the new entities), then seeds 1 and 2 run at it, and the recall reported is that
of the other (test) entities' facts. Measured per run: that recall, the control task (copying strings never
trained on), device/host bytes of trainable state (meft_knowledge_bytes.py), bytes moved per step (MEFT's
own counters) and time per step (process CPU time, one thread; wall time beside it).

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/studies/meft_knowledge.py
        # the full bench (~15 min, 2 cores)
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/studies/meft_knowledge.py --quick
        # CI smoke: exit 1 if MEFT stops learning

Writes bench/results/meft_knowledge_fair_<date>.json (``--out``) and the plot docs/meft_knowledge.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path


from bench.studies.meft_knowledge_data import ModelSize, TaskSize

K = 256  # key-value pairs per layer of the dense Parallel Adapter and of MEFT
LORA = {"method": "lora", "lora_dropout": 0.0}
MEFT = {"method": "meft", "meft_neurons": K, "meft_n_probe": 4}


@dataclass(frozen=True)
class Method:
    name: str
    label: str
    strategy: dict
    lrs: tuple
    meft_extra: dict = field(default_factory=dict)  # Python-only MeftConfig fields (e.g. init_keys_from_ffn)


GRID = (1e-3, 3e-3, 1e-2, 3e-2)  # one learning-rate grid for every method (issue 38)
METHODS = (
    Method("lora-r2", "LoRA r=2 (all projections)", {**LORA, "lora_r": 2, "lora_alpha": 4}, GRID),
    # LoRA at about the device bytes of MEFT top-k 32 with its 256-row buffer (0.315 vs 0.295 MB)
    Method("lora-r8", "LoRA r=8 (all projections)", {**LORA, "lora_r": 8, "lora_alpha": 16}, GRID),
    Method("lora-r32", "LoRA r=32 (all projections)", {**LORA, "lora_r": 32, "lora_alpha": 64}, GRID),
    Method("pa-dense", f"Parallel Adapter K={K} (dense: MEFT top-k=K, 1 expert)",
           {**MEFT, "meft_top_k": K, "meft_experts": 1}, GRID),
    Method("meft-k12", f"MEFT K={K}, top-k 12 (4.7 %), 16 experts", {**MEFT, "meft_top_k": 12,
           "meft_experts": "auto"}, GRID),
    Method("meft-k4", f"MEFT K={K}, top-k 4 (1.6 %), 16 experts", {**MEFT, "meft_top_k": 4,
           "meft_experts": "auto"}, GRID),
    Method("meft-k12-e1", f"MEFT K={K}, top-k 12 (4.7 %), 1 expert", {**MEFT, "meft_top_k": 12,
           "meft_experts": 1}, GRID),
    # MEFT at top-k 32 with a buffer of all K rows (meft.buffer_size): the setting that matched the dense PA
    # (docs/meft.md, the ablation's item 6); top-k 12 is too sparse for this miniature
    Method("meft-k32-buf256", f"MEFT K={K}, top-k 32 (12.5 %), 16 experts, {K}-row buffer",
           {**MEFT, "meft_top_k": 32, "meft_experts": "auto", "meft_buffer_size": K}, GRID),
    Method("full", "full fine-tuning", {"method": "full"}, GRID),
)
OPTIONAL: tuple = ()  # methods run only when named (--methods); none today


@dataclass(frozen=True)
class Setup:
    task: TaskSize = TaskSize()
    model: ModelSize = ModelSize()
    pretrain_steps: int = 500
    pretrain_lr: float = 3e-3
    steps: int = 600  # 150 stopped every adapter early in its learning (docs/meft.md); 600 take ~5 min here
    batch: int = 32
    seq_len: int = 16
    seeds: tuple = (0, 1, 2)


FULL = Setup()
SHORT = 150  # the bench's first length: run keys carry "-<steps>steps" for any other, and a run longer than
# this scores recall every SHORT // 2 steps (the curves)
# --quick (CI): from the shipped base, MEFT top-k 12 alone at QUICK_LR for 300 steps, seed 0; it exits 1 unless
# MEFT's test recall is at least QUICK_GAIN above the base's step-0 recall (it learns). No MEFT-vs-LoRA line: at
# 128 facts, the only regime CI can afford, docs/meft.md finds them tied (MEFT leads only at 512 facts).
QUICK = Setup(steps=300, seeds=(0,))
QUICK_METHODS = ("meft-k12",)
QUICK_LR = 1e-2
QUICK_GAIN = 0.20


def run_dict(model: str, data: str, out: str, strategy: dict, steps: int, lr: float, seed: int,
             setup: Setup) -> dict:
    """The run file of one run (YAML-serialisable)."""
    return {
        "model": model, "hardware": "local",
        "data": {"path": data, "format": "prompt_completion", "eval_fraction": 0.0},
        "strategy": {"precision": "fp32", "micro_batch_size": setup.batch, "grad_accum": 1,
                     "seq_len": setup.seq_len, "gradient_checkpointing": False, "attention": "sdpa",
                     **strategy},
        "training": {"max_steps": steps, "learning_rate": lr, "lr_scheduler": "constant_with_warmup",
                     "warmup_steps": 10, "weight_decay": 0.0, "max_grad_norm": 1.0, "seed": seed,
                     "logging_interval": max(1, steps // 4), "checkpoint_interval": 0},
        "output_dir": out,
    }


@dataclass
class Job:
    key: str
    method: str
    lr: float
    seed: int
    run: dict
    workdir: str
    eval_batch: int
    dense_neurons: int = 0
    meft_extra: dict = field(default_factory=dict)
    result: dict = field(default_factory=dict)


@contextmanager
def meft_fields(extra: dict):
    """MeftConfig fields the run file does not expose (``init_keys_from_ffn``, ``buffer_size``...), set
    for one run by wrapping the MEFT method's config step; memfit's defaults are back afterwards.
    ``dense_adam: True`` (an ablation, not a MeftConfig field): every row of the CPU tables counts as
    touched in every step, so MEFT's row-wise AdamW becomes torch's dense AdamW (rows the batch did not
    select get a zero gradient: their moments decay and the momentum keeps moving them)."""
    extra = dict(extra)
    dense = extra.pop("dense_adam", False)
    if not extra and not dense:
        yield
        return
    import dataclasses

    from memfit.meft.store import CpuStore
    from memfit.methods.meft import Meft

    original, touched = Meft.config, CpuStore.touched_rows
    if extra:
        Meft.config = lambda self, strategy: dataclasses.replace(original(self, strategy), **extra)
    if dense:
        import torch

        CpuStore.touched_rows = lambda self: torch.arange(self.touched.numel())
    try:
        yield
    finally:
        Meft.config, CpuStore.touched_rows = original, touched


def work(job: Job) -> Job:
    """Runs in a worker process: write the run file, train it through memfit, probe, score."""
    import yaml

    import torch

    torch.set_num_threads(1)
    from bench.studies.meft_knowledge_probe import Probe, load_task

    from memfit.spec.run import load_run
    from memfit.train.api import train

    task = load_task(Path(job.workdir))
    out = Path(job.run["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out.parent / f"{out.name}.yaml").write_text(yaml.safe_dump(job.run, sort_keys=False))
    run = load_run(out.parent / f"{out.name}.yaml")
    longer = job.run["training"]["max_steps"] > SHORT  # a longer run also scores recall every 75 steps
    probe = Probe(run.strategy.method, task, job.eval_batch, curve_every=SHORT // 2 if longer else 0)
    t0 = time.perf_counter()
    with meft_fields(job.meft_extra):
        result = train(run, callbacks=[probe], overwrite=True)
    job.result = {**probe.summary(), "wall_s": time.perf_counter() - t0, "saved_to": result.saved_to,
                  "first_loss": result.first_loss, "final_loss": result.final_loss,
                  "meft_extra": job.meft_extra}
    if job.method != "pretrain":
        from bench.studies.meft_knowledge_bytes import predicted

        job.result["predicted"] = predicted(run, job.dense_neurons or None)
    (Path(job.workdir) / "results").mkdir(exist_ok=True)  # each run's row survives an interrupted bench
    (Path(job.workdir) / "results" / f"{job.key}.json").write_text(json.dumps(_job_row(job), default=str))
    return job


def run_jobs(jobs: list[Job], n: int) -> list[Job]:
    """Jobs in ``n`` worker processes (spawned, one thread each), in order of submission."""
    import multiprocessing as mp

    if n <= 1:
        return [work(j) for j in jobs]
    with mp.get_context("spawn").Pool(n, maxtasksperchild=None) as pool:
        return pool.map(work, jobs, chunksize=1)


def prepare(workdir: Path, setup: Setup, jobs: int, pretrain: bool = False) -> dict:
    """The task's files in ``workdir`` and the base model: the shipped one (bench/studies/assets/meft_base/), or with
    ``pretrain`` a fresh pre-training through memfit (method full, cached in the workdir). The result holds
    ``saved_to`` (the base's folder) and the base's step-0 scores (``recall``: test entities)."""
    from bench.studies.meft_knowledge_base import pretrained, shipped

    if pretrain:
        return pretrained(workdir, setup, run_dict, Job, run_jobs)
    return shipped(workdir, setup)


def finetune_jobs(workdir: Path, model: str, setup: Setup, methods, lr_of=None, seeds=(0,)) -> list[Job]:
    out = []
    for m in methods:
        for lr in ([lr_of[m.name]] if lr_of else m.lrs):
            for seed in seeds:
                key = f"{m.name}-lr{lr:g}-s{seed}" + (f"-{setup.steps}steps" if setup.steps != SHORT else "")
                run = run_dict(model, str(workdir / "finetune.jsonl"), str(workdir / "runs" / key), m.strategy,
                               setup.steps, lr, seed, setup)
                dense = K if m.name.startswith("pa-dense") else 0
                out.append(Job(key, m.name, lr, seed, run, str(workdir), setup.batch, dense, dict(m.meft_extra)))
    return out


def pick_lr(runs: list[Job]) -> float:
    """The rate whose run has the highest validation-entity recall (ties: the lower validation answer NLL)."""
    def rank(j: Job) -> tuple:
        val = j.result.get("recall_val")
        nll = j.result.get("val_nll")
        return (val if val is not None else j.result["recall"], -(nll if nll is not None else j.result["final_loss"]))

    return max(runs, key=rank).lr


def run_or_resume(todo: list[Job], workdir: Path, jobs: int, resume: bool) -> list[Job]:
    """Runs the jobs; with ``resume``, a job whose row is already in workdir/results/ is read back instead."""
    done = {}
    for j in todo:
        f = workdir / "results" / f"{j.key}.json"
        if resume and f.is_file():
            row = json.loads(f.read_text())
            j.result = {k: v for k, v in row.items() if k not in ("key", "method", "lr", "seed")}
            done[j.key] = j
    ran = {j.key: j for j in run_jobs([j for j in todo if j.key not in done], jobs)}
    return [done.get(j.key) or ran[j.key] for j in todo]


def bench(setup: Setup, workdir: Path, jobs: int, methods=METHODS, pretrain=False, resume=False) -> dict:
    """Seed 0 over each method's grid, the rate picked on validation recall, the other seeds at that rate."""
    t0, load0 = time.perf_counter(), os.getloadavg()
    pre = prepare(workdir, setup, jobs, pretrain)
    model = pre["saved_to"]
    search = run_or_resume(finetune_jobs(workdir, model, setup, methods, seeds=(setup.seeds[0],)), workdir, jobs,
                           resume)
    best = {m.name: pick_lr([j for j in search if j.method == m.name]) for m in methods}
    rest = run_or_resume(finetune_jobs(workdir, model, setup, methods, best, setup.seeds[1:]), workdir, jobs,
                         resume) if len(setup.seeds) > 1 else []
    from bench.studies.meft_knowledge_bytes import dense_adapter_measured

    m0 = setup.model
    return {"pretrain": pre, "best_lr": best, "lr_rule": "seed 0 over the grid; highest validation-entity recall "
            "(ties: lower validation answer NLL); recall reported on the test entities",
            "search": [_job_row(j) for j in search], "seeds": [_job_row(j) for j in rest],
            "dense_pa_measured": dense_adapter_measured(m0.layers, m0.hidden, K),
            "wall_s": time.perf_counter() - t0, "load_avg_start_end": [load0, os.getloadavg()]}


def _job_row(j: Job) -> dict:
    return {"key": j.key, "method": j.method, "lr": j.lr, "seed": j.seed, **j.result}


def custom_setup(args) -> tuple:
    """The setup and methods after the flags that narrow the bench for ablations (--methods, --lrs,
    --steps, --seeds, --model-size, --new-entities); unchanged without them."""
    setup = QUICK if args.quick else FULL
    if args.steps:
        setup = replace(setup, steps=args.steps)
    if args.seeds:
        setup = replace(setup, seeds=tuple(int(x) for x in args.seeds.split(",")))
    if args.model_size:  # HIDDENxLAYERS; FFN 2.75 x hidden as in the default (64 -> 176)
        hidden, layers = (int(x) for x in args.model_size.lower().split("x"))
        setup = replace(setup, model=ModelSize(hidden=hidden, intermediate=int(2.75 * hidden), layers=layers))
    if args.new_entities:  # more facts to store (4 per entity); the pre-training stays the same
        setup = replace(setup, task=replace(setup.task, new_entities=args.new_entities))
    methods = METHODS
    if args.quick and not args.methods:  # the smoke run: its method at its one rate
        methods = tuple(replace(m, lrs=(QUICK_LR,)) for m in METHODS if m.name in QUICK_METHODS)
    if args.methods:
        known = {m.name: m for m in METHODS + OPTIONAL}
        wanted = args.methods.split(",")
        unknown = [w for w in wanted if w not in known]
        if unknown:
            raise SystemExit(f"--methods: unknown {', '.join(unknown)}; known: {', '.join(known)}")
        methods = tuple(known[w] for w in wanted)
    if args.lrs:
        methods = tuple(replace(m, lrs=tuple(float(x) for x in args.lrs.split(","))) for m in methods)
    return setup, methods


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke version for CI: the shipped base, MEFT top-k 12, "
                    "300 steps, one seed; exits 1 unless MEFT's recall rose >= 20 points above step 0")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (one thread each)")
    ap.add_argument("--workdir", default=None, help="where models and runs go (default: a temp folder)")
    ap.add_argument("--resume", action="store_true", help="read back the runs whose rows are already in "
                    "WORKDIR/results/ (same task and setup) instead of running them again")
    ap.add_argument("--pretrain", action="store_true", help="pre-train a fresh base through memfit instead of "
                    "loading the shipped one (its CPU's floating-point path decides its weights)")
    ap.add_argument("--ship-base", action="store_true", help="pre-train (as --pretrain) and write the result "
                    "to bench/studies/assets/meft_base/ with made.json; no fine-tuning")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/meft_knowledge_fair_<date>.json)")
    ap.add_argument("--plot", default="docs/meft_knowledge.png")
    ap.add_argument("--replot", metavar="JSON", help="redraw the table and plot from results files "
                    "(comma-separated: their rows together), no training")
    ap.add_argument("--methods", help="comma-separated methods (names as in METHODS, or OPTIONAL)")
    ap.add_argument("--lrs", help="comma-separated learning-rate grid for every chosen method (default GRID)")
    ap.add_argument("--steps", type=int, help="fine-tuning steps (default 600; --quick 300)")
    ap.add_argument("--seeds", help="comma-separated seeds (the first one picks the learning rate)")
    ap.add_argument("--model-size", help="HIDDENxLAYERS of the base model (default 64x2; others need --pretrain)")
    ap.add_argument("--new-entities", type=int, help="entities whose facts are stored, 4 facts each (default 32)")
    return ap.parse_args(argv)


def regime(setup: Setup) -> str:
    """The miniature's regime, as the checklist's MEFT-vs-LoRA lines name it (docs/meft.md names both)."""
    n = setup.task.new_entities * 4
    return f"{n} facts, d={setup.model.hidden}, {setup.steps} steps"


def main(argv=None) -> int:
    args = parse(argv)
    from bench.studies.meft_knowledge_report import grid_table, plot, shape_check, summarize, table

    if args.replot:
        docs = [json.loads(Path(f).read_text()) for f in args.replot.split(",")]  # one table of several runs
        rows = [r for d in docs for r in d["rows"]]
        print(table(rows) + "\n\n" + grid_table(rows))
        print(f"plot {plot(rows, args.plot, docs[0]['pretrain']['recall'], docs[0]['setup']['steps'])}")
        print("\n".join(shape_check(rows, docs[0].get("regime", ""))))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import tempfile

    setup, methods = custom_setup(args)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="meft_knowledge_"))
    workdir.mkdir(parents=True, exist_ok=True)
    command = " ".join(["bench/studies/meft_knowledge.py", *(sys.argv[1:] if argv is None else argv)])
    if args.ship_base:
        from bench.studies.meft_knowledge_base import ship

        pre = prepare(workdir, setup, 1, pretrain=True)
        print(f"shipped {ship(pre, setup, command)}: final loss {pre['final_loss']:.3f}, "
              f"step-0 test recall {100 * pre['recall']:.1f} %")
        return 0
    custom = (methods is not METHODS and not (args.quick and not args.methods and not args.lrs)) \
        or setup not in (FULL, QUICK) or args.pretrain
    raw = bench(setup, workdir, args.jobs, methods, args.pretrain, args.resume)
    rows = summarize(raw, {m.name: m.label for m in METHODS + OPTIONAL})
    doc = {"date": time.strftime("%Y-%m-%d"), "command": command, "setup": asdict(setup), "K": K,
           "grid": sorted({lr for m in methods for lr in m.lrs}), "regime": regime(setup), "rows": rows, **raw}
    tag = "custom_" if custom else "quick_" if args.quick else ""
    out = Path(args.out or f"bench/results/meft_knowledge_fair_{tag}{doc['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str))
    print(table(rows) + "\n\n" + grid_table(rows))
    print(f"wall {raw['wall_s']:.0f} s; results {out}")
    if not (args.quick or custom):
        print(f"plot {plot(rows, args.plot, raw['pretrain']['recall'], setup.steps)}")
    if not args.quick:
        print("\n".join(shape_check(rows, doc["regime"])))
        return 0
    ok, lines = quick_check(rows, raw["pretrain"]["recall"])
    print("\n".join(lines))
    return 0 if ok else 1


def quick_check(rows: list[dict], step0: float) -> tuple:
    """(ok, lines): MEFT top-k 12 learned: its test recall is at least QUICK_GAIN above the base's step-0 recall
    of the same facts."""
    by = {r["method"]: r for r in rows}
    if not all(m in by for m in QUICK_METHODS):
        return False, [f"--quick check: needs the methods {', '.join(QUICK_METHODS)}; ran {', '.join(by)}"]
    meft = by[QUICK_METHODS[0]]
    ok = meft["recall"] >= step0 + QUICK_GAIN
    return ok, [f"{'PASS' if ok else 'FAIL'} MEFT learns: test recall {100 * meft['recall']:.1f} % >= step 0 "
                f"{100 * step0:.1f} % + {100 * QUICK_GAIN:.0f} points"]


if __name__ == "__main__":
    raise SystemExit(main())
