"""The closed-book knowledge task of bench/studies/meft_knowledge.py, generated locally (no download).

Entities are random one-word names (``zoka``, one token each); each has one value per relation (city,
colour, job, pet), asked by one question template (``Q : what is the city of zoka ? A :``) and
answered with one word. The base model is pre-trained
on the facts of *other* entities in the same templates (it learns the format and the answer sets), then
each method must store the facts of new entities. A control task needs no stored knowledge: copy a
random string of letters (``Q : repeat c a ? A : c a``), evaluated on strings never trained on.

Recall is closed-book exact match: from the question alone the greedy answer must equal the stored one
token for token, end-of-sequence included. With teacher forcing, the greedy answer equals the target
exactly when the argmax at every answer position is the target token (induction over the positions),
so one batched forward pass scores many questions.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]   # 70
LETTERS = list("abcdefghijklmnopqrstuvwxyz")
TEMPLATE = "Q : what is the {r} of {e} ? A :"
RELATIONS = {"city": "city", "colour": "col", "job": "job", "pet": "pet"}  # relation -> answer prefix
VALUES_PER_RELATION = 48
COPY_TEMPLATE = "Q : repeat {s} ? A :"
COPY_LEN = 2
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


@dataclass(frozen=True)
class TaskSize:
    """How much of everything: entities for pre-training and for the new facts, copy examples."""

    old_entities: int = 200      # pre-training facts: old_entities x len(RELATIONS)
    new_entities: int = 32       # the facts to store: new_entities x len(RELATIONS)
    copy_train: int = 64         # control examples fine-tuned on (pre-training: 4x as many others)
    copy_eval: int = 64          # control task examples evaluated (never trained on)


# The new entities' facts are all trained on; the first VAL_SHARE of the new entities (in the task's fixed
# order, rounded up) are the validation entities, whose recall picks the learning rate; the rest are the
# test entities, whose recall is reported. 32 new entities: 8 validation (32 facts), 24 test (96 facts).
VAL_SHARE = 0.25


def vocabulary() -> list[str]:
    """Every word the task uses (a word-level tokenizer: one token per word)."""
    words = SPECIALS + TEMPLATE.replace("{r}", "").replace("{e}", "").split() + list(RELATIONS)
    words += ["repeat"] + LETTERS + [a + b for a in SYLLABLES for b in SYLLABLES[:10]]
    words += [f"{p}{i}" for p in RELATIONS.values() for i in range(VALUES_PER_RELATION)]
    return list(dict.fromkeys(words))


def entity_names(rng: random.Random) -> list[str]:
    """The 700 one-token names of two syllables (``zoka``) the vocabulary has, in a shuffled order."""
    names = [a + b for a in SYLLABLES for b in SYLLABLES[:10]]
    rng.shuffle(names)
    return names


def fact_records(entities: list[str], rng: random.Random) -> list[dict]:
    """One prompt/completion record per (entity, relation), each value drawn uniformly."""
    out = []
    for e in entities:
        for rel, prefix in RELATIONS.items():
            value = f"{prefix}{rng.randrange(VALUES_PER_RELATION)}"
            out.append({"prompt": TEMPLATE.format(r=rel, e=e), "completion": " " + value, "kind": rel,
                        "entity": e})
    return out


def copy_records(n: int, rng: random.Random, exclude: set) -> list[dict]:
    """n distinct copy examples whose strings are not in ``exclude`` (which grows)."""
    out = []
    while len(out) < n:
        s = " ".join(rng.choice(LETTERS) for _ in range(COPY_LEN))
        if s in exclude:
            continue
        exclude.add(s)
        out.append({"prompt": COPY_TEMPLATE.format(s=s), "completion": " " + s, "kind": "copy"})
    return out


def make_task(size: TaskSize = TaskSize(), seed: int = 0) -> dict[str, list[dict]]:
    """{"pretrain", "new_facts", "new_val", "new_test", "copy_train", "copy_eval"}: deterministic in ``seed``;
    the entities of pretrain and new_facts are disjoint, and so are the copy strings of every split.
    Names, old facts, new facts and copy strings come from separate random streams, so the pre-training set
    does not depend on ``new_entities`` (one shipped base serves every size) and a larger new set begins
    with the smaller one's entities and facts. new_val / new_test split new_facts by entity (VAL_SHARE)."""
    names = entity_names(random.Random(f"{seed}-names"))
    old, new = names[: size.old_entities], names[size.old_entities: size.old_entities + size.new_entities]
    crng, used = random.Random(f"{seed}-copy"), set()
    copy_pre = copy_records(4 * size.copy_train, crng, used)
    copy_train = copy_records(size.copy_train, crng, used)
    copy_eval = copy_records(size.copy_eval, crng, used)
    facts = fact_records(new, random.Random(f"{seed}-new"))
    val = set(new[: math.ceil(len(new) * VAL_SHARE)])
    return {"pretrain": fact_records(old, random.Random(f"{seed}-old")) + copy_pre, "new_facts": facts,
            "new_val": [r for r in facts if r["entity"] in val],
            "new_test": [r for r in facts if r["entity"] not in val],
            "copy_train": copy_train, "copy_eval": copy_eval}


def write_jsonl(records: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["completion"]}) + "\n"
                            for r in records))
    return path


# ---------------------------------------------------------------- tokenizer and model


def build_tokenizer():
    """A word-level tokenizer over :func:`vocabulary` (whitespace split), as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


@dataclass(frozen=True)
class ModelSize:
    hidden: int = 64
    intermediate: int = 176
    layers: int = 2
    heads: int = 4
    max_positions: int = 32


def build_model(out_dir: Path, size: ModelSize = ModelSize(), seed: int = 0) -> Path:
    """A random-init Llama from a config, saved with save_pretrained (safetensors) + the tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.heads,
        max_position_embeddings=size.max_positions, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# ---------------------------------------------------------------- closed-book exact match


def encode(records: list[dict], tokenizer) -> tuple:
    """(input_ids, attention_mask, targets) for teacher-forced scoring: targets hold the answer's tokens
    and end-of-sequence at the positions that predict them, -100 elsewhere (right-padded)."""
    import torch

    rows, tgts = [], []
    for r in records:
        prompt = [tokenizer.bos_token_id] + tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(r["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = prompt + answer
        rows.append(ids)
        tgts.append([-100] * (len(prompt) - 1) + answer + [-100])
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    targets = torch.tensor([t + [-100] * (width - len(t)) for t in tgts])
    return ids, mask, targets


def exact_match(predicted, targets) -> list[bool]:
    """Per row: every position with a target (not -100) predicted exactly (argmax ids vs target ids)."""
    keep = targets != -100
    ok = (predicted == targets) | ~keep
    return [bool(x) for x in ok.all(dim=1)]


def recall(model, tokenizer, records: list[dict], batch: int = 256) -> float:
    """Closed-book exact-match recall of the answers from the questions alone (greedy, see module doc)."""
    import torch

    if not records:
        return float("nan")
    was_training = model.training
    model.eval()
    hits = 0
    device = next(p for p in model.parameters()).device
    with torch.no_grad():
        for i in range(0, len(records), batch):
            ids, mask, targets = encode(records[i:i + batch], tokenizer)
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            hits += sum(exact_match(logits.argmax(-1).cpu(), targets))
    if was_training:
        model.train()
    return hits / len(records)


def answer_nll(model, tokenizer, records: list[dict], batch: int = 256) -> float:
    """Mean teacher-forced negative log-likelihood (nats) of the answer's first token (the fact itself;
    end-of-sequence is easy): a smoother measure than exact match on the same questions."""
    import torch

    if not records:
        return float("nan")
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    device = next(p for p in model.parameters()).device
    with torch.no_grad():
        for i in range(0, len(records), batch):
            ids, mask, targets = encode(records[i:i + batch], tokenizer)
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float().cpu()
            first = (targets != -100).float().argmax(dim=1)  # the position that predicts the answer
            rows = torch.arange(len(first))
            logp = torch.log_softmax(logits[rows, first], dim=-1)
            total += -logp[rows, targets[rows, first]].sum().item()
            count += len(first)
    if was_training:
        model.train()
    return total / count
