"""memfit.train.data: formats, prompt masking, truncation counts, packing, collation, bad input."""

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from memfit.errors import MemfitError  # noqa: E402
from memfit.spec.run import run_from_dict  # noqa: E402
from memfit.train.data import (IGNORE_INDEX, Collator, pack, prepare_datasets,  # noqa: E402
                               tokenize_example)
from memfit.train.demo import make_dialogue_records, train_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    texts = [r["dialogue"] + "\n" + r["summary"] for r in make_dialogue_records(200)]
    texts += ["Q: what is two plus two?\nA: four", "hello world, how are you?"]
    return train_tokenizer(texts, 400)


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _run(path, **data):
    strategy = data.pop("strategy", {})
    return run_from_dict({"model": "unused", "data": {"path": str(path), "eval_fraction": 0.0, **data},
                          "strategy": {"seq_len": 64, **strategy}})


def test_prompt_completion_masks_prompt(tok):
    rec = {"prompt": "Q: what is two plus two?\nA:", "completion": " four"}
    ids, labels, cut = tokenize_example(rec, "prompt_completion", tok, 64)
    n_prompt = 1 + len(tok(rec["prompt"], add_special_tokens=False)["input_ids"])  # bos + prompt
    comp = tok(" four", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert cut == 0 and ids[0] == tok.bos_token_id
    assert labels[:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert labels[n_prompt:] == comp == ids[n_prompt:]


def test_dialogue_summary_renders_template_and_masks(tok):
    rec = {"dialogue": "Anna: Hi\nBen: Hello", "summary": "They greet."}
    ids, labels, _ = tokenize_example(rec, "dialogue_summary", tok, 128)
    text = tok.decode(ids[1:])
    assert text.startswith("Summarize this dialogue:\nAnna: Hi\nBen: Hello\nSummary: They greet.")
    trained = [i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX]
    assert tok.decode(trained) == " They greet." + tok.eos_token


def test_chat_trains_only_assistant_turns(tok):
    rec = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"},
                        {"role": "user", "content": "how are you?"}, {"role": "assistant", "content": "fine"}]}
    ids, labels, _ = tokenize_example(rec, "chat", tok, 128)
    full = tok.apply_chat_template(rec["messages"], tokenize=False)
    assert tok.decode(ids[1:]) == full
    trained = tok.decode([i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX])
    assert trained == f"world{tok.eos_token}\nfine{tok.eos_token}\n"
    assert "hello" not in trained and "<|user|>" not in trained


def test_auto_detects_format_and_counts_truncation(tmp_path, tok):
    rows = [{"prompt": "Q: what is two plus two?\nA:", "completion": " four " * 20},
            {"prompt": "hello", "completion": " world"}]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    full = [len(tokenize_example(r, "prompt_completion", tok, 10_000)[0]) for r in rows]
    train, ev, rep = prepare_datasets(_run(path, strategy={"seq_len": 48}), tok)
    assert rep.format == "prompt_completion" and ev is None
    assert rep.truncated == 1 and rep.tokens_cut == full[0] - 48 and rep.dropped == 0
    assert [len(x) for x in train["input_ids"]] == [48, full[1]]


def test_truncation_that_leaves_no_completion_is_dropped(tmp_path, tok):
    rows = [{"prompt": "hello world, how are you? " * 10, "completion": " fine"},
            {"prompt": "hello", "completion": " world"}]
    _, _, rep = prepare_datasets(_run(_jsonl(tmp_path / "d.jsonl", rows), strategy={"seq_len": 8}), tok)
    assert rep.dropped == 1 and rep.train_examples == 1


def test_eval_split_is_deterministic(tmp_path, tok):
    rows = [{"text": f"hello {i}"} for i in range(40)]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    a = prepare_datasets(_run(path, eval_fraction=0.25), tok)
    b = prepare_datasets(_run(path, eval_fraction=0.25), tok)
    assert a[2].eval_examples == 10 and a[2].train_examples == 30
    assert a[1]["input_ids"] == b[1]["input_ids"]


def test_packing_keeps_examples_whole_and_restarts_positions(tmp_path, tok):
    exs = [{"input_ids": list(range(n)), "labels": list(range(n))} for n in (5, 6, 3, 7)]
    rows = pack(exs, 12)
    assert [len(r["input_ids"]) for r in rows] == [11, 10]
    assert rows[0]["position_ids"] == list(range(5)) + list(range(6))
    batch = Collator(pad_token_id=0)(rows)
    assert "attention_mask" not in batch and batch["position_ids"].shape == (2, 11)
    assert batch["labels"][1, -1].item() == IGNORE_INDEX  # pad


def test_collator_pads_and_masks_labels():
    batch = Collator(pad_token_id=7)([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
                                      {"input_ids": [4], "labels": [4]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 7, 7]]
    assert batch["labels"].tolist() == [[-100, 2, 3], [4, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_datasets_folder(tmp_path, tok):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_list([{"prompt": "hello", "completion": " world"}] * 3)}) \
        .save_to_disk(str(tmp_path / "ds"))
    _, _, rep = prepare_datasets(_run(tmp_path / "ds"), tok)
    assert rep.examples == 3 and rep.format == "prompt_completion"


@pytest.mark.parametrize("rows, fmt, needle", [
    ([{"prompt": "a", "completion": "b"}, {"prompt": "c"}], "auto", r"d\.jsonl:2: missing field\(s\) completion"),
    (['{"prompt": "a", "completion": "b"}', '{"prompt": '], "auto", r"d\.jsonl:2: not valid JSON"),
    ([{"question": "a", "answer": "b"}], "auto", r"cannot tell the data format.*\['answer', 'question'\]"),
    ([{"text": "a"}], "dialogue_summary", r"d\.jsonl:1: missing field\(s\) dialogue, summary"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], "chat", r"no 'assistant' message"),
    ([], "auto", r"the dataset is empty"),
])
def test_bad_data_names_file_line_and_fields(tmp_path, tok, rows, fmt, needle):
    path = _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(MemfitError, match=needle):
        prepare_datasets(_run(path, format=fmt), tok)


def test_missing_file_and_seq_len_above_model(tmp_path, tok):
    with pytest.raises(MemfitError, match=r"data\.path: .*nope\.jsonl not found"):
        prepare_datasets(_run(tmp_path / "nope.jsonl"), tok)
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    with pytest.raises(MemfitError, match=r"seq_len=64 is above the model's max_position_embeddings=32"):
        prepare_datasets(_run(path), tok, max_positions=32)
