"""The Key-Experts gate MEFT puts on its selected neurons, read from trained runs of
bench/studies/meft_knowledge_ablation.py (docs/meft.md, item 6 (iii)): the pre-trained base of the workdir plus a
run's saved adapter (``load_meft``), one forward over the new facts, and the gate of every selected (token,
neuron) pair (``n_probe`` x softmax over the token's probed experts; 1 on average at initialisation).

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/studies/meft_knowledge_gates.py --workdir /tmp/mka \\
        meft-k12-probe16-buf256-lr0.01-s0-600steps meft-k12-buf256-dense-adam-lr0.01-s0-600steps
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def gates(base: str, adapter: str | None, records: list[dict]):
    """The gates of all selected pairs, all layers (a 1-d tensor); ``adapter`` None: a fresh MEFT of the
    ablation's top-k 12 with all 16 experts probed (the initialisation)."""
    import torch
    from transformers import AutoModelForCausalLM

    import memfit.meft.layer as layer
    from memfit.meft import MeftConfig, add_meft, load_meft
    from bench.studies.meft_knowledge_data import build_tokenizer, encode

    model = AutoModelForCausalLM.from_pretrained(base)
    if adapter:
        model = load_meft(model, adapter) or model
    else:
        model = add_meft(model, MeftConfig(neurons=256, top_k=12, experts="auto", n_probe=16, buffer_size=256))
    ids, mask, _ = encode(records, build_tokenizer())
    got, original = [], layer.SparseAdapterFn.apply

    def capture(x, sel, gate, *rest):
        if gate is not None:
            got.append(gate[sel > 0].flatten())
        return original(x, sel, gate, *rest)

    layer.SparseAdapterFn.apply = capture
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        layer.SparseAdapterFn.apply = original
    return torch.cat(got)


def line(name: str, g) -> str:
    import torch

    q = torch.quantile(g, torch.tensor([0.1, 0.5, 0.9])).tolist()
    return (f"{name}: {g.numel()} pairs, gate mean {g.mean():.2f}, p10 / median / p90 {q[0]:.3f} / {q[1]:.3f} / "
            f"{q[2]:.2f}, below 0.1: {(g < 0.1).float().mean():.0%}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/mka")
    ap.add_argument("runs", nargs="*", help="run folders under <workdir>/runs (their meft/ adapter)")
    args = ap.parse_args(argv)
    work = Path(args.workdir)
    base = json.loads((work / "pretrain.json").read_text())["result"]["saved_to"]
    facts = json.loads((work / "task.json").read_text())["new_facts"]
    print(line("initialisation (top-k 12, 16 of 16 probed)", gates(base, None, facts)))
    for run in args.runs:
        print(line(run, gates(base, str(work / "runs" / run / "meft"), facts)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
