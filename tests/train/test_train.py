"""memfit.train on a micro Llama (hidden 64, 2 layers, vocab ~512), CPU, a few steps each."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from memfit.errors import ConfigError, IncompatibleError, MemfitError  # noqa: E402
from memfit.spec.run import load_run, run_from_dict  # noqa: E402
from memfit.train.api import train  # noqa: E402
from memfit.train.demo import make_dialogue_records, write_jsonl  # noqa: E402


@pytest.fixture(scope="session")
def assets(tmp_path_factory, tiny_model_dir):
    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("memfit-micro")
    recs = make_dialogue_records(64, seed=1)
    model = tiny_model_dir("train", [r["dialogue"] + "\n" + r["summary"] for r in recs])
    data = write_jsonl([{"prompt": r["dialogue"].split("\n")[0] + "\nSummary:", "completion": " " + r["summary"]}
                        for r in recs], root / "pc.jsonl")
    return model, data


def make_run(assets, out, overrides=(), **strategy):
    model, data = assets
    raw = {"model": str(model), "data": {"path": str(data), "eval_fraction": 0.0},
           "strategy": {"method": "lora", "precision": "fp32", "seq_len": 64, "micro_batch_size": 4,
                        "lora_dropout": 0.0, "lora_r": 8, **strategy},
           "training": {"max_steps": 12, "learning_rate": 1e-2, "seed": 0},
           "output_dir": str(out)}
    return run_from_dict(raw, list(overrides))


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
@pytest.mark.parametrize("gc", [False, True])
def test_loss_falls(assets, tmp_path, method, gc):
    if method == "qlora":
        pytest.importorskip("bitsandbytes")
    r = train(make_run(assets, tmp_path, method=method, gradient_checkpointing=gc))
    assert r.steps == 12
    first = sum(loss for _, loss in r.losses[:3]) / 3
    last = sum(loss for _, loss in r.losses[-3:]) / 3
    assert last < first - 0.25, r.losses
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows if "loss" in x] == list(range(1, 13))
    assert all(x["peak_mem_bytes"] > 0 and x["tokens_per_s"] > 0 for x in rows if "loss" in x)
    assert (Path(r.saved_to) / ("adapter_model.safetensors" if method != "full" else "model.safetensors")).is_file()
    assert load_run(tmp_path / "run.yaml").strategy.method == method


def test_checkpointing_is_really_active_with_lora(assets, tmp_path):
    """Non-reentrant checkpointing recomputes each decoder layer in backward (2 forward calls per step)."""
    from memfit.train.model import build_model

    for gc, expected in ((False, 1), (True, 2)):
        model, tok, _ = build_model(make_run(assets, tmp_path, gradient_checkpointing=gc))
        calls = []
        layer = model.base_model.model.model.layers[0].mlp  # inside the checkpointed forward
        layer.register_forward_pre_hook(lambda *a: calls.append(1))  # recompute stops early, before post-hooks
        ids = torch.randint(4, 100, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        assert len(calls) == expected
        assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_qlora_quantizes_base_to_4bit(assets, tmp_path):
    pytest.importorskip("bitsandbytes")
    from memfit.train.model import build_model

    model, _, info = build_model(make_run(assets, tmp_path, method="qlora"))
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Linear4bit" in kinds
    assert info.trainable < info.params


def test_adapter_reloads_with_same_logits(assets, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = make_run(assets, tmp_path, overrides=["max_steps=4"])
    r = train(run)
    ids = torch.randint(4, 200, (1, 20))
    base = AutoModelForCausalLM.from_pretrained(str(assets[0]), dtype=torch.float32)
    plain = base(input_ids=ids).logits
    reloaded = PeftModel.from_pretrained(base, r.saved_to).eval()
    with torch.no_grad():
        got = reloaded(input_ids=ids).logits
    # the trained adapter changed the model, and the reload reproduces the trained model
    assert not torch.allclose(got, plain, atol=1e-4)
    from memfit.train.model import build_model

    model, _, _ = build_model(run)
    from safetensors.torch import load_file

    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, load_file(str(Path(r.saved_to) / "adapter_model.safetensors")))
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, got, atol=1e-5)


def test_full_finetune_saves_loadable_weights(assets, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r = train(make_run(assets, tmp_path, method="full", overrides=["max_steps=4"]))
    m = AutoModelForCausalLM.from_pretrained(r.saved_to)
    base = AutoModelForCausalLM.from_pretrained(str(assets[0]))
    diff = [(a - b).abs().max().item() for a, b in zip(m.parameters(), base.parameters())]
    assert max(diff) > 0
    # the training loss fell: in the run's log (metrics.jsonl, one row per optimizer step) ...
    logged = [x["loss"] for x in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in x]
    assert [loss for _, loss in r.losses] == pytest.approx(logged)
    assert len(logged) == 4 and logged[-1] < logged[0], logged
    # ... and the saved weights give a lower loss than the base on the training records
    tok = AutoTokenizer.from_pretrained(r.saved_to)
    records = [json.loads(x) for x in assets[1].read_text().splitlines()[:16]]
    batch = tok([x["prompt"] + x["completion"] for x in records], return_tensors="pt", padding=True,
                truncation=True, max_length=64)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        before, after = (model(**batch, labels=labels).loss.item() for model in (base.eval(), m.eval()))
    assert after < before - 0.1, (before, after)


class _Crash(Exception):
    pass


def _crash_after(step):
    from transformers import TrainerCallback

    class Crash(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == step:
                raise _Crash()
    return Crash()


def test_resume_equals_uninterrupted(assets, tmp_path):
    from safetensors.torch import load_file

    kw = dict(overrides=["max_steps=8", "training.checkpoint_interval=3"], lora_dropout=0.1)
    full = train(make_run(assets, tmp_path / "a", **kw))
    with pytest.raises(_Crash):
        train(make_run(assets, tmp_path / "b", **kw), callbacks=[_crash_after(5)])
    assert sorted(p.name for p in (tmp_path / "b").glob("checkpoint-*")) == ["checkpoint-3"]
    with pytest.raises(MemfitError, match="checkpoints of an earlier run.*--resume"):
        train(make_run(assets, tmp_path / "b", **kw))  # a fresh run would mix with the old checkpoints
    resumed = train(make_run(assets, tmp_path / "b", **kw), resume=True)
    assert resumed.resumed_from.endswith("checkpoint-3") and resumed.steps == 8
    a = load_file(str(Path(full.saved_to) / "adapter_model.safetensors"))
    b = load_file(str(Path(resumed.saved_to) / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k
    assert [x[1] for x in full.losses[3:]] == pytest.approx([x[1] for x in resumed.losses], abs=1e-5)
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in x]
    assert steps == list(range(1, 9))  # what the crashed run logged after checkpoint-3 was dropped


def test_killed_checkpoint_save_leaves_nothing_that_looks_complete(assets, tmp_path, monkeypatch):
    from memfit.train import trainer as T

    real = T.Trainer._save_rng_state

    def dies(self, output_dir):
        raise _Crash()
    monkeypatch.setattr(T.Trainer, "_save_rng_state", dies)
    with pytest.raises(_Crash):
        train(make_run(assets, tmp_path, overrides=["max_steps=4", "training.checkpoint_interval=2"]))
    assert not list(tmp_path.glob("checkpoint-*"))
    with pytest.raises(MemfitError, match="no complete checkpoint"):
        train(make_run(assets, tmp_path, overrides=["max_steps=4"]), resume=True)
    monkeypatch.setattr(T.Trainer, "_save_rng_state", real)
    train(make_run(assets, tmp_path, overrides=["max_steps=4", "training.checkpoint_interval=2"]))
    assert not (tmp_path / ".staging").exists()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]


def test_bad_model_inputs(assets, tmp_path):
    from memfit.train.model import build_model

    with pytest.raises(ConfigError, match="preset name.*no weights"):
        build_model(run_from_dict({"model": "llama-2-7b", "strategy": {"precision": "fp32"}}))
    cfg_only = tmp_path / "cfg"
    cfg_only.mkdir()
    (cfg_only / "config.json").write_text((assets[0] / "config.json").read_text())
    with pytest.raises(ConfigError, match="no weights"):
        build_model(run_from_dict({"model": str(cfg_only)}))
    with pytest.raises(ConfigError, match=r"^strategy\.seq_len=96 is above coder's n_positions=64: its positions "
                       r"are a learned table of 64 rows \(nothing stretches them\); use --seq-len 64 or less "
                       r"\(run file: strategy\.seq_len\)$"):
        build_model(make_run((_bigcode(tmp_path / "coder"), assets[1]), tmp_path, seq_len=96))
    with pytest.raises(ConfigError, match=r"lora_targets \['nope'\]: none is a linear layer.*q_proj"):
        build_model(make_run(assets, tmp_path, lora_targets=["nope"]))
    with pytest.raises(IncompatibleError, match="fp16-mixed needs a CUDA GPU"):
        build_model(make_run(assets, tmp_path, precision="fp16-mixed"))


def _bigcode(folder: Path) -> Path:
    """A micro GPT-BigCode (learned positions: a 64-row wpe table), weights only (refused before its tokenizer)."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    GPTBigCodeForCausalLM(GPTBigCodeConfig(n_embd=32, n_layer=1, n_head=2, n_positions=64, vocab_size=300,
                                           bos_token_id=0, eos_token_id=0)).save_pretrained(folder)
    return folder


def test_rope_past_its_length_loads_with_the_note_and_the_runs_rope_scaling(assets, tmp_path):
    """#36 item 4: the micro Llama (RoPE, max_position_embeddings 128) at seq_len 512 is allowed, with the note;
    the run file's rope_scaling reaches the loaded config."""
    from memfit.train.model import build_model

    model, _, info = build_model(make_run(assets, tmp_path, seq_len=512))
    assert info.max_positions is None  # no length limit for the data to enforce
    assert any(n.startswith("context: seq_len 512 is past model's trained length 128 (max_position_embeddings); "
                            "RoPE, allowed") and "no rope_scaling in the config" in n for n in info.notes), info.notes
    run = make_run(assets, tmp_path, overrides=["rope_scaling={rope_type: linear, factor: 4.0}"], seq_len=512)
    model, _, info = build_model(run)
    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    assert config.rope_parameters["rope_type"] == "linear" and config.rope_parameters["factor"] == 4.0
    assert any('the run\'s rope_scaling {"factor": 4.0, "rope_type": "linear"}' in n for n in info.notes)
    # and trains past it: packed 256-token rows on 128 trained positions, the note in the run's notes
    r = train(make_run(assets, tmp_path / "run", overrides=["max_steps=2", "data.packing=true",
                                                           "rope_scaling={rope_type: linear, factor: 2.0}"],
                       seq_len=256))
    assert r.steps == 2 and all(loss == loss for _, loss in r.losses)
    assert any(n.startswith("context: seq_len 256 is past model's trained length 128") for n in r.notes), r.notes


def test_fa2_falls_back_to_sdpa_with_a_note(assets, tmp_path):
    from memfit.train.model import build_model

    _, _, info = build_model(make_run(assets, tmp_path, attention="fa2"))
    assert info.attention == "sdpa"
    assert any("fa2 unavailable" in n and "sdpa" in n for n in info.notes)


def test_unknown_run_file_key_names_it(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("model: x\nstrategy: {methd: lora}\n")
    with pytest.raises(ConfigError, match=r"strategy\.methd: unknown key"):
        load_run(p)


def test_packed_rows_attend_only_within_each_example(assets, tmp_path):
    """A packed row gives each example the logits it has alone (position_ids restart, no cross-attention)."""
    from memfit.train.data import Collator, pack
    from memfit.train.model import build_model

    model, _, _ = build_model(make_run(assets, tmp_path, method="full"))
    model.eval()
    a, b = list(range(5, 15)), list(range(20, 27))
    batch = Collator(0)(pack([{"input_ids": a, "labels": a}, {"input_ids": b, "labels": b}], 64))
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        alone_b = model(input_ids=torch.tensor([b])).logits
    assert torch.allclose(packed[0, 10:17], alone_b[0], atol=1e-5)


def test_packed_training_run(assets, tmp_path):
    r = train(make_run(assets, tmp_path, overrides=["data.packing=true", "max_steps=6"]))
    assert r.data["packed"] and 0 < r.data["packed_sequences"] < r.data["train_examples"]
    assert r.losses[-1][1] < r.losses[0][1]
