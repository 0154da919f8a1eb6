"""How new sources' rows (bench/holdout/*.jsonl) become memfit runs, beyond the frozen converters
(bench/gpu_published_rows.convert, bench/public_time_rows.convert). Every rule here was written from the rows'
configuration fields and the sources' code, before any of their figures was read (bench/holdout/ledger.json
names the commit); none may change after a source is scored without the ledger saying so.

* Qwen-1 (QwenLM/Qwen, remote-code ``QWenLMHeadModel``): a Llama-shaped decoder (RMSNorm, rotary, SwiGLU, untied
  head) with a fused, biased QKV. Written as Llama configs of the public config.json shapes (its
  ``intermediate_size`` is twice one SwiGLU branch: w1 and w2 are each half of it); ``-Chat`` shares its base's
  shapes. ``-Int4`` checkpoints (GPTQ) are not a memfit method: the converter skips them.
* Qwen-1's LoRA targets (finetune.py: c_attn, c_proj, w1, w2) in Llama's names: c_attn -> q/k/v_proj (one fused
  linear there), c_proj -> o_proj and down_proj (attention's and the MLP's output share the name), w1/w2 ->
  up/gate_proj. On a base (not -Chat) model, Qwen's finetune.py trains the embeddings and the head in full
  (``modules_to_save=["wte", "lm_head"]``) -> lora_modules_to_save embed_tokens, lm_head.
* Sequence parallelism (XTuner's ``sequence_parallel`` > 1) is not a memfit lever: such rows are skipped.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

_LLAMA = dict(model_type="llama", tie_word_embeddings=False, attention_bias=True, max_position_embeddings=32768)
QWEN1 = {  # https://huggingface.co/Qwen/Qwen-<size>/blob/main/config.json (intermediate_size halved: one branch)
    "Qwen-1_8B": dict(_LLAMA, hidden_size=2048, intermediate_size=5504, num_hidden_layers=24,
                      num_attention_heads=16, num_key_value_heads=16, vocab_size=151936),
    "Qwen-7B": dict(_LLAMA, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=32, vocab_size=151936),
    "Qwen-14B": dict(_LLAMA, hidden_size=5120, intermediate_size=13696, num_hidden_layers=40,
                     num_attention_heads=40, num_key_value_heads=40, vocab_size=152064),
    "Qwen-72B": dict(_LLAMA, hidden_size=8192, intermediate_size=24576, num_hidden_layers=80,
                     num_attention_heads=64, num_key_value_heads=64, vocab_size=152064),
}
QWEN1_TARGETS = {"c_attn": ("q_proj", "k_proj", "v_proj"), "c_proj": ("o_proj", "down_proj"),
                 "w1": ("up_proj",), "w2": ("gate_proj",)}


def qwen1_size(model_id: str) -> str | None:
    """'Qwen/Qwen-7B-Chat' -> 'Qwen-7B'; None for another model or a GPTQ (-Int4) checkpoint."""
    name = model_id.split("/")[-1]
    if "Int4" in name or "Int8" in name:
        return None
    base = name.removesuffix("-Chat")
    return base if base in QWEN1 else None


def prepare(row: dict) -> dict | None:
    """The row as the frozen converters read it (a copy), or None when it must be skipped (the reason in
    ``skip_reason``)."""
    row = json.loads(json.dumps(row))
    if int(row.get("sequence_parallel") or 1) > 1:
        return None
    size = qwen1_size(row.get("model") or "")
    if size and row.get("method") == "lora" and row.get("lora"):
        lora = row["lora"]
        targets = [t for name in lora.get("targets") or () for t in QWEN1_TARGETS.get(name, (name,))]
        chat = row["model"].endswith("-Chat")
        row["peft_config"] = {"r": lora.get("r"), "target_modules": targets, "lora_dropout": lora.get("dropout"),
                              "modules_to_save": [] if chat else ["embed_tokens", "lm_head"]}
    return row


def skip_reason(row: dict) -> str:
    return "sequence parallelism (sequence_parallel > 1) is not a memfit lever"


@contextlib.contextmanager
def registered(config_dir: Path):
    """Qwen-1's configs known to both converters for the duration (memory: a config.json path per id)."""
    from bench import gpu_published_rows, public_time_rows

    config_dir.mkdir(parents=True, exist_ok=True)
    added_m, added_t = {}, {}
    for size, cfg in QWEN1.items():
        path = config_dir / f"{size.lower()}.json"
        path.write_text(json.dumps(cfg, indent=1) + "\n")
        for mid in (f"Qwen/{size}", f"Qwen/{size}-Chat"):
            added_m[mid] = str(path)
            added_t[mid] = cfg
    gpu_published_rows.MODELS.update(added_m)
    public_time_rows.CONFIGS.update(added_t)
    try:
        yield
    finally:
        for k in added_m:
            gpu_published_rows.MODELS.pop(k, None)
            public_time_rows.CONFIGS.pop(k, None)
