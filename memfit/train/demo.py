"""The embedded default: a tiny real-architecture Llama, a locally trained tokenizer and a small
dialogue → summary dataset, so memfit trains on a fresh machine with no model hub.

Everything is generated deterministically and cached (``$MEMFIT_CACHE`` or ``~/.cache/memfit``).
The model has random weights: it exists to exercise the real training stack, not to be useful.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

DEMO_VERSION = "v1"

# A minimal chat template for the demo tokenizer (ChatML-like, plain text markers).
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\n' + m['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_NAMES = ["Anna", "Ben", "Chloe", "David", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jack",
          "Kate", "Liam", "Mia", "Noah", "Olga", "Paul"]
_PLACES = ["the cafe", "the station", "the library", "the park", "the office", "the gym",
           "the cinema", "the market"]
_TIMES = ["at 5 pm", "at noon", "tomorrow morning", "on Friday", "after lunch", "at 8 am",
          "on Sunday", "tonight"]
_THINGS = ["the keys", "the book", "some bread", "the tickets", "a charger", "the report",
           "an umbrella", "the cake"]


@dataclass(frozen=True)
class TinyModelConfig:
    """Sizes of the generated Llama (defaults: the demo's; tests pass micro sizes)."""

    hidden_size: int = 128
    intermediate_size: int = 344
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 1024
    max_position_embeddings: int = 512


def demo_cache_dir() -> Path:
    root = os.environ.get("MEMFIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "memfit")
    return Path(root) / f"demo-{DEMO_VERSION}"


def _dialogue(rng: random.Random) -> dict[str, str]:
    a, b = rng.sample(_NAMES, 2)
    place, time, thing = rng.choice(_PLACES), rng.choice(_TIMES), rng.choice(_THINGS)
    kind = rng.randrange(3)
    if kind == 0:
        lines = [f"{a}: Can we meet {time}?", f"{b}: Sure, where?", f"{a}: At {place}.", f"{b}: See you there."]
        summary = f"{a} and {b} will meet at {place} {time}."
    elif kind == 1:
        lines = [f"{a}: Did you take {thing}?", f"{b}: Yes, I left it at {place}.", f"{a}: Thanks!"]
        summary = f"{b} left {thing} at {place}."
    else:
        lines = [f"{a}: I can't come {time}.", f"{b}: Why not?", f"{a}: I have to go to {place}.",
                 f"{b}: OK, bring {thing} next time."]
        summary = f"{a} can't come {time} because of {place}; {b} asks for {thing}."
    return {"dialogue": "\n".join(lines), "summary": summary}


def make_dialogue_records(n: int = 400, seed: int = 0) -> list[dict[str, str]]:
    """A SAMSum-style dialogue → summary dataset, generated from templates (deterministic)."""
    rng = random.Random(seed)
    return [_dialogue(rng) for _ in range(n)]


def write_jsonl(records: list[dict], path: Path) -> Path:
    from memfit.io import write_text

    return write_text(path, "".join(json.dumps(rec) + "\n" for rec in records), "data file")


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE trained locally with ``tokenizers``, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out_dir: Path, cfg: TinyModelConfig = TinyModelConfig(), seed: int = 0,
                     texts: list[str] | None = None) -> Path:
    """Write a random-init Llama + tokenizer folder loadable with ``from_pretrained`` (atomically)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    if texts is None:
        texts = [r["dialogue"] + "\n" + r["summary"] for r in make_dialogue_records(400, seed)]
    tokenizer = train_tokenizer(texts, cfg.vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    from memfit.io import atomic_dir

    with atomic_dir(out_dir, "model folder") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return out_dir


def ensure_demo_assets(cache_dir: Path | None = None) -> tuple[Path, Path]:
    """The demo model folder and dataset file, generated on first use and cached."""
    root = Path(cache_dir) if cache_dir is not None else demo_cache_dir()
    data_path = root / "dialogue_summary.jsonl"
    records = make_dialogue_records(400, seed=0)
    if not data_path.is_file():
        write_jsonl(records, data_path)
    texts = [r["dialogue"] + "\n" + r["summary"] for r in records]
    model_dir = build_tiny_model(root / "tiny-llama", TinyModelConfig(), seed=0, texts=texts)
    return model_dir, data_path


def demo_run_dict(model_dir: Path, data_path: Path, out_dir: Path) -> dict:
    """The run description ``memfit demo`` uses (before ``--set`` overrides)."""
    return {
        "model": str(model_dir),
        "hardware": "local",
        "data": {"path": str(data_path), "format": "dialogue_summary", "eval_fraction": 0.05},
        "strategy": {
            "method": "lora", "gradient_checkpointing": False, "attention": "sdpa",
            "precision": "fp32", "micro_batch_size": 8, "grad_accum": 1, "seq_len": 128,
            "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
        },
        "training": {"max_steps": 40, "learning_rate": 3e-3, "warmup_steps": 2, "seed": 0,
                     "logging_interval": 1, "lr_scheduler": "linear"},
        "output_dir": str(out_dir),
    }
