"""Host ops each PEFT layer type adds per wrapped module, counted: the kernels its forward + backward launch
beyond a LoRA adapter's on the same modules, in the GPU time model's unit (LoRA's wrapper = GENERIC_OPS
module-level ops, memfit.methods.peft.work). Writes memfit/methods/peft/host_ops.json, which the time model
reads; ``--check`` exits 1 when that file differs from what this counts.

    PYTHONPATH=. .venv/bin/python bench/peft_host_ops.py            # count, print
    PYTHONPATH=. .venv/bin/python bench/peft_host_ops.py --write    # + rewrite memfit/methods/peft/host_ops.json
    PYTHONPATH=. .venv/bin/python bench/peft_host_ops.py --check    # exit 1 when the file is stale

How: a 2-layer Llama (h 1024, 16 heads of 64, 4 KV heads, FFN 2048, bf16 base, PEFT's fp32 adapters as
PEFT's method comparison runs them) with random weights on this CPU; one forward + backward of 2 × 16 tokens
under a TorchDispatchMode that counts every ATen op that launches a kernel (views, reshapes and detaches
do not; a warm-up pass first, gradients set to None between, as a training loop does). For each PEFT type
of PEFT's MetaMathQA comparison (gpu-runs/public-time.jsonl's peft-mmqa rows, each type's first config):
(ops with the type − ops with LoRA r 8 on the same modules) / wrapped modules = extra kernels per module;
LoRA's own kernels per module (LoRA on q + v minus LoRA on q, per layer) are GENERIC_OPS module-level ops,
which sets the unit. The counts hold for the config counted (e.g. OFT's block count, PSOFT's Cayley terms);
types whose op count grows with the shape are named in the file's notes. AdaLoRA's rank allocator
(``update_and_allocate``, called once per optimizer step by PEFT's run.py) is counted apart (``step_ops``, per
wrapped module).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import warnings
from pathlib import Path

from memfit.methods.peft.work import GENERIC_OPS, HOST_OPS_FILE

HERE = Path(__file__).resolve().parent

ROWS = HERE.parent.parent / "shared" / "reference" / "gpu-runs" / "public-time.jsonl"
SHAPE = dict(model_type="llama", hidden_size=1024, intermediate_size=2048, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, num_hidden_layers=2, vocab_size=256)
NO_KERNEL = {"view", "_unsafe_view", "t", "detach", "transpose", "expand", "slice", "unsqueeze", "squeeze",
             "permute", "reshape", "alias", "split", "select", "as_strided", "unbind", "split_with_sizes",
             "_reshape_alias", "lift_fresh", "resolve_conj", "resolve_neg", "view_as_real", "view_as_complex"}
SKIP = {"PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "LN_TUNING", "TRAINABLE_TOKENS"}  # no wrapped linear


def configs(path: Path = ROWS) -> dict:
    """PEFT type -> the first peft-mmqa row's config (as bench/gpu_published_rows.peft_config maps it)."""
    from bench.gpu_published_rows import Skip, peft_config

    out: dict = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        pc = row.get("peft_config") or {}
        if not row["id"].startswith("peft-mmqa") or not pc.get("peft_type"):
            continue
        try:
            cfg = peft_config(pc, row.get("method") or "", row)
        except Skip:
            continue
        kind = cfg["peft_type"]
        if kind not in SKIP and kind != "LORA":
            out.setdefault(kind, cfg)
    return out


def _counter():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] not in NO_KERNEL:
                self.ops[func.__name__] += 1
            return func(*args, **(kwargs or {}))
    return Count


def kernels(peft_cfg: dict | None, step: bool = False) -> tuple[int, int, int]:
    """(kernel ops of one forward + backward, wrapped modules, kernel ops of update_and_allocate)."""
    import torch
    from peft import get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer
    from transformers import AutoConfig, AutoModelForCausalLM

    from memfit.methods.peft.count import peft_config_object

    torch.manual_seed(0)
    shape = dict(SHAPE)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(shape.pop("model_type"), **shape))
    model = get_peft_model(base.to(torch.bfloat16), peft_config_object(peft_cfg))
    wrapped = sum(isinstance(m, BaseTunerLayer) for m in model.modules())
    x = torch.randint(0, SHAPE["vocab_size"], (2, 16))
    model.train()
    count = _counter()
    for counted in (False, True):
        model.zero_grad(set_to_none=True)
        with count() if counted else contextlib.nullcontext() as c:
            model(input_ids=x, labels=x).loss.backward()
    fwd_bwd = sum(c.ops.values())
    step_ops = 0
    if step and hasattr(model.base_model, "update_and_allocate"):
        with count() as s:
            model.base_model.update_and_allocate(peft_cfg.get("tinit", 0) + 1)
        step_ops = sum(s.ops.values())
    return fwd_bwd, wrapped, step_ops


def lora(targets) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "target_modules": targets}


def lora_kernels(targets, shape: tuple) -> int:
    """Kernels of LoRA r 8 on ``targets``, counted once per target set and shape (most types share q + v)."""
    key = (tuple(sorted(targets)), shape)
    if key not in _LORA:
        _LORA[key] = kernels(lora(list(targets)))[0]
    return _LORA[key]


_LORA: dict = {}


def count_all(cfgs: dict) -> dict:
    shape = tuple(sorted(SHAPE.items()))
    both, one = lora_kernels(["q_proj", "v_proj"], shape), lora_kernels(["q_proj"], shape)
    per_lora = (both - one) / SHAPE["num_hidden_layers"]
    unit = per_lora / GENERIC_OPS  # kernels per module-level op
    out = {"unit_kernels_per_op": round(unit, 3), "lora_kernels_per_module": per_lora, "types": {}}
    for kind, cfg in sorted(cfgs.items()):
        cfg = dict(cfg)
        if kind == "ADAPTION_PROMPT":
            cfg["adapter_layers"] = min(int(cfg.get("adapter_layers") or 1), SHAPE["num_hidden_layers"])
        if kind == "ADALORA":  # its schedule needs total_step; the allocator counted once past tinit
            cfg.setdefault("total_step", 1000)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                ops, wrapped, step_ops = kernels(cfg, step=kind == "ADALORA")
                targets = cfg.get("target_modules")
                ref = lora_kernels(targets, shape) if isinstance(targets, list) else None
            except Exception as err:  # noqa: BLE001  (one type PEFT cannot build on this shape: say which)
                out["types"][kind] = {"error": str(err).splitlines()[0][:160]}
                continue
        entry = {"kernels": ops, "wrapped": wrapped}
        if ref is not None and wrapped:
            entry["ops"] = round((ops - ref) / wrapped / unit, 2)
        if step_ops:
            entry["step_ops"] = round(step_ops / wrapped / unit, 2)
        out["types"][kind] = entry
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    got = count_all(configs())
    print(f"LoRA: {got['lora_kernels_per_module']:.1f} kernels per wrapped module = {GENERIC_OPS:g} ops "
          f"({got['unit_kernels_per_op']:.2f} kernels per op)")
    for kind, e in got["types"].items():
        print(f"  {kind:16s} " + (f"error: {e['error']}" if "error" in e else
                                  f"{e.get('ops', float('nan')):+7.2f} ops per module beyond LoRA's "
                                  f"({e['kernels']} kernels, {e['wrapped']} modules)"
                                  + (f", {e['step_ops']:g} ops per module and optimizer step"
                                     if "step_ops" in e else "")))
    if args.write:
        command = "PYTHONPATH=. .venv/bin/python bench/peft_host_ops.py --write"
        HOST_OPS_FILE.write_text(json.dumps({**got, "command": command, "shape": SHAPE}, indent=1,
                                            sort_keys=True) + "\n")
    if args.check:
        have = json.loads(HOST_OPS_FILE.read_text()) if HOST_OPS_FILE.is_file() else {}
        if have.get("types") != got["types"]:
            print(f"error: {HOST_OPS_FILE.name} is stale; run: PYTHONPATH=. python bench/peft_host_ops.py --write")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
