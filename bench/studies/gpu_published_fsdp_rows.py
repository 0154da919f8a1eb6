"""The multi-GPU FSDP runs of gpu-runs/public-time.jsonl that publish a peak memory figure, as memfit runs.

One row -> one FsdpCase (model, hardware, strategy, the metric it published, the bytes, the engine version and
where that was read) or a Skip naming why memfit cannot express it. bench/studies/gpu_published_fsdp.py predicts and
scores them. Hardware, LoRA targets and models come from bench/public_time_rows.py (the time bench's mapping of
the same file); what differs for memory is here, each rule with the engine source it was read from:

* FSDP version (``ENGINES``, by source group and commit): torchtune @ 0217d44c2 (May 2024) wraps with
  ``FullyShardedDataParallel`` (recipes/lora_finetune_distributed.py:332, full_finetune_distributed.py:293:
  auto_wrap by TransformerDecoderLayer, FULL_SHARD, ``mixed_precision=None``, ``sync_module_states``) = FSDP1;
  torchtune @ 30b8519e8 (Sept 2024) calls ``training.shard_model`` -> ``fully_shard`` on every ``layers.i`` and
  the root (torchtune/training/_distributed.py:591-623) = FSDP2; LitGPT @ 5895df1 uses Lightning Fabric's
  ``FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block}, limit_all_gathers=True)``
  (litgpt/finetune/full.py:90-96), i.e. ``FullyShardedDataParallel`` = FSDP1; torchtitan is ``fully_shard`` (FSDP2).
* Metric (``METRICS``): LitGPT prints ``torch.cuda.max_memory_allocated() / 1e9`` after ``fit()``
  (full.py:154) -> allocated, GB. torchtune's ``get_memory_stats`` logs active, allocated and reserved peaks
  (torchtune/utils/memory.py:198-200 @ 0217d44c2 in GB = 1e9; torchtune/training/memory.py:210-214 @ 30b8519e8
  in GiB = 1024**3, so the 405B row's printed "GB" is GiB); the README does not say which column it quotes:
  **assumed reserved**, the basis its first memory table stated ("based on GPU peak memory reserved", README @
  e802c057d, PR #357). torchtitan's memory monitor logs max reserved.
* Sequence: torchtune May 2024 trained unpacked alpaca, and ``alpaca_dataset`` truncates at ``max_seq_len=512``
  (torchtune/datasets/_alpaca.py:18 @ 0217d44c2): the README's "Seq Length 2048/4096" cannot be the processed
  length (memfit: 47 GB for the 2 x RTX 4090 LoRA row at 2048, on 24 GB cards), so these rows are predicted at
  512, the longest batch an epoch can hold (low reliability, flagged). LitGPT pads to the longest sample,
  truncated at 512: predicted at 512. Packed rows (torchtune Sept 2024, torchtitan) at their packed length.
* LitGPT's models are its own GPT class (litgpt/config.py @ 5895df1): ``lm_head`` is always a separate Linear
  (litgpt/model.py:25), so Gemma-2B's head is not tied; phi-2 runs as a GPT-NeoX block (GptNeoxMLP, parallel
  residual, one shared norm) and is read with memfit's gpt_neox reader; vocabularies are LitGPT's padded ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from bench import public_time_rows as ptr

from memfit.spec.hardware import GiB, HardwareSpec
from memfit.spec.model import ModelSpec, model_from_config
from memfit.spec.strategy import Strategy

DEFAULT_FILE = ptr.DEFAULT_FILE  # ../shared/reference/gpu-runs/public-time.jsonl

ENGINES = {  # (source group, source commit[:9]) -> (FSDP version, where it was read)
    ("torchtune", "0217d44c2"): (1, "torchtune@0217d44c2 recipes/*_finetune_distributed.py: FullyShardedDataParallel"),
    ("torchtune", "30b8519e8"): (2, "torchtune@30b8519e8 training/_distributed.py shard_model: fully_shard"),
    ("litgpt", "5895df100"): (1, "litgpt@5895df1 finetune/full.py: Fabric FSDPStrategy = FullyShardedDataParallel"),
    ("torchtitan", "d4c86e375"): (2, "torchtitan@9dec370 parallelize_llama: fully_shard"),
    ("torchtitan", "b5bcd76c6"): (2, "torchtitan parallelize_llama: fully_shard"),
}
METRICS = {  # source group -> (memfit metric, why)
    "torchtune": ("reserved", "not stated; assumed reserved (get_memory_stats logs active/alloc/reserved; "
                              "README's first table, PR #357: 'GPU peak memory reserved')"),
    "litgpt": ("allocated", "max_memory_allocated()/1e9 (finetune/full.py:154)"),
    "torchtitan": ("reserved", "memory monitor: max reserved"),
}
LORA_DROPOUT = {  # the LoRA builders' default where the config sets none
    "torchtune/0217d44c2": 0.05,  # torchtune/models/llama2/_model_builders.py:56 (lora_dropout: float = 0.05)
    "torchtune/30b8519e8": 0.0,  # torchtune/models/llama3_1/_model_builders.py:90 (lora_dropout: float = 0.0)
}
UNITS = {"torchtune/0217d44c2": 1e9, "torchtune/30b8519e8": GiB, "litgpt/5895df100": 1e9}  # the code's divisor

_GPT_NEOX = dict(model_type="gpt_neox", tie_word_embeddings=False, use_parallel_residual=True)
CONFIGS = {  # LitGPT's configs (litgpt/config.py @ 5895df1) in the Hugging Face keys memfit reads
    "google/gemma-2b": dict(model_type="gemma", hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                            num_attention_heads=8, num_key_value_heads=1, head_dim=256, vocab_size=256000,
                            tie_word_embeddings=False, max_position_embeddings=8192),
    "microsoft/phi-2": dict(_GPT_NEOX, hidden_size=2560, intermediate_size=10240, num_hidden_layers=32,
                            num_attention_heads=32, vocab_size=51200, max_position_embeddings=2048),
    "stabilityai/stablelm-base-alpha-3b": dict(_GPT_NEOX, hidden_size=4096, intermediate_size=16384,
                                               num_hidden_layers=16, num_attention_heads=32, vocab_size=50688,
                                               max_position_embeddings=4096),
}
TORCHAO_NF4 = ("torchtune's QLoRA is torchao's NF4Tensor: FSDP2 shards its scales with the data "
               "(torchao/dtypes/nf4tensor.py _INNER_TENSOR_NAMES_FOR_SHARDING); memfit's qlora is bitsandbytes' "
               "Params4bit, whose quant state is replicated on every rank")


class Skip(Exception):
    """A row memfit cannot express; the message is the reason."""


@dataclass
class FsdpCase:
    id: str
    group: str
    source: str  # the row's address (url, or repo/path@commit)
    engine: str  # 'FSDP1' / 'FSDP2' + where that was read
    model: ModelSpec
    hardware: HardwareSpec
    strategy: Strategy
    metric: str  # allocated | reserved
    metric_note: str
    measured: float  # bytes
    reliability: str
    kind: str = "point"  # point | bracket (selective AC: gc on and off bound the run)
    notes: list[str] = field(default_factory=list)  # uncertain fields and assumptions


def _source(row: dict) -> str:
    s = row.get("source") or {}
    return s.get("url") or f"{s.get('repo')}/{s.get('path')}@{s.get('commit')}"


def _engine(row: dict) -> tuple[int, str]:
    group, eng = row["source_group"], (row.get("engine") or "").lower()
    if "fsdp" not in eng:
        raise Skip(f"not FSDP ({row.get('engine')}); the same runs are public.jsonl's rows (bench/gpu_published.py)")
    key = (group, ((row.get("source") or {}).get("commit") or "")[:9])
    if key not in ENGINES:
        raise Skip("FSDP settings not published (micro-batch, precision, checkpointing, wrap policy unknown)")
    return ENGINES[key]


def _model(row: dict) -> ModelSpec:
    key = row["model"].split()[0]
    if key in CONFIGS:
        return model_from_config(CONFIGS[key], name=key.split("/")[-1], where=f"LitGPT config {key}")
    try:
        return ptr._model(row)[0]
    except ptr.Skip as why:
        raise Skip(str(why)) from None


def _features(row: dict, notes: list) -> dict:
    """Checkpointing, precision, loss, offload, compile: the strategy fields or a Skip."""
    prec = (row.get("precision") or "").lower()
    if "float8" in prec or "float8" in row["id"]:
        raise Skip("Float8 linears (memfit's memory model is 16-bit)")
    opt = json.dumps(row.get("optimizer") or {}).lower()
    if "paged" in opt:
        raise Skip("bitsandbytes PagedAdamW: states in CUDA unified memory, outside torch's allocator; "
                   "no config published (checkpointing unknown)")
    if "optimizer_in_bwd" in opt:
        raise Skip("optimizer step in backward is not a memfit strategy")
    gc = (row.get("gradient_checkpointing") or "").lower()
    if row.get("torch_compile"):
        if row["source_group"] == "torchtitan":
            raise Skip("torch.compile (memfit models eager PyTorch; compile changes what is saved: 82.4 -> 77.0 GiB "
                       "on the same torchtitan run)")
        notes.append("torch.compile on (per-layer + loss), predicted as eager")
    if gc.startswith("unknown"):
        raise Skip("gradient checkpointing not published")
    kw = {"gradient_checkpointing": gc.startswith(("yes", "full")), "attention": "sdpa", "optimizer": "adamw"}
    mixed = "mixedprecisionpolicy" in prec or "fp32 sharded master" in prec
    kw["precision"] = "bf16-mixed" if mixed else "bf16"  # torchtune dtype bf16, LitGPT bf16-true: pure bf16
    cfgs = " ".join((row.get("source") or {}).get("config_files") or [])
    if row["source_group"] == "torchtune" and ("70B_full" in cfgs or "70B_lora" in cfgs) and "llama3_1" in cfgs:
        kw["loss"] = "chunked"  # the config's CEWithChunkedOutputLoss (recipes/configs/llama3_1/70B_*.yaml)
        notes.append("CEWithChunkedOutputLoss -> loss=chunked (torchtune keeps 8 bf16 logit chunks; memfit none)")
    eng = (row.get("engine") or "").lower()
    if row.get("cpu_offload") or "fsdp_cpu_offload: true" in eng:
        kw["offload"] = "optimizer+params"
    return kw


def _sequence(row: dict, notes: list) -> int:
    seq = row.get("sequence_length") or {}
    kind = (seq.get("kind") or "").lower()
    if "packed" in kind and "not packed" not in kind:
        return int(seq["value"])
    if row["source_group"] in ("torchtune", "litgpt"):  # truncated at 512, padded to each batch's longest
        if int(seq["value"]) != 512:
            notes.append(f"stated length {seq['value']} not processed: alpaca truncated at 512 -> 512")
        else:
            notes.append("longest batch assumed at the 512 truncation")
        return 512
    return int(seq["value"])


def _published(row: dict, notes: list) -> tuple[str, str, float]:
    group = row["source_group"]
    metric, why = METRICS[group]
    pm = row["peak_memory"]
    commit = ((row.get("source") or {}).get("commit") or "")[:9]
    unit = UNITS.get(f"{group}/{commit}")
    if unit is None:
        unit = GiB if "gib" in (pm.get("unit") or "").lower() else 1e9
    elif unit == GiB and "gib" not in (pm.get("unit") or "").lower():
        notes.append(f"printed '{pm.get('unit')}', the code divides by 1024**3: GiB")
    return metric, why, float(pm["value"]) * unit


def convert(row: dict) -> FsdpCase:
    notes: list[str] = []
    version, where = _engine(row)
    if row["method"] == "qlora" and "torchao" in (row.get("quantization") or "").lower():
        raise Skip(TORCHAO_NF4)
    method, lora = ptr._method(row)
    commit = ((row.get("source") or {}).get("commit") or "")[:9]
    if method != "full" and (row.get("lora") or {}).get("dropout") is None:  # the model builder's default
        lora["lora_dropout"] = LORA_DROPOUT.get(f"{row['source_group']}/{commit}", lora["lora_dropout"])
    kw = _features(row, notes)
    gc = (row.get("gradient_checkpointing") or "").lower()
    kind = "bracket" if "selective" in gc else "point"
    if kind == "bracket":
        notes.append("selective per-op AC: between gradient checkpointing on (lower) and off (upper)")
    hw_notes: list[str] = []
    hardware = ptr._hardware(row, hw_notes)
    notes += hw_notes
    metric, why, measured = _published(row, notes)
    # accumulation: Fabric's no_backward_sync is FSDP1's no_sync (gradients held whole until the last
    # micro-batch); torchtune's and torchtitan's recipes reduce every micro-batch
    no_sync = row["source_group"] == "litgpt"
    strategy = Strategy(method=method, fsdp="full_shard", fsdp_version=version, seq_len=_sequence(row, notes),
                        micro_batch_size=int(row["micro_batch_size"]), fsdp_sync_each_batch=not no_sync,
                        grad_accum=int(row.get("grad_accumulation") or 1), **lora, **kw)
    return FsdpCase(row["id"], row["source_group"], _source(row), f"FSDP{version} ({where})", _model(row), hardware,
                    strategy, metric, why, measured, row.get("reliability") or "", kind, notes)


def load(path: Path = DEFAULT_FILE) -> tuple[list[FsdpCase], list[dict]]:
    """(cases, skipped rows as {"id", "group", "source", "why"}) for every multi-GPU row with a peak memory."""
    cases, skipped = [], []
    for line in Path(path).read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if not row.get("peak_memory") or int((row.get("gpu") or {}).get("count") or 1) <= 1:
            continue
        try:
            cases.append(convert(row))
        except (Skip, ptr.Skip) as why:
            skipped.append({"id": row["id"], "group": row["source_group"], "source": _source(row), "why": str(why)})
    return cases, skipped
