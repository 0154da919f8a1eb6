"""Training data: read JSONL or a ``datasets`` folder, render the format, tokenize with the prompt masked,
truncate (counting what was cut), optionally pack, and collate.

Formats (``data.format``): ``prompt_completion`` {prompt, completion}; ``dialogue_summary``
{dialogue, summary} rendered with :data:`DIALOGUE_TEMPLATE`; ``chat`` {messages: [{role, content}]}
rendered with the tokenizer's chat template (loss on assistant turns only); ``text`` {text} (loss on
everything); ``auto`` picks one from the first record's fields.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from memfit.errors import ConfigError, MemfitError

IGNORE_INDEX = -100
DIALOGUE_TEMPLATE = "Summarize this dialogue:\n{dialogue}\nSummary:"

FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    "chat": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "dialogue_summary": ("dialogue", "summary"),
    "text": ("text",),
}


@dataclass
class DataReport:
    """What the data pipeline did: shown in the summary and written to metrics."""

    source: str
    format: str
    examples: int = 0
    train_examples: int = 0
    eval_examples: int = 0
    truncated: int = 0          # examples longer than seq_len, cut at the end
    tokens_cut: int = 0         # tokens removed by truncation
    dropped: int = 0            # examples with no trainable token left after truncation
    train_tokens: int = 0       # tokens in the training split (after truncation)
    packed: bool = False
    packed_sequences: int = 0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- reading


def read_jsonl(path: Path) -> list[dict]:
    """Parse a JSONL file; a bad line raises a MemfitError naming file:line."""
    records = []
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise MemfitError(f"data.path: cannot read {path} ({err.strerror})") from None
    for lineno, data in enumerate(raw.splitlines(), start=1):
        try:
            line = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise MemfitError(f"{path}:{lineno}: not UTF-8 text (byte 0x{data[err.start]:02x} at column "
                              f"{err.start + 1}); save the file as UTF-8") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise MemfitError(f"{path}:{lineno}: not valid JSON ({err.msg}); each line must be one "
                              "JSON object") from None
        if not isinstance(obj, dict):
            raise MemfitError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        obj["__line__"] = lineno
        records.append(obj)
    return records


def read_records(path: Optional[str]) -> tuple[list[dict], str]:
    """Records from a JSONL file, a ``datasets.save_to_disk`` folder, or a folder of *.jsonl files."""
    if path is None:
        from memfit.train.demo import ensure_demo_assets

        _, path = ensure_demo_assets()
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"data.path: {p} not found; give a JSONL file or a datasets folder "
                          "(or leave data.path empty for the embedded demo data)")
    if p.is_file():
        if p.suffix not in (".jsonl", ".json"):
            raise ConfigError(f"data.path: {p} is not a .jsonl file; give JSONL (one object per line) "
                              "or a datasets folder written by save_to_disk")
        return read_jsonl(p), str(p)
    if (p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file():
        from datasets import DatasetDict, load_from_disk

        try:
            ds = load_from_disk(str(p))
        except Exception as err:  # noqa: BLE001 - datasets raises many kinds for a damaged folder
            first = (str(err).splitlines() or [type(err).__name__])[0][:200]
            raise ConfigError(f"data.path: {p} looks like a datasets folder but cannot be loaded ({first}); "
                              "write it with datasets' save_to_disk, or give a JSONL file") from None
        if isinstance(ds, DatasetDict):
            if "train" not in ds:
                raise ConfigError(f"data.path: {p} has splits {list(ds)}, no 'train'; save a 'train' split")
            ds = ds["train"]
        records = [dict(r, __line__=f"row {i}") for i, r in enumerate(ds)]
        return records, str(p)
    files = sorted(p.glob("*.jsonl"))
    if not files:
        raise ConfigError(f"data.path: {p} is a folder with neither *.jsonl files nor a saved datasets "
                          "dataset (datasets.save_to_disk)")
    records = []
    for f in files:
        records.extend(dict(r, __line__=f"{f.name}:{r['__line__']}") for r in read_jsonl(f))
    return records, str(p)


def detect_format(records: list[dict], source: str) -> str:
    keys = set(records[0]) - {"__line__"}
    for fmt, fields in FORMAT_FIELDS.items():
        if set(fields) <= keys:
            return fmt
    raise MemfitError(
        f"{source}: cannot tell the data format from the fields {sorted(keys)}; expected one of "
        + "; ".join(f"{k}: {{{', '.join(v)}}}" for k, v in FORMAT_FIELDS.items())
        + " (or set data.format)"
    )


def _where(source: str, rec: dict) -> str:
    line = rec.get("__line__")
    if isinstance(line, int):
        return f"{source}:{line}"
    return f"{source} ({line})" if line else source


CHAT_ROLES = ("system", "user", "assistant", "tool")


def template_roles(tokenizer) -> tuple[str, ...]:
    """The usual roles plus any other the chat template compares a message's role with
    (``message['role'] == 'ipython'``)."""
    import re

    text = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(text, str):
        return CHAT_ROLES
    named = re.findall(r"role['\"]?\]?\s*==\s*['\"]([\w-]+)['\"]", text)
    return CHAT_ROLES + tuple(dict.fromkeys(r for r in named if r not in CHAT_ROLES))


def _check_messages(rec: dict, source: str, roles: Optional[tuple[str, ...]]) -> None:
    msgs = rec["messages"]
    if not isinstance(msgs, list) or not msgs or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in msgs
    ):
        raise MemfitError(f"{_where(source, rec)}: 'messages' must be a non-empty list of "
                          "{role, content} objects")
    for i, m in enumerate(msgs):
        if not isinstance(m["content"], str):
            raise MemfitError(f"{_where(source, rec)}: messages[{i}].content must be text, got "
                              f"{type(m['content']).__name__}")
        if roles is not None and m["role"] not in roles:
            raise MemfitError(f"{_where(source, rec)}: messages[{i}].role {m['role']!r} is not a role the "
                              f"chat template accepts ({', '.join(roles)})")
    if not any(m["role"] == "assistant" for m in msgs):
        raise MemfitError(f"{_where(source, rec)}: no 'assistant' message to learn from")


def check_fields(records: list[dict], fmt: str, source: str,
                 roles: Optional[tuple[str, ...]] = CHAT_ROLES) -> None:
    fields = FORMAT_FIELDS[fmt]
    for rec in records:
        missing = [f for f in fields if f not in rec or rec[f] is None]
        if missing:
            raise MemfitError(f"{_where(source, rec)}: missing field(s) {', '.join(missing)}; format "
                              f"'{fmt}' needs {', '.join(fields)} in every record")
        if fmt == "chat":
            _check_messages(rec, source, roles)
        else:
            bad = [f for f in fields if not isinstance(rec[f], str)]
            if bad:
                raise MemfitError(f"{_where(source, rec)}: field(s) {', '.join(bad)} must be text")


def check_data(spec) -> None:
    """Read and check ``spec`` (a DataSpec) before anything else is done with the run: every line parses,
    the format is known and every record has its fields. Chat roles are checked later, against the
    model's own template."""
    records, source = read_records(spec.path)
    if not records:
        raise MemfitError(f"{source}: the dataset is empty; it needs at least one record")
    fmt = detect_format(records, source) if spec.format == "auto" else spec.format
    check_fields(records, fmt, source, roles=None)


# ---------------------------------------------------------------- tokenizing


def _segments(rec: dict, fmt: str, tokenizer) -> list[tuple[str, bool]]:
    """(text, trainable) pieces of one example, in order."""
    eos = tokenizer.eos_token or ""
    if fmt == "prompt_completion":
        return [(rec["prompt"], False), (rec["completion"] + eos, True)]
    if fmt == "dialogue_summary":
        return [(DIALOGUE_TEMPLATE.format(dialogue=rec["dialogue"]), False), (" " + rec["summary"] + eos, True)]
    if fmt == "text":
        return [(rec["text"] + eos, True)]
    # chat: diff successive renderings of the template so each turn's tokens are known exactly
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("data.format 'chat' needs a tokenizer with a chat template; this model's "
                          "tokenizer has none (add chat_template to tokenizer_config.json or use "
                          "prompt_completion)")
    msgs = [{"role": m["role"], "content": m["content"]} for m in rec["messages"]]
    out, done = [], ""
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            head = tokenizer.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True) if i else ""
            if head.startswith(done) and len(head) > len(done):
                out.append((head[len(done):], False))
                done = head
        full = tokenizer.apply_chat_template(msgs[: i + 1], tokenize=False)
        if not full.startswith(done):
            raise ConfigError("the tokenizer's chat template does not render conversations prefix by "
                              "prefix; use prompt_completion data instead")
        out.append((full[len(done):], m["role"] == "assistant"))
        done = full
    return out


def tokenize_example(rec: dict, fmt: str, tokenizer, seq_len: int) -> tuple[list[int], list[int], int]:
    """input_ids, labels (prompt = -100) and how many tokens truncation removed."""
    ids: list[int] = []
    labels: list[int] = []
    if tokenizer.bos_token_id is not None:
        ids.append(tokenizer.bos_token_id)
        labels.append(IGNORE_INDEX)
    for text, trainable in _segments(rec, fmt, tokenizer):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.extend(piece)
        labels.extend(piece if trainable else [IGNORE_INDEX] * len(piece))
    cut = max(0, len(ids) - seq_len)
    return ids[:seq_len], labels[:seq_len], cut


def pack(examples: list[dict], seq_len: int) -> list[dict]:
    """Concatenate examples into rows of at most seq_len tokens (no example split across rows);
    position_ids restart at each example so attention stays within it."""
    rows, cur = [], {"input_ids": [], "labels": [], "position_ids": []}
    for ex in examples:
        n = len(ex["input_ids"])
        if cur["input_ids"] and len(cur["input_ids"]) + n > seq_len:
            rows.append(cur)
            cur = {"input_ids": [], "labels": [], "position_ids": []}
        cur["input_ids"] += ex["input_ids"]
        cur["labels"] += ex["labels"]
        cur["position_ids"] += list(range(n))
    if cur["input_ids"]:
        rows.append(cur)
    return rows


def record_text(rec: dict, fmt: str) -> str:
    """The user's text of one record (no template, no special tokens)."""
    if fmt == "chat":
        return "".join(m["content"] for m in rec["messages"])
    return "".join(rec[f] for f in FORMAT_FIELDS[fmt])


def check_tokenizer(tokenizer, vocab_size: Optional[int], texts: list[str], model: str) -> None:
    """Refuse a tokenizer that cannot be the model's: a vocabulary far smaller than the embedding's, or
    one that turns sample text into almost no tokens (e.g. the empty tokenizer transformers builds for
    a folder without tokenizer files)."""
    n = len(tokenizer)
    if vocab_size and n < vocab_size // 4:
        raise ConfigError(f"model: {model}: the tokenizer has {n} tokens but the model's vocabulary has "
                          f"{vocab_size}; it is not this model's tokenizer (save the right one with "
                          "tokenizer.save_pretrained into the model folder)")
    chars = sum(len(t) for t in texts)
    if chars >= 200:
        tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
        if tokens * 50 < chars:
            raise ConfigError(f"model: {model}: the tokenizer turns {chars} characters of sample records "
                              f"into {tokens} tokens; it cannot encode this data (save the model's own "
                              "tokenizer with tokenizer.save_pretrained into the model folder)")


def prepare_datasets(run, tokenizer, max_positions: Optional[int] = None, vocab_size: Optional[int] = None):
    """(train_dataset, eval_dataset or None, DataReport) for ``run`` (a RunSpec). Empty records are
    skipped (all empty: refused); the tokenizer is checked against the model's vocabulary first."""
    from datasets import Dataset

    spec, seq_len = run.data, run.strategy.seq_len
    if max_positions is not None and seq_len > max_positions:
        raise ConfigError(f"strategy.seq_len={seq_len} is above the model's max_position_embeddings="
                          f"{max_positions}; use --set strategy.seq_len={max_positions} or less")
    records, source = read_records(spec.path)
    if not records:
        raise MemfitError(f"{source}: the dataset is empty; it needs at least one record")
    if spec.max_samples:
        records = records[: spec.max_samples]
    fmt = detect_format(records, source) if spec.format == "auto" else spec.format
    check_fields(records, fmt, source, template_roles(tokenizer) if fmt == "chat" else CHAT_ROLES)
    report = DataReport(source=source, format=fmt, examples=len(records), packed=spec.packing)
    texts = [record_text(r, fmt) for r in records]
    empty = sum(1 for t in texts if not t.strip())
    if empty == len(records):
        raise MemfitError(f"{source}: every one of the {len(records)} records is empty (no text in "
                          f"{', '.join(FORMAT_FIELDS[fmt])}); there is nothing to learn from")
    check_tokenizer(tokenizer, vocab_size, [t for t in texts if t.strip()][:32], run.model)
    report.extra["empty"] = empty
    examples = []
    for rec, text in zip(records, texts):
        if not text.strip():
            continue
        ids, labels, cut = tokenize_example(rec, fmt, tokenizer, seq_len)
        if cut:
            report.truncated += 1
            report.tokens_cut += cut
        if all(lab == IGNORE_INDEX for lab in labels):
            report.dropped += 1
            continue
        examples.append({"input_ids": ids, "labels": labels})
    if not examples:
        raise MemfitError(f"{source}: no example has a trainable token left at seq_len={seq_len} "
                          f"({report.dropped} dropped); raise strategy.seq_len or shorten the prompts")
    n_eval = int(len(examples) * spec.eval_fraction)
    if n_eval:
        import random

        order = list(range(len(examples)))
        random.Random(run.training.seed).shuffle(order)
        eval_ex = [examples[i] for i in sorted(order[:n_eval])]
        train_ex = [examples[i] for i in sorted(order[n_eval:])]
    else:
        eval_ex, train_ex = [], examples
    report.train_examples, report.eval_examples = len(train_ex), len(eval_ex)
    report.train_tokens = sum(len(e["input_ids"]) for e in train_ex)
    if spec.packing:
        train_ex = pack(train_ex, seq_len)
        eval_ex = pack(eval_ex, seq_len) if eval_ex else []
        report.packed_sequences = len(train_ex)
    train_ds = Dataset.from_list(train_ex)
    eval_ds = Dataset.from_list(eval_ex) if eval_ex else None
    return train_ds, eval_ds, report


class Collator:
    """Right-pads a batch; pads get label -100. Packed rows keep position_ids and carry no attention mask
    (transformers then builds a per-example causal mask from the position_ids)."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: Optional[int] = None, positions: bool = False,
                 width: Optional[int] = None, mask: bool = True):
        self.pad_token_id = pad_token_id
        self.multiple = pad_to_multiple_of
        self.width = width  # every batch padded to this many tokens (Ulysses over gloo: equal gather shapes)
        self.positions = positions  # position_ids on every batch (Ulysses needs them, ulysses_sp.py:666)
        self.mask = mask  # False: no padding mask (sequence / context parallelism: causal attention only)

    def __call__(self, features: Iterable[dict[str, Any]]) -> dict:
        import torch

        features = list(features)
        width = max(len(f["input_ids"]) for f in features)
        if self.width:
            width = max(width, self.width)
        if self.multiple:
            width = -(-width // self.multiple) * self.multiple
        packed = "position_ids" in features[0]
        ids, labels, mask, pos = [], [], [], []
        for f in features:
            n = len(f["input_ids"])
            pad = width - n
            ids.append(list(f["input_ids"]) + [self.pad_token_id] * pad)
            labels.append(list(f["labels"]) + [IGNORE_INDEX] * pad)
            mask.append([1] * n + [0] * pad)
            if packed:
                last = f["position_ids"][-1] if n else -1
                pos.append(list(f["position_ids"]) + list(range(last + 1, last + 1 + pad)))
        batch = {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}
        if packed:
            batch["position_ids"] = torch.tensor(pos)
        else:
            if self.positions:
                batch["position_ids"] = torch.arange(width).expand(len(ids), width).clone()
            if self.mask:
                batch["attention_mask"] = torch.tensor(mask)
        return batch
