"""Published long-context rows (../shared/reference/long-context/public-long-context.jsonl) as memfit runs: each
row becomes a Case (model, HardwareSpec, Strategy, the metric it published, its value in memfit's units) or a
NotStated listing every reason memfit cannot state it. bench/long_context.py predicts and scores them.

The rules read the rows' fields, never a row's id (decided with these rows in view: bench/provenance.json,
source group "long-context", so every figure is development):

* model: a preset of the same architecture, or the model's published config.json (Qwen3, Llama-3.1-405B) or a
  preset's with the fields the model changes (Meta-Llama-3-8B: Llama-3.1-8B's numbers at 8192 positions, no
  rope_scaling); a model whose config is not published is not stated.
* method: ``full...`` -> full; an unstated method is not stated.
* GPU: the catalog part the text names with its size ("80GB likely" read as 80 GB); a text naming no part but
  implying a size (">=80GB implied") -> memory rows on a stand-in H100-80GB (a GPU's bytes hardly depend on the
  part: CUDA context by generation), time and longest-length rows not stated; two sizes or none, a part not in
  memfit's catalog -> not stated. CPU RAM per node: the notes' "N TB CPU RAM" where given, else 2 TiB.
* engine: zero_stage -> ZeRO (optimizer_offload cpu -> offload optimizer, + param_offload cpu ->
  optimizer+params); FSDP1 named -> fsdp full_shard v1; torchtitan's fsdp_degree -> FSDP2 full_shard.
* sequence: Ulysses sp_degree -> sequence_parallel; torch (DTensor) context parallelism cp_degree ->
  context_parallel; ring attention under ZeRO (ring-flash-attn), FPDT chunking, Megatron's CP -> not stated.
* levers memfit lacks -> not stated: tensor / pipeline parallelism, FP8 matmuls (float8, Transformer Engine),
  torch.compile, packing, a Megatron engine.
* activation_checkpointing true / "full" / any named checkpointing -> gradient_checkpointing; not published
  -> not stated. activation_offload: the checkpointed layers' inputs (hidden states, ALST's / axolotl's
  checkpoint offload) -> checkpointed; "all saved activations" -> all. tiled_mlp as published.
* loss: a fused *linear* cross-entropy (Liger's FLCE: never the whole logits) -> loss=chunked; another fused
  CE kernel (flash-attn's xentropy still takes the whole logits) -> standard. liger_kernel with Liger's FLCE ->
  liger=true (its RMSNorm, fused gate activation and RoPE too, as transformers' use_liger_kernel applies them);
  without it -> noted, not modelled.
* attention: fa2 named -> fa2; SDPA or not published -> sdpa (transformers' default); TE / per-chunk
  attention -> not stated.
* precision: "mixed"/"master" named, or bf16 under DeepSpeed (its bf16 optimizer keeps fp32 master weights
  and Adam states) -> bf16-mixed; bare "bf16" without DeepSpeed (the weights loaded in bf16, as axolotl's
  bf16: true does) -> bf16.
* shape: micro_batch, grad_accum (not published -> 1), seq_len; a missing micro-batch is not stated.
* metric: reserved (torch max_memory_reserved) -> memfit's reserved peak; peak_unspecified -> the
  nvidia-smi level (reserved + CUDA context + NCCL), as bench/gpu_published.py reads unnamed figures;
  tokens_per_s per GPU or total as the unit says (a bare unit over several GPUs is not stated);
  s_per_step; tflops only where the unit names the model-FLOP formula with recompute (Megatron-LM's,
  ALST's reading); max_seq_len. memfit's engine rules (memfit.plan.rules.check) refusing the run -> not stated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from memfit.spec.hardware import CATALOG, GiB, HardwareSpec, find_gpu
from memfit.spec.model import ModelSpec, model_from_config, preset_config, resolve_model
from memfit.spec.strategy import Strategy
from bench import jsonl

HERE = Path(__file__).resolve().parent
_REL = Path("reference") / "long-context" / "public-long-context.jsonl"
DEFAULT_FILE = next((p for p in (HERE.parent.parent / "shared" / _REL, HERE.parent / "shared" / _REL,
                                 Path("/work/shared") / _REL) if p.is_file()), HERE.parent.parent / "shared" / _REL)
GROUP = "long-context"  # the source group bench/provenance.json names
DEFAULT_CPU_RAM = 2048 * GiB  # per node where the source does not say (bench/gpu_published_rows.py's choice)

PRESETS = {  # published model id -> memfit preset (same architecture numbers)
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b", "meta-llama/Llama-3.1-8B": "llama-3.1-8b",
    "meta-llama/Llama-2-7b-hf": "llama-2-7b", "meta-llama/Llama-2-13b-hf": "llama-2-13b",
}
_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
          "hidden_act": "silu", "max_position_embeddings": 40960, "num_attention_heads": 32,
          "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
          "rope_theta": 1000000, "vocab_size": 151936, "torch_dtype": "bfloat16"}
CONFIGS = {  # published config.json (huggingface.co/<id>/blob/main/config.json), the fields memfit reads
    "Qwen/Qwen3-8B": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False},
    "Qwen/Qwen3-4B": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "tie_word_embeddings": True},
    "meta-llama/Llama-3.1-405B": {**preset_config("llama-3.1-8b"), "hidden_size": 16384,
                                  "intermediate_size": 53248, "num_attention_heads": 128,
                                  "num_hidden_layers": 126, "num_key_value_heads": 8},
    # Llama 3 (April 2024): Llama-3.1-8B's numbers at its original 8192 positions, no rope_scaling
    "meta-llama/Meta-Llama-3-8B": {**preset_config("llama-3.1-8b"), "max_position_embeddings": 8192,
                                   "rope_scaling": None},
}
STAND_IN_GPU = "H100-80GB"  # memory rows whose GPU is unnamed but of an implied size


class NotStated(Exception):
    """A row memfit cannot state; ``reasons`` lists every reason (``args[0]`` joins them)."""

    def __init__(self, reasons: list[str]):
        super().__init__("; ".join(reasons))
        self.reasons = reasons


@dataclass
class Case:
    id: str
    source: str  # source_key
    model: ModelSpec
    hardware: HardwareSpec
    strategy: Strategy
    metric: str  # reserved | nvidia-smi | max_seq_len | tokens_per_s | s_per_step | tflops
    published: float  # bytes, tokens, tokens/s, seconds or TFLOPS (as metric)
    per_gpu: bool = False  # tokens_per_s: per GPU (else the total over the pool)
    reliability: str = ""
    overrides: dict = field(default_factory=dict)  # Profile values the run set (none today: the allocator is a key)
    notes: list = field(default_factory=list)  # what the mapping approximates

    @property
    def data_parallel(self) -> int:
        """Replicas each holding whole sequences: the pool over the ranks that share one sequence."""
        s = self.strategy
        return self.hardware.world_size // (s.sequence_parallel * s.context_parallel)


def model_for(name: str) -> ModelSpec:
    if name in PRESETS:
        return resolve_model(PRESETS[name])
    if name in CONFIGS:
        return model_from_config(CONFIGS[name], name=name, where=f"{name} config.json")
    raise KeyError(name)


def _on(value) -> bool:
    """A lever's field switched on: true, a number above 1 or a name (not None / false / 0 / 1)."""
    if value is None or value is False:
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value > 1
    return True


def _gpu(row: dict, metric: str, reasons: list, notes: list):
    text = row.get("gpu") or ""
    low = text.lower()
    sizes = re.findall(r"(\d+)\s*gb", low)
    part = next((p for p in ("h100", "a100", "h200", "b200", "l40s", "a10g", "v100") if p in low), None)
    if part is None:
        if sizes and metric in ("reserved", "nvidia-smi"):
            notes.append(f"GPU unnamed ({text!r}): memory on a stand-in {STAND_IN_GPU}")
            return find_gpu(STAND_IN_GPU)
        reasons.append(f"GPU not published ({text!r})" + ("" if metric in ("reserved", "nvidia-smi")
                                                           else ": time and longest length depend on the part"))
        return None
    names = [n for n in CATALOG if n.lower().startswith(part) and "pcie" not in n.lower()]
    if not names:
        reasons.append(f"GPU {text!r} is not in memfit's catalog")
        return None
    if "/" in low or len(set(sizes)) != 1:
        reasons.append(f"GPU memory size not published ({text!r})")
        return None
    name = next((n for n in names if n.lower().endswith(f"-{sizes[0]}gb")), None)
    if name is None:
        reasons.append(f"GPU {text!r} is not in memfit's catalog ({', '.join(names)})")
        return None
    if "likely" in low:
        notes.append(f"GPU size as the transcriber reads it ({text!r})")
    return find_gpu(name)


def _cpu_ram(row: dict) -> int:
    m = re.search(r"([\d.]+)\s*TB CPU RAM", row.get("notes") or "")
    return int(float(m.group(1)) * 1e12) if m else DEFAULT_CPU_RAM


def _metric(row: dict, reasons: list) -> tuple[str, float, bool]:
    metric, unit, value = row["metric"], (row.get("unit") or ""), float(row["value"])
    u = unit.lower()
    if metric in ("reserved", "peak_unspecified"):
        scale = {"gib": GiB, "gb": 1e9}.get(u)
        if scale is None:
            reasons.append(f"memory unit {unit!r}")
            scale = 1.0
        return ("reserved" if metric == "reserved" else "nvidia-smi"), value * scale, False
    if metric == "tokens_per_s":
        per_gpu = "per gpu" in u
        if not per_gpu and "total" not in u and int(row.get("gpus") or 1) > 1:
            reasons.append(f"tokens/s unit {unit!r} over {row['gpus']} GPUs: per GPU or total not said")
        return metric, value, per_gpu
    if metric == "tflops" and "model flos incl. recompute" not in u:
        reasons.append(f"TFLOPS by a FLOP count the source does not give ({unit!r})")
    if metric not in ("max_seq_len", "s_per_step", "tflops"):
        reasons.append(f"metric {metric!r}: memfit predicts none such")
    return metric, value, False


def _method(row: dict, reasons: list) -> dict:
    m = (row.get("method") or "").lower()
    if m.startswith("full"):
        return {"method": "full"}
    if m.startswith("lora"):
        return {"method": "lora", "lora_r": int(row.get("lora_r") or 8)}
    reasons.append(f"training method not published ({row.get('method')!r})")
    return {"method": "full"}


def _engine(row: dict, lv: dict, reasons: list) -> dict:
    eng = (row.get("engine") or "").lower()
    out: dict = {}
    if "megatron" in eng:
        reasons.append(f"engine {row['engine']!r}: memfit's engines are DDP, DeepSpeed ZeRO and FSDP")
    for key, what in (("tp_degree", "tensor parallelism"), ("pp_degree", "pipeline parallelism")):
        if _on(lv.get(key)):
            reasons.append(f"{what} ({key}={lv[key]}): memfit has no such lever")
    if _on(lv.get("float8_linear")) or "fp8" in (row.get("precision") or "").lower() \
            or "float8" in (row.get("precision") or "").lower():
        reasons.append(f"FP8 matmuls ({row.get('precision')!r}): memfit prices 16-bit training")
    if _on(lv.get("torch_compile")):
        reasons.append("torch.compile: memfit prices eager kernels")
    if _on(lv.get("packing")):
        reasons.append("packed sequences: memfit has no packing lever")
    if lv.get("zero_stage") is not None:
        out["zero_stage"] = int(lv["zero_stage"])
        if lv.get("optimizer_offload") == "cpu":
            out["offload"] = "optimizer+params" if lv.get("param_offload") == "cpu" else "optimizer"
    elif _on(lv.get("fsdp")) or "fsdp" in eng:
        version = 1 if "fsdp1" in str(lv.get("fsdp") or "").lower() + eng else 2
        out.update(fsdp="full_shard", fsdp_version=version)
    return out


def _sequence(row: dict, lv: dict, reasons: list) -> dict:
    out: dict = {}
    sp_text = str(lv.get("sequence_parallel") or "").lower()
    sp = int(lv.get("sp_degree") or 1)
    if sp_text and ("ring" in sp_text or "fpdt" in sp_text or "ulysses" not in sp_text):
        reasons.append(f"sequence parallelism {lv['sequence_parallel']!r}: memfit's are Ulysses (under ZeRO) "
                       "and torch's context parallelism (under FSDP2)")
    elif sp_text or sp > 1:
        if sp <= 1:
            reasons.append(f"Ulysses degree not published ({lv.get('sequence_parallel')!r})")
        out["sequence_parallel"] = max(sp, 1)
    cp_text = str(lv.get("context_parallel") or "").lower()
    cp = int(lv.get("cp_degree") or 1)
    if cp_text and "torch" not in cp_text:
        reasons.append(f"context parallelism {lv['context_parallel']!r}: memfit's is torch's (DTensor) "
                       "context_parallel")
    elif cp > 1:
        out["context_parallel"] = cp
    off = str(lv.get("activation_offload") or "").lower()
    if off:
        if "fpdt" in off:
            reasons.append(f"activation offload {lv['activation_offload']!r}: memfit offloads whole checkpointed "
                           "inputs or every saved tensor")
        elif "all saved" in off:
            out["activation_offload"] = "all"
        elif any(k in off for k in ("hidden", "ckpt", "checkpoint")):
            out["activation_offload"] = "checkpointed"
        else:
            reasons.append(f"activation offload {lv['activation_offload']!r} not recognised")
    if lv.get("tiled_mlp"):
        out["tiled_mlp"] = True
    return out


def _attention(lv: dict, reasons: list) -> str:
    text = str(lv.get("flash_attn") or "").lower()
    if text.startswith("fa2"):
        return "fa2"
    if not text or text.startswith("sdpa"):
        return "sdpa"
    reasons.append(f"attention {lv['flash_attn']!r}: memfit's are eager, sdpa and fa2")
    return "sdpa"


def _precision(row: dict, engine: dict) -> str:
    text = (row.get("precision") or "").lower()
    if "mixed" in text or "master" in text or engine.get("zero_stage") or engine.get("fsdp"):
        return "bf16-mixed"
    return "bf16" if text.startswith("bf16") else "bf16-mixed"


def convert(row: dict) -> Case:
    """The row as memfit states it, or NotStated with every reason."""
    reasons: list[str] = []
    notes: list[str] = []
    lv = row.get("levers") or {}
    try:
        model = model_for(row["model"])
    except KeyError:
        reasons.append(f"model {row['model']!r}: its config is not published")
        model = None
    unit_reasons: list[str] = []
    metric, value, per_gpu = _metric(row, unit_reasons)
    kw = _method(row, reasons)
    engine = _engine(row, lv, reasons)
    kw.update(engine)
    kw.update(_sequence(row, lv, reasons))
    gc = lv.get("activation_checkpointing")
    if gc is None:
        reasons.append("activation checkpointing not published")
    kw["gradient_checkpointing"] = bool(gc)
    kw["attention"] = _attention(lv, reasons)
    fused = str(lv.get("fused_ce") or "").lower()
    kw["loss"] = "chunked" if "flce" in fused or "fused linear" in fused else "standard"
    if fused and kw["loss"] == "standard":
        notes.append(f"fused CE {lv['fused_ce']!r} priced as the standard loss (the logits still whole)")
    if lv.get("liger_kernel") and kw["loss"] == "chunked":
        kw["liger"] = True  # Liger's RMSNorm, fused gate activation, RoPE and its fused linear cross-entropy
    elif lv.get("liger_kernel"):
        notes.append("Liger's kernels without its fused linear cross-entropy: not modelled")
    kw["precision"] = _precision(row, engine)
    if row.get("micro_batch") is None:
        reasons.append("micro-batch not published")
    kw.update(micro_batch_size=int(row.get("micro_batch") or 1), grad_accum=int(row.get("grad_accum") or 1),
              seq_len=int(row["seq_len"]))
    gpu = _gpu(row, metric, reasons, notes)
    gpus, nodes = int(row.get("gpus") or 1), row.get("nodes")
    if nodes is None and gpus > 8:
        reasons.append(f"nodes not published ({gpus} GPUs)")
        nodes = 1
    nodes = int(nodes or 1)
    if gpus % nodes:
        reasons.append(f"{gpus} GPUs over {nodes} nodes")
    reasons += unit_reasons
    if reasons:
        raise NotStated(reasons)
    hw = HardwareSpec(gpu=gpu, gpus_per_node=gpus // nodes, nodes=nodes, cpu_ram_bytes=_cpu_ram(row))
    if lv.get("expandable_segments"):  # the run set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
        kw["allocator"] = "expandable_segments"
    try:
        strategy = Strategy(**kw)
    except Exception as err:  # pydantic: a combination memfit does not model
        raise NotStated([f"strategy not expressible: {str(err).splitlines()[-1]}"]) from None
    from memfit.plan.rules import check

    refused = check(model, hw, strategy)
    if refused:
        raise NotStated([f"memfit's rules refuse the published run: {r}" for r in refused])
    overrides: dict = {}
    return Case(row["id"], row.get("source_key") or "", model, hw, strategy, metric, value, per_gpu,
                row.get("reliability") or "", overrides, notes)


def category(reason: str) -> str:
    """A reason's kind, for the grouped list."""
    for key, cat in (("model ", "model config not published"), ("training method", "method not published"),
                     ("GPU", "GPU not named / not in catalog"), ("FP8", "FP8 matmuls"),
                     ("tensor parallelism", "tensor / pipeline parallelism"),
                     ("pipeline parallelism", "tensor / pipeline parallelism"), ("engine", "Megatron engine"),
                     ("torch.compile", "torch.compile"), ("packed", "packing"),
                     ("sequence parallelism", "ring attention / FPDT (not Ulysses or torch CP)"),
                     ("context parallelism", "Megatron context parallelism"),
                     ("activation offload", "FPDT chunk offload"), ("attention", "attention kernel"),
                     ("micro-batch", "shape not published"), ("nodes", "shape not published"),
                     ("checkpointing", "checkpointing not published"), ("TFLOPS", "unpublished FLOP count"),
                     ("tokens/s unit", "unit ambiguous"), ("rules", "memfit's rules refuse"),
                     ("strategy", "not expressible")):
        if reason.startswith(key) or key in reason.split(":")[0]:
            return cat
    return reason


def load(path: Path = DEFAULT_FILE) -> tuple[list[Case], list[dict]]:
    cases, skipped = [], []
    for row in jsonl.rows(path):
        try:
            cases.append(convert(row))
        except NotStated as why:
            skipped.append({"id": row["id"], "source": row.get("source_key") or "", "metric": row["metric"],
                            "reasons": why.reasons, "category": category(why.reasons[0])})
    return cases, skipped


__all__ = ["Case", "NotStated", "convert", "load", "model_for", "category", "DEFAULT_FILE", "GROUP", "replace"]
