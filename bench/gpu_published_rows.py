"""Published GPU memory rows (../shared/reference/gpu-runs/public.jsonl) and memfit's own GPU checks as memfit
runs: each row becomes (preset, HardwareSpec, Strategy, the metric it published, the measured bytes, its
status), or a Skip naming the feature memfit cannot express. bench/gpu_published.py predicts and scores them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from memfit.errors import MemfitError
from memfit.spec.hardware import GiB, HardwareSpec, find_gpu
from memfit.spec.model import resolve_model
from memfit.spec.strategy import Strategy
from bench import jsonl

HERE = Path(__file__).resolve().parent
_REL = Path("reference") / "gpu-runs" / "public.jsonl"
# ../shared beside the repository (the lead's checkout), shared/ inside it, or the project's shared folder
DEFAULT_FILE = next((p for p in (HERE.parent.parent / "shared" / _REL, HERE.parent / "shared" / _REL,
                                 Path("/work/shared") / _REL) if p.is_file()), HERE.parent.parent / "shared" / _REL)
MODELS = {  # published model id -> memfit preset (same architecture numbers)
    "meta-llama/Llama-3.2-3B": "llama-3.2-3b", "mistralai/Mistral-7B-v0.1": "mistral-7b",
    "NousResearch/Llama-2-70b-hf": "llama-2-70b", "meta-llama/Llama-2-70b-hf": "llama-2-70b",
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b", "meta-llama/Llama-3.3-70B-Instruct": "llama-3.1-70b",
    "mistralai/Mixtral-8x7B-Instruct-v0.1": "mixtral-8x7b", "bigcode/gpt_bigcode-santacoder": "santacoder",
    "tiiuae/falcon-7b": "falcon-7b", "Qwen/Qwen2.5-0.5B-Instruct": "qwen2.5-0.5b",
}
UNSUPPORTED = {"T0": "encoder-decoder models (T5: T0_3B, mt0-xxl)",
               "mt0": "encoder-decoder models (T5: T0_3B, mt0-xxl)",
               "bloomz": "BLOOM (ALiBi attention) configs", "glm": "GLM-4 (remote-code chatglm) configs"}
GPUS = {"L40S": "L40S-48GB", "A100 80GB": "A100-80GB", "A100-SXM4-80GB": "A100-80GB", "80GB A100": "A100-80GB",
        "A100 40GB": "A100-40GB", "40GB GPUs": "A100-40GB", "H100 80GB": "H100-80GB", "RTX 4090": "RTX4090-24GB"}


# PEFT methods whose count the bench does not run: a package the pinned set lacks, or a build far too slow
# (memfit.methods.peft.count builds on the CPU what the meta device cannot: FRoD decomposes every base weight)
PEFT_SKIPS = {
    "ADAMSS": "PEFT method ADAMSS needs scikit-learn to build (not in memfit's pinned set)",
    "FROD": "PEFT method FROD: its build decomposes every base weight (minutes on the CPU; the meta device "
            "cannot); not counted by the bench",
}


class Skip(Exception):
    """A row memfit cannot express; the message names the missing feature."""


@dataclass
class Case:
    id: str
    group: str
    model: str
    hardware: HardwareSpec
    strategy: Strategy
    metric: str  # allocated | reserved | nvidia-smi | capacity
    measured: float  # bytes (None for OOM rows)
    status: str  # success | oom | boundary
    reliability: str
    overrides: dict = None  # Profile values the run itself set


def _bytes(mem: dict) -> float:
    unit = (mem.get("unit") or "").lower()
    value = float(mem["value"])
    return value * {"bytes": 1, "b": 1, "mib": 2**20, "gib": GiB, "gb": 1e9}[unit]


def _metric(cls: str) -> str:
    cls = cls.lower()
    if "allocated" in cls:
        return "allocated"
    if "reserved" in cls:
        return "reserved"
    if "capacity" in cls:
        return "capacity"
    return "nvidia-smi"  # nvidia-smi, 'unspecified (likely nvidia-smi)', 'system metric': what the card shows


def _hardware(row: dict, mem_cap: float | None) -> HardwareSpec:
    text = row["gpu"]["model"] or ""
    name = next((v for k, v in GPUS.items() if k in text), None)
    if mem_cap is not None:  # a card of the row's stated size (how its limit was set is not said)
        gpu = replace(find_gpu(name or "H100-80GB"), name=f"{mem_cap / GiB:g}GiB-card", memory_bytes=int(mem_cap))
    elif name is None:
        raise Skip(f"GPU {text!r} not named")
    else:
        gpu = find_gpu(name)
    return HardwareSpec(gpu=gpu, gpus_per_node=int(row["gpu"]["count"] or 1), cpu_ram_bytes=2048 * GiB)


def _method(row: dict) -> tuple[str, dict]:
    method = row["method"]
    pc, lora = row.get("peft_config") or {}, row.get("lora") or {}
    dora = bool(pc.get("use_dora")) or method.endswith("+dora")
    method = method.removesuffix("+dora")
    if method.startswith("full"):
        return "full", {}
    if method in ("lora", "qlora") and "LoRA-FA" not in method:
        if dora:  # PEFT's LoRA with use_dora: memfit's dora method (methods/dora/)
            if method == "qlora":
                raise Skip("QLoRA with DoRA is not a memfit method (dora runs on a 16-bit base)")
            method = "dora"
        r = pc.get("r") or lora.get("r")
        targets = pc.get("target_modules") if pc else lora.get("targets")
        targets = targets or ["q_proj", "v_proj"]  # PEFT's Llama default
        if isinstance(targets, str):
            targets = [targets]
        targets = [t if t.endswith("_proj") or t == "all-linear" or "_" in t else f"{t}_proj" for t in targets]
        dropout = pc.get("lora_dropout", lora.get("dropout", 0.05)) or 0.0
        options = {"lora_rslora": bool(pc.get("use_rslora")),  # LoRA's options as memfit's lora method takes them
                   "lora_modules_to_save": tuple(pc.get("modules_to_save") or ()),
                   "lora_rank_pattern": pc.get("rank_pattern") or {},
                   "lora_alpha_pattern": pc.get("alpha_pattern") or {}}
        return method, {"lora_r": int(r or 8), "lora_targets": tuple(targets), "lora_dropout": float(dropout),
                        **options}
    if "LoRA-FA" in method:
        from memfit.methods import NAMES

        raise Skip(f"the LoRA-FA optimizer is not a memfit method ({', '.join(NAMES)})")
    if row["source_group"] == "peft-mmqa" and str(row.get("gradient_checkpointing") or "").startswith("yes"):
        # the group's reserved peak spans the whole process, generation-based evaluation included (batch 64,
        # up to 800 tokens: ~6 GB of KV cache beside the 6.4 GB of weights); a checkpointed step is smaller
        raise Skip("peft-mmqa with checkpointing: the process-wide peak is the evaluation's generation, not "
                   "the training step")
    return "peft", {"peft_config": peft_config(pc, method, row)}


def peft_config(pc: dict, method: str, row: dict) -> dict:
    """The row's PEFT config as method=peft reads it: fields the source elided ('<56 entries omitted>')
    left at PEFT's defaults; Bone (peft < 0.18) is MiSS at peft 0.21.2 (the same layer, renamed)."""
    kind = str(pc.get("peft_type") or "").upper()
    if not kind:
        raise Skip(f"PEFT method {method}: no peft_config published")
    out = {k: v for k, v in pc.items() if not (isinstance(v, str) and v.startswith("<") and "omitted" in v)}
    if kind == "BONE":
        out["peft_type"] = "MISS"
    if kind in PEFT_SKIPS:
        raise Skip(PEFT_SKIPS[kind])
    peft_version = tuple(int(p) for p in ((row.get("software") or {}).get("peft") or "0.0").split(".")[:2])
    if kind == "OFT" and peft_version < (0, 16):
        raise Skip("OFT measured at peft < 0.16 (the weight-rotating layer; memfit reads the pinned 0.21.2's "
                   "input-rotating one)")
    return out


def _engine(row: dict) -> dict:
    eng = (row.get("engine") or "").lower()
    if eng.startswith("single gpu") and "deepspeed" not in eng:
        return {}
    if "grpo" in (row.get("method") or "").lower():
        raise Skip("GRPO: a generation engine (vLLM) shares the GPU with training")
    if "zero-3" in eng or "zero3" in eng:
        out = {"zero_stage": 3}
        if "param+optimizer" in eng or "optimizer and param" in eng:
            out["offload"] = "optimizer+params"
        return out
    if "zero-2" in eng:
        return {"zero_stage": 2, **({"offload": "optimizer"} if "offload_optimizer=true" in eng else {})}
    if "fsdp" in eng:
        return _fsdp(row, eng)
    if int(row["gpu"]["count"] or 1) > 1:
        raise Skip(f"multi-GPU engine {row['engine']!r} not recognised")
    return {}


def _fsdp(row: dict, eng: str) -> dict:
    """An FSDP engine: the sharding the text names, else accelerate's default (FullyShardedDataParallelPlugin:
    FULL_SHARD) where accelerate launched it; FSDP2 where the text says fully_shard / FSDP2, else FSDP1 (what
    accelerate's plugin, fms-hf-tuning and Answer.AI ran in 2024); CPU offload of parameters where named."""
    if "not given" in eng or "not published" in eng:
        raise Skip("FSDP settings not published")
    named = "shard_grad_op" if ("shard_grad_op" in eng or "shard grad op" in eng) else \
        "full_shard" if ("full_shard" in eng or "full shard" in eng) else None
    if named is None and "accelerate" not in eng + (row.get("framework") or "").lower():
        raise Skip("FSDP settings not published")
    out = {"fsdp": named or "full_shard",
           "fsdp_version": 2 if ("fsdp2" in eng or "fully_shard" in eng) else 1}
    if "cpuoffload" in eng.replace(" ", "").replace("_", "") or "offload_params" in eng:
        out["offload"] = "optimizer+params"
    return out


def _legacy_checkpoint(row: dict, kw: dict) -> bool:
    """transformers < 4.52's own checkpointing (reentrant, around each decoder layer: around its FSDP1 unit)
    where the HF Trainer / TRL enabled it (strategy.hf_legacy_checkpoint; memfit.estimate.fsdp1). Answer.AI's
    train.py and torchtune checkpoint inside the units; a row that names use_reentrant=False is not."""
    if not (kw.get("fsdp") and kw.get("fsdp_version") == 1 and kw.get("gradient_checkpointing")):
        return False
    gc_text = str(row.get("gradient_checkpointing") or "").lower().replace(" ", "")
    framework = (row.get("framework") or "").lower()
    if "use_reentrant=false" in gc_text or not any(k in framework for k in ("trainer", "trl", "fms-hf-tuning")):
        return False
    version = str((row.get("software") or {}).get("transformers") or "")
    parts = version.split(".")[:2]
    return len(parts) == 2 and all(p.isdigit() for p in parts) and (int(parts[0]), int(parts[1])) < (4, 52)


def _precision(row: dict, method: str) -> str:
    text = (row.get("precision") or "").lower()
    if "pure" in text:
        return "bf16"  # weights, grads and optimizer states in bf16 (PEFT's adapters in fp32)
    if method == "full" and "torch_dtype bf16" in text and "autocast" in text:
        return "bf16"  # bf16 weights: autocast changes nothing, AdamW states in bf16
    return "bf16-mixed"


def convert(row: dict) -> Case:
    group = row["source_group"]
    model_id = row["model"]
    if model_id not in MODELS:
        raise Skip(UNSUPPORTED.get(model_id.split("/")[-1].split("_")[0].split("-")[0], f"model {model_id}"))
    engine = _engine(row)
    try:
        spec = resolve_model(MODELS[model_id])
    except MemfitError as err:
        raise Skip(str(err)) from None
    status = (row.get("status") or "").lower()
    status = "oom" if ("oom" in status or "failed" in status) else "boundary" if "boundary" in status else "success"
    prim = row.get("primary_memory") or {}
    metric = _metric(prim.get("metric_class") or "") if prim else "nvidia-smi"
    cap = _bytes(prim) if metric == "capacity" else None
    if metric == "capacity":  # a card size 'N GB' is an N GiB part (as memfit's GPU catalog reads it)
        cap = float(prim["value"]) * GiB
    if row.get("micro_batch_size") is None:
        raise Skip("micro-batch size not published")
    method, lora = _method(row)
    seq = (row.get("sequence_length") or {}).get("value")
    if seq is None:
        if status != "oom":
            raise Skip("sequence length not published")
        seq = 256  # 'OOM at any length tested': the shortest length still does not fit
    gc_text = str(row.get("gradient_checkpointing") or "").lower()
    if gc_text.startswith("unknown") and "presumed" not in gc_text:
        raise Skip("gradient checkpointing not published")
    attn = (row.get("attention_implementation") or "").lower()
    attention = "fa2" if "flash_attention_2" in attn else "eager" if attn.startswith("eager") else "sdpa"
    # learned positions cap the length (santacoder: 2048; its 4096-token packing is truncated to it)
    seq = min(int(seq), spec.max_positions)
    kw = dict(method=method, micro_batch_size=int(row["micro_batch_size"]), seq_len=int(seq),
              grad_accum=int(row.get("grad_accumulation") or 1), gradient_checkpointing=not gc_text.startswith("no"),
              attention=attention, precision=_precision(row, method), **lora, **engine)
    q = (row.get("quantization") or "").lower()
    if method == "qlora":
        kw["double_quant"] = "double" in q or "nested" in q or "4-bit (qlora)" in q
        sharded = kw.get("zero_stage") == 3 or bool(kw.get("fsdp"))
        if "quant_storage bf16" in q or ("quant_storage=bf16" in q and sharded):
            kw["quant_storage"] = "bf16"
    kw["hf_legacy_checkpoint"] = _legacy_checkpoint(row, kw)
    try:
        strategy = Strategy(**kw)
    except Exception as err:  # pydantic: a combination memfit does not model
        raise Skip(f"strategy not expressible: {str(err).splitlines()[-1]}") from None
    measured = None if status == "oom" else (cap if metric == "capacity" else _bytes(prim))
    return Case(row["id"], group, MODELS[model_id], _hardware(row, cap), strategy, metric, measured, status,
                row.get("reliability") or "")


def load_gpu_check(path: Path) -> list[Case]:
    """memfit's own trainer measured on a GPU by bench/gpu_check.py (its JSON): allocated and reserved."""
    data = json.loads(path.read_text())
    gpu = "H200-141GB" if "H200" in data["environment"]["gpu"] else data["environment"]["gpu"]
    group = f"gpu-check-{gpu.split('-')[0].lower()}"
    hw = HardwareSpec(gpu=find_gpu(gpu), cpu_ram_bytes=2048 * GiB)
    cases = []
    for r in data["records"]:
        env = r.get("env") or {}  # the check set the allocator's mode in the environment (memfit train: allocator)
        expandable = "expandable_segments:True" in env.get("PYTORCH_CUDA_ALLOC_CONF", "")
        st = Strategy(**{**r["run"]["strategy"], **({"allocator": "expandable_segments"} if expandable else {})})
        over = None
        m = r["measured"]
        for metric, key in (("allocated", "peak_allocated_bytes"), ("reserved", "peak_reserved_bytes")):
            cases.append(Case(f"{group}-{r['name']}" + ("" if metric == "allocated" else "#reserved"), group,
                              r["shape"], hw, st, metric, float(m[key]), "success", "high", over))
    return cases


def load(path: Path) -> tuple[list[Case], list[dict]]:
    cases, skipped = [], []
    for row in jsonl.rows(path):
        try:
            case = convert(row)
            cases.append(case)
            smi = (row.get("memory") or {}).get("nvidia_smi_peak")
            if smi and case.metric != "nvidia-smi" and case.status == "success":  # a second published figure
                cases.append(replace(case, id=case.id + "#nvidia-smi", metric="nvidia-smi", measured=_bytes(smi)))
        except Skip as why:
            skipped.append({"id": row["id"], "group": row["source_group"], "why": str(why)})
    return cases, skipped
