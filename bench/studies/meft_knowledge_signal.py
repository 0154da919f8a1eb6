"""How well the frozen, pre-trained base model of bench/studies/meft_knowledge.py carries a question's entity to
the position that must predict the answer (the FFN-side adapters, PA and MEFT, see only that position's
FFN input there). Measured for the pre-trained entities ("old", 32 of them) and for the new entities whose
facts the methods store ("new"), per layer:

- ``entity_acc``: nearest-centroid accuracy of the entity from the FFN input at the answer position,
  leave-one-relation-out (centroids from the other three questions about each entity; chance 1/32);
- ``attn_to_entity``: attention weight from the answer position to the entity's token (mean over heads);
- and the norm of the entities' input embeddings (the new ones were never trained: they keep their
  random initialisation).
"""

from __future__ import annotations

from pathlib import Path


def _questions(records: list[dict], entities: int) -> list[dict]:
    from bench.studies.meft_knowledge_data import RELATIONS

    facts = [r for r in records if r["kind"] in RELATIONS]
    keep = set(list(dict.fromkeys(r["prompt"].split()[-4] for r in facts))[:entities])
    return [r for r in facts if r["prompt"].split()[-4] in keep]


def _features(model, tok, records: list[dict]) -> dict:
    """FFN inputs at the answer position per layer, attention to the entity per layer, entity ids."""
    import torch

    from bench.studies.meft_knowledge_data import encode

    ids, mask, targets = encode(records, tok)
    last = (targets != -100).float().argmax(dim=1)
    ent_ids = torch.tensor(tok.convert_tokens_to_ids([r["prompt"].split()[-4] for r in records]))
    ent_pos = (ids == ent_ids[:, None]).float().argmax(dim=1)
    rows = torch.arange(len(records))
    ffn_in: dict = {}
    hooks = [layer.mlp.register_forward_pre_hook(
        lambda m, a, i=i: ffn_in.__setitem__(i, a[0][rows, last].clone()))
        for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    for h in hooks:
        h.remove()
    attn = [a[rows, :, last, ent_pos].mean(dim=1).mean().item() for a in out.attentions]
    emb = model.get_input_embeddings().weight[ent_ids].norm(dim=1).mean().item()
    return {"ffn_in": ffn_in, "attn": attn, "ent": ent_ids, "kind": [r["kind"] for r in records], "emb": emb}


def _centroid_accuracy(x, ent, kinds: list) -> float:
    import torch

    x = torch.nn.functional.normalize(x - x.mean(dim=0), dim=1)
    hits = total = 0
    for held in sorted(set(kinds)):
        test = torch.tensor([k == held for k in kinds])
        names = ent.unique()
        cents = torch.stack([x[(~test) & (ent == e)].mean(dim=0) for e in names])
        pred = names[(x[test] @ cents.T).argmax(dim=1)]
        hits += int((pred == ent[test]).sum())
        total += int(test.sum())
    return hits / total


def entity_signal(model_dir: Path, task: dict, entities: int = 32) -> dict:
    from transformers import AutoModelForCausalLM

    from bench.studies.meft_knowledge_data import build_tokenizer

    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    out: dict = {}
    for which, recs in (("old", _questions(task["pretrain"], entities)), ("new", _questions(task["new_facts"],
                                                                                          entities))):
        f = _features(model, tok, recs)
        for layer, x in sorted(f["ffn_in"].items()):
            out.setdefault(f"entity_acc_layer{layer}", {})[which] = _centroid_accuracy(x, f["ent"], f["kind"])
            out.setdefault(f"attn_to_entity_layer{layer}", {})[which] = f["attn"][layer]
        out.setdefault("embedding_norm", {})[which] = f["emb"]
    return out
