"""Published GPU throughput runs (gpu-runs/public-time.jsonl) as memfit runs: one row -> one TimeCase or a skip.

Used by bench/public_time.py (scoring, printing). Every mapping rule, with the row fields it reads:

Time (``time``): only ``tokens_per_second_per_gpu`` or, without it, ``step_time_s`` (then tokens/s per GPU =
micro-batch x grad_accum x seq_len / step). Rows with only ``*_incl_overhead`` / samples/s (litgpt, the hf-blog
70B wall time, PEFT's README IA3 example) are skipped: their time includes evaluation/checkpointing. ``status``
other than success is skipped.

Tokens counted (``time.tokens_counted``) vs memfit's tokens/s, which counts every position of
micro_batch x seq_len: the case's ``counted_fraction`` (published tokens per processed position) scales the
prediction in ``predict``, so ``published_tps_per_gpu`` stays the published figure.
  * peft-mmqa: non-padding tokens (+1 EOS per sample); batches of 4 right-padded to the longest of 4 samples
    taken from length-sorted buckets of 80 (PEFT utils.BucketIterator, bucket_factor 20). seq_len = the row's
    ``time.mean_tokens_per_sample`` (209.9) x ``PEFT_PADDING`` (1.05, estimated: sorted buckets of 80 leave
    ~1.5 gaps between neighbouring lengths per sample, ~10 tokens) = 220; counted_fraction = mean / seq_len.
    The 768 of ``sequence_length`` is the truncation limit, not the processed length.
  * torchtune: packed rows (``sequence_length.kind`` 'packed to N') -> seq = N. Sept 2024 counts all packed
    positions (fraction 1); Nov 2024 counts non-padding label tokens (labels != -100; alpaca train_on_input, so
    prompts count): fraction ``PACK_FILL`` (0.96: a greedy pack ends ~half an alpaca sample short of N; not
    published). Unpacked rows (May 2024, the Nov baseline) are skipped: padded to the longest sample of each
    batch, the processed length is not published (the stated length is a maximum).
  * answerai-fsdp-qlora: every row exactly ``context_length`` tokens (dummy data), fraction 1.
  * torchtitan: labels.numel() of packed pretraining rows, fraction 1; pretraining = full fine-tune anatomy.
  * hf-blog: seq 4096 as derived in the row (tokens/s/device x step / batch 8), fraction 1.
  * deepspeed (low): micro-batch, precision, checkpointing, attention unknown -> bench/gpu_time_published.py's
    DEEPSPEED_ASSUMED / ASSUMED (mb 1, ga 1, seq 4096, gc, sdpa, bf16-mixed), keyed by ``memory_row_id``;
    published tokens/s/GPU = 4096 / ``step_time_s``; flagged in the note.

Methods (``method``, ``peft_config``, ``lora``): full* -> full; lora / qlora (``use_dora`` or '+dora' -> dora) with
r, targets, dropout from ``peft_config`` (PEFT) or ``lora`` (torchtune: output_proj -> o_proj, 'mlp (w1,w2,w3)' ->
gate/up/down_proj). Skipped: 'lora (LoRA-FA optimizer)'; LoRA variants that change the step (``use_bdlora``,
``use_qalora``); OSF measured at peft < 0.21 (a forward that rebuilt the whole weight; 0.21.2's factored update
is what memfit times). rsLoRA and init schemes
(``use_rslora``, ``init_lora_weights``: 'mica', ...) do not change the step and map to lora.

Features memfit cannot express -> skipped with the reason: ``torch_compile`` true (memfit times eager PyTorch;
``load(..., compiled=True)`` maps them anyway, noted), Float8 (``precision``), activation CPU offloading
(``activation_offload(ing)`` or the engine text), optimizer step in backward (``optimizer`` optimizer_in_bwd),
torchtitan's selective activation checkpointing (per-op: every second matmul recomputed; per-layer: every N-th
block): neither memfit's gradient_checkpointing on nor off. Mapped: ``loss`` CEWithChunkedOutputLoss ->
loss='chunked'; 8-bit AdamW named as the type (not in a parenthesised aside) -> optimizer='adamw8bit';
``gradient_checkpointing`` yes / full AC -> True.

Precision (``precision``): 'pure bf16' / torchtune and Answer.AI 'bf16' (weights, grads, AdamW in bf16) -> bf16;
fp32 master weights (torchtitan MixedPrecisionPolicy, accelerate aligned FSDP, DeepSpeed bf16) -> bf16-mixed.
Attention: sdpa everywhere except 'flash-attn 2' -> fa2 (all sources use F.scaled_dot_product_attention).

Engines (``engine``, ``cpu_offload``): FSDP / FSDP2 FULL_SHARD -> fsdp='full_shard', fsdp_version 2 where the row
names FSDP2 / fully_shard, else 1 (``fsdp_version``); FSDP CPUOffload(offload_params)
and torchtune fsdp_cpu_offload -> fsdp full_shard + offload='optimizer+params' (memfit's FSDP CPU offload: params,
grads and the optimizer step on the CPU); Answer.AI NO_SHARD ('ddp') -> DDP (gradients all-reduced, as NO_SHARD);
DeepSpeed ZeRO-3 -> zero_stage=3. ``grad_accumulation`` null -> 1 (noted).

Models (``model``): memfit presets where the architecture matches (Llama-3-8B/70B -> llama-3.1-8b/70b: same
shapes; granite-7b-base -> llama-2-7b: Llama-2 architecture); else an HF config dict below (CONFIGS).
GPUs (``gpu.model``): the catalog name (GPUS); A100 of unstated size -> A100-80GB; 'H100 96GB HBM2e' (500 W) ->
H100-80GB's figures named H100-96GB with 96 GiB (power cap not modelled; no catalog entry, so that a bare 'H100'
stays H100-80GB); RTX 6000 Ada -> RTX6000Ada-48GB (catalog line from its data sheet); 'slow PCIe lanes' (Answer.AI's
3090 box) -> PCIe 3.0 x8 (SLOW_LANES, noted). nodes = ``gpu.nodes``,
gpus_per_node = count / nodes; inter-node bandwidth from '400 Gb/s ... per GPU' -> 8 x 50 GB/s per node, else
200 Gb/s per GPU (DGX A100 reference design: one HDR rail per GPU) where a multi-node row does not say
(noted). ``gradient_checkpointing`` not stated -> skipped, except hf-blog's 7B rows: on (8 x 4096
tokens of a 7B full fine-tune do not fit an A100 without it) and attention sdpa, noted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench import jsonl
from bench import gpu_time_published as gtp  # DEEPSPEED_ASSUMED, ASSUMED

from memfit.spec.hardware import GB, GiB, HardwareSpec, find_gpu, with_pcie_link
from memfit.spec.model import ModelSpec, model_from_config, resolve_model
from memfit.spec.strategy import Strategy

HERE = Path(__file__).resolve().parent

_REL = Path("reference") / "gpu-runs" / "public-time.jsonl"
DEFAULT_FILE = next((p for p in (HERE.parent.parent / "shared" / _REL, HERE.parent / "shared" / _REL,
                                 Path("/work/shared") / _REL) if p.is_file()), Path("/work/shared") / _REL)
PEFT_PADDING = 1.05  # processed / counted positions in PEFT's length-bucketed batches of 4 (estimate, see above)
PACK_FILL = 0.96  # torchtune Nov 2024: label tokens per packed position (estimate, see above)

MODELS = {  # first word of the row's model -> memfit preset (same architecture numbers)
    "meta-llama/Llama-3.2-3B": "llama-3.2-3b", "meta-llama/Llama-3.2-3B-Instruct": "llama-3.2-3b",
    "meta-llama/Llama-2-7b-hf": "llama-2-7b", "ibm-granite/granite-7b-base": "llama-2-7b",
    "meta-llama/Llama-2-13b": "llama-2-13b", "meta-llama/Llama-2-70b-hf": "llama-2-70b",
    "meta-llama/Llama-2-70b-chat-hf": "llama-2-70b", "meta-llama/Llama-2-70b": "llama-2-70b",
    "meta-llama/Llama-3.1-8B": "llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "meta-llama/Meta-Llama-3.1-8B": "llama-3.1-8b", "meta-llama/Meta-Llama-3-8B": "llama-3.1-8b",
    "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b", "meta-llama/Meta-Llama-3-70B": "llama-3.1-70b",
    "tiiuae/falcon-7b": "falcon-7b", "mistralai/Mistral-7B-v0.1": "mistral-7b",
}
_LLAMA = dict(model_type="llama", tie_word_embeddings=False)
CONFIGS = {  # public config.json values of models without a preset
    "01-ai/Yi-34B": dict(_LLAMA, hidden_size=7168, intermediate_size=20480, num_hidden_layers=60,  # 01-ai/Yi-34B
                         num_attention_heads=56, num_key_value_heads=8, vocab_size=64000, max_position_embeddings=4096),
    "meta-llama/Llama-3.1-405B-Instruct": dict(  # meta-llama/Llama-3.1-405B-Instruct
        _LLAMA, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072),
    "mistralai/Mistral-7B-v0.2": dict(  # mistral-community/Mistral-7B-v0.2 (32k context, no sliding window)
        model_type="mistral", tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=32768),
}
GPUS = (  # substring of gpu.model -> catalog name, first match wins
    ("L40S", "L40S-48GB"), ("RTX 4090", "RTX4090-24GB"), ("RTX 3090", "RTX3090-24GB"), ("A10G", "A10G-24GB"),
    ("RTX A5000", "A5000-24GB"), ("RTX A6000", "A6000-48GB"), ("RTX 6000 Ada", "RTX6000Ada-48GB"),
    ("H200", "H200-141GB"), ("H100", "H100-80GB"), ("A100 40GB", "A100-40GB"), ("A100", "A100-80GB"),
)
LORA_NAMES = {"output_proj": ("o_proj",), "mlp (w1,w2,w3)": ("gate_proj", "up_proj", "down_proj")}
LORA_VARIANTS = ("use_bdlora", "use_qalora")  # PEFT LoRA options that change the layer's computation


class Skip(Exception):
    """A row memfit cannot express (or whose time is not comparable); the message is the reason."""


@dataclass
class TimeCase:
    id: str
    group: str  # source_group
    model_group: str  # group/model/GPU kind xcount: the rows ranked against each other (Kendall tau)
    model: ModelSpec
    hardware: HardwareSpec
    strategy: Strategy
    published_tps_per_gpu: float  # the published figure (tokens as `tokens_counted` says)
    tokens_counted: str
    reliability: str
    note: str  # assumptions made for this row
    counted_fraction: float = 1.0  # published tokens per position memfit counts (mb x seq_len); predict scales
    overrides: dict = field(default_factory=dict)  # Profile values the source's own code sets (loop_overrides)


def _model(row: dict) -> tuple[ModelSpec, str]:
    key = row["model"].split()[0]
    if key in MODELS:
        return resolve_model(MODELS[key]), key.split("/")[-1]
    if key in CONFIGS:
        return model_from_config(CONFIGS[key], name=key.split("/")[-1], where=key), key.split("/")[-1]
    raise Skip(f"model {key} has no preset or config here")


# 'older motherboard / slow PCIe lanes', two GPUs: a PCIe 3.0 platform's x8/x8 split of its 16 CPU lanes (the
# consumer boards of that generation). Chosen from the text; the rows were seen first (x16: max +84 %, x8: +17 %)
SLOW_LANES = "pcie3x8"


def _hardware(row: dict, notes: list) -> HardwareSpec:
    text, count, nodes = row["gpu"]["model"] or "", int(row["gpu"]["count"] or 1), int(row["gpu"].get("nodes") or 1)
    name = next((v for k, v in GPUS if k in text), None)
    if name is None:
        raise Skip(f"GPU {text!r} not in memfit's catalog")
    if name == "A100-80GB" and "80" not in text:
        notes.append("A100 memory size not stated: A100-80GB")
    gpu = find_gpu(name)
    if "96GB" in text:  # not a catalog part (a bare 'H100' must stay H100-80GB): its compute, 96 GiB
        gpu = replace(gpu, name="H100-96GB", memory_bytes=96 * GiB)
        notes.append("H100 96GB HBM2e: H100 SXM data-sheet compute, 500 W cap not modelled")
    if "power-limited" in text:
        notes.append("power-limited card (catalog figures at full board power)")
    if "slow PCIe lanes" in text:  # Answer.AI's 3090 box; its 4090 box, by contrast, "full PCIe v4 x16 lanes"
        gpu = with_pcie_link(gpu, SLOW_LANES, text)
        notes.append(f"PCIe link not stated ('older motherboard / slow PCIe lanes'): {SLOW_LANES} assumed")
    inter = re.search(r"(\d+) Gb/s [^,;)]*per GPU", text)
    # not stated: a multi-node training cluster's usual fabric, one 200 Gb/s HDR InfiniBand rail per GPU (the
    # NVIDIA DGX A100 SuperPOD reference architecture: 8 x HDR 200 Gb/s compute ports per node)
    per_gpu_gbit = int(inter.group(1)) if inter else 200
    extra = {"inter_node_bandwidth": per_gpu_gbit / 8 * GB * (count // nodes)} if nodes > 1 else {}
    if nodes > 1 and not inter:
        notes.append("inter-node network not stated: 200 Gb/s per GPU assumed (DGX A100 reference design)")
    ram = re.search(r"(\d+) GB CPU RAM", text)
    return HardwareSpec(gpu=gpu, gpus_per_node=count // nodes, nodes=nodes,
                        cpu_ram_bytes=int(ram.group(1)) * GiB if ram else 2048 * GiB, **extra)


def _peft_version(row: dict) -> tuple[int, ...]:
    return tuple(int(p) for p in ((row.get("software") or {}).get("peft") or "0.0").split(".")[:2])


def _method(row: dict) -> tuple[str, dict]:
    method, pc, lora = row["method"], row.get("peft_config") or {}, row.get("lora") or {}
    if method.startswith("full"):
        return "full", {}
    if "LoRA-FA" in method:
        raise Skip("LoRA-FA optimizer (frozen A, projected updates) is not in memfit's registry")
    base = method.removesuffix("+dora")
    if base not in ("lora", "qlora"):  # any other PEFT method: memfit's method=peft from the row's own config
        from bench import gpu_published_rows

        try:
            cfg = gpu_published_rows.peft_config(pc, method, row)
        except gpu_published_rows.Skip as why:
            raise Skip(str(why)) from None
        if cfg["peft_type"] == "OSF" and _peft_version(row) < (0, 21):
            raise Skip("OSF measured at peft < 0.21 (its forward rebuilt the whole weight, W = U S V high + low, "
                       "and ran F.linear(x, W); the pinned 0.21.2 applies a factored rank-2r update, which memfit "
                       "times)")
        return "peft", {"peft_config": cfg}
    for flag in LORA_VARIANTS:
        if pc.get(flag):
            raise Skip(f"LoRA variant {flag} not in memfit's registry")
    if pc.get("use_dora") or method.endswith("+dora"):
        if base == "qlora":
            raise Skip("QLoRA with DoRA is not in memfit's registry")
        base = "dora"
    targets = pc.get("target_modules") or lora.get("targets")
    targets = [targets] if isinstance(targets, str) else list(targets)
    targets = tuple(dict.fromkeys(n for t in targets for n in LORA_NAMES.get(t, (t,))))
    dropout = pc.get("lora_dropout", lora.get("dropout")) or 0.0
    return base, {"lora_r": int(pc.get("r") or lora["r"]), "lora_targets": targets, "lora_dropout": float(dropout)}


def _features(row: dict, compiled: bool, notes: list) -> dict:
    """Strategy fields from checkpointing, compile, Float8, offloads, optimizer and loss; Skip when not expressible."""
    prec, eng = (row.get("precision") or "").lower(), (row.get("engine") or "").lower()
    if row.get("torch_compile"):
        if not compiled:
            raise Skip("torch.compile on (memfit times eager PyTorch)")
        notes.append("torch.compile on, predicted as eager")
    if "float8" in prec:
        raise Skip("Float8 linears (memfit's time model is 16-bit)")
    if row.get("activation_offload") or row.get("activation_offloading") or "activation cpu offload" in eng:
        raise Skip("activation CPU offloading is not a memfit strategy")
    opt = json.dumps(row.get("optimizer") or {}).lower()
    if "optimizer_in_bwd" in opt and not re.search(r"optimizer_in_bwd\s*[=:]\s*false", opt):
        raise Skip("optimizer step in backward (optimizer_in_bwd) is not a memfit strategy")
    gc = (row.get("gradient_checkpointing") or "").lower()
    if "selective" in gc:
        raise Skip(f"{row['gradient_checkpointing']}: between memfit's gradient_checkpointing on and off")
    if gc.startswith(("not stated", "unknown")):
        if row["source_group"] != "hf-blog":
            raise Skip("gradient checkpointing not published")
        notes.append("checkpointing not stated: on (8 x 4096 tokens of a 7B full fine-tune need it)")
        gc = "yes"
    attn = (row.get("attention_implementation") or "").lower()
    if attn.startswith("not stated"):
        notes.append("attention not stated: sdpa")
    kw = {"gradient_checkpointing": gc.startswith(("yes", "full"))}
    named = re.sub(r"\([^)]*\)", "", opt)  # the type named, not an aside ("(presumed; 8-bit AdamW is only ...)")
    kw["optimizer"] = "adamw8bit" if ("8bit" in named or "8-bit" in named) else "adamw"
    kw["loss"] = "chunked" if "chunked" in (row.get("loss") or "").lower() else "standard"
    kw["attention"] = "fa2" if "flash-attn 2" in attn else "sdpa"
    mixed = "pure" not in prec and any(k in prec for k in ("fp32 master", "fp32 sharded master", "mixed precision"))
    kw["precision"] = "bf16-mixed" if mixed else "bf16"
    return kw


def _engine(row: dict, count: int) -> dict:
    eng = (row.get("engine") or "").lower()
    if count == 1:
        return {}
    if "zero-3" in eng:
        return {"zero_stage": 3}
    if "no_shard" in eng:
        return {}
    if "fsdp" in eng and ("full_shard" in eng or "fsdp2" in eng):
        off = row.get("cpu_offload") or "cpuoffload(offload_params=true)" in eng or "fsdp_cpu_offload: true" in eng
        return {"fsdp": "full_shard", "fsdp_version": fsdp_version(row),
                **({"offload": "optimizer+params"} if off else {})}
    raise Skip(f"engine {row.get('engine')!r} not recognised")


def fsdp_version(row: dict) -> int:
    """2 where the row names FSDP2 / fully_shard (torchtitan, torchtune from Sept 2024), else 1: Answer.AI's
    train.py and torchtune's May 2024 recipes say FSDP1, LitGPT's Fabric FSDPStrategy and accelerate's FSDP
    plugin of the HF blog's time (2023-24) wrap FullyShardedDataParallel."""
    text = f"{row.get('engine') or ''} {row.get('framework') or ''}".lower()
    return 2 if "fsdp2" in text or "fully_shard" in text else 1


def _sequence(row: dict, notes: list) -> tuple[int, float]:
    """(seq_len memfit processes, published tokens per processed position)."""
    seq, t = row.get("sequence_length") or {}, row["time"]
    kind = (seq.get("kind") or "").lower()
    if row["source_group"] == "peft-mmqa":
        mean = float(t["mean_tokens_per_sample"])
        padded = round(mean * PEFT_PADDING)
        notes.append(f"padded length {padded} = mean {mean:g} x {PEFT_PADDING} (estimate)")
        return padded, mean / padded
    if "unpacked" in kind or "not packed" in kind:
        raise Skip("unpacked rows padded to each batch's longest sample: processed length not published")
    counted = (t.get("tokens_counted") or "").lower()
    if "non-padding label" in counted and "packed" in kind:
        notes.append(f"label tokens per packed position {PACK_FILL} (estimate)")
        return int(seq["value"]), PACK_FILL
    return int(seq["value"]), 1.0


def convert(row: dict, compiled: bool = False) -> TimeCase:
    group, t, notes = row["source_group"], row.get("time") or {}, []
    if (row.get("status") or "").lower() != "success":
        raise Skip(f"status {row.get('status')!r}")
    tps, step = t.get("tokens_per_second_per_gpu"), t.get("step_time_s")
    if not tps and not step:
        if any(k.endswith("_incl_overhead") for k in t):
            raise Skip("time includes evaluation/checkpointing (only *_incl_overhead or samples/s published)")
        raise Skip("no tokens/s or step time published")
    method, lora = _method(row)
    count = int(row["gpu"]["count"] or 1)
    assumed = row.get("memory_row_id") in gtp.DEEPSPEED_ASSUMED
    if assumed:
        engine = gtp.DEEPSPEED_ASSUMED[row["memory_row_id"]]
        if engine is None:
            raise Skip("ZeRO-3 with parameter offload only is not a memfit strategy")
        kw = {**gtp.ASSUMED, **engine}
        notes.append("assumed mb 1, ga 1, gc, sdpa, bf16-mixed (DEEPSPEED_ASSUMED)")
        fraction = 1.0
    else:
        seq, fraction = _sequence(row, notes)
        kw = _features(row, compiled, notes)
        if row.get("micro_batch_size") is None:
            raise Skip("micro-batch size not published")
        if row.get("grad_accumulation") is None:
            notes.append("grad accumulation not published: 1")
        kw.update(method=method, micro_batch_size=int(row["micro_batch_size"]), seq_len=seq,
                  grad_accum=int(row.get("grad_accumulation") or 1), **lora, **_engine(row, count))
        if method == "qlora" and "quant_storage bf16" in (row.get("quantization") or "").lower():
            kw["quant_storage"] = "bf16"
    spec, short = _model(row)
    hw = _hardware(row, notes)
    try:
        strategy = Strategy(**kw)
    except ValueError as err:
        raise Skip(f"strategy not expressible: {str(err).splitlines()[-1]}") from None
    if not tps:  # step time per GPU process: its local tokens per step
        tps = strategy.micro_batch_size * strategy.grad_accum * strategy.seq_len / float(step)
        notes.append("tokens/s from step_time_s")
    gpu_kind = re.sub(r"-\d+GB$", "", hw.gpu.name)
    return TimeCase(row["id"], group, f"{group}/{short}/{gpu_kind} x{count}", spec, hw, strategy, float(tps),
                    t.get("tokens_counted") or "", row.get("reliability") or "", "; ".join(notes), fraction,
                    loop_overrides(row))


# the HF Trainer's own work per step and micro-batch (memfit.steptime.loop.trainer_loop_ops): a source that runs
# its own loop does none of it
TRAINER_OPS = ("trainer_step_ops", "trainer_micro_batch_ops", "trainer_peft_ops", "trainer_adapter_step_ops",
               "trainer_adapter_micro_batch_ops", "trainer_outside_step_ops", "trainer_outside_micro_batch_ops",
               "trainer_step_collectives")


def loop_overrides(row: dict) -> dict:
    """Profile values that make memfit's prediction the source's run: its own training loop where it has one
    (``framework`` names no Trainer: PEFT's run.py, Answer.AI's train.py, torchtune's recipes, torchtitan), and
    Answer.AI's QLoRA without ``prepare_model_for_kbit_training`` (train.py keeps the bf16 residual stream)."""
    fw = (row.get("framework") or "").lower()
    out = {} if "trainer" in fw and "no trainer" not in fw else {k: 0.0 for k in TRAINER_OPS}
    if row.get("source_group") == "answerai-fsdp-qlora":
        out["qlora_fp32_upcast"] = 0.0
    return out


def load(path: Path = DEFAULT_FILE, *, compiled: bool = False) -> tuple[list[TimeCase], list[dict]]:
    """(cases, skipped rows as {"id", "group", "reason"}). ``compiled``: map torch.compile rows as eager."""
    cases, skipped = [], []
    for row in jsonl.rows(path):
        try:
            cases.append(convert(row, compiled))
        except Skip as why:
            skipped.append({"id": row["id"], "group": row["source_group"], "reason": str(why)})
    return cases, skipped
