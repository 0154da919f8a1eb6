"""measure feeds token ids of the planned shapes, with no tokenizer; the probe refuses any other shape."""

import json
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memfit.errors import MemfitError  # noqa: E402
from memfit.measure.callback import ProbeCallback  # noqa: E402


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory):
    """save_pretrained of a model alone: config.json + weights, no tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("bare") / "model"
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=300, max_position_embeddings=128)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    assert not list(path.glob("tokenizer*"))
    return path


def test_tokenizerless_model_measures_the_planned_logits(bare_model, tmp_path, monkeypatch):
    from memfit.measure import worker

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the worker sets its spec's count there: undone after the test
    from memfit.spec.run import run_from_dict

    b, s, vocab = 2, 48, 300
    run = run_from_dict({"model": str(bare_model), "hardware": "local",
                         "strategy": {"method": "lora", "precision": "fp32", "micro_batch_size": b,
                                      "seq_len": s, "gradient_checkpointing": False},
                         "output_dir": str(tmp_path / "unused")}, source="test")
    spec = {"run": run.model_dump(mode="json"), "warmup": 1, "steps": 1,
            "out": str(tmp_path / "rank{rank}.json"), "categories": True, "threads": 1}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert worker.main([str(tmp_path / "spec.json")]) == 0
    measured = json.loads((tmp_path / "rank0.json").read_text())
    logits = measured["components"]["logits"]
    one = b * s * vocab * 4  # fp32 b·s·V
    # the loss keeps whole b·s·V tensors (logits, their fp32 copy, the gradient): a positive multiple
    assert logits > 0 and logits % one == 0, (logits, one)
    assert measured["components"]["activations"] > 10 * b * s * 32


def _state(step):
    return SimpleNamespace(global_step=step)


def test_probe_refuses_a_step_of_other_shapes():
    model = torch.nn.Embedding(10, 4)
    cb = ProbeCallback(warmup=0, steps=1, expect_shape=(2, 8))
    cb.on_train_begin(None, _state(0), None, model=model)
    model(torch.zeros(2, 8, dtype=torch.long))
    cb.on_step_end(None, _state(1), None)  # planned shape: accepted
    model(torch.zeros(2, 3, dtype=torch.long))  # e.g. a tokenizer that emptied the text
    with pytest.raises(MemfitError, match=r"step 2 ran input_ids of shape \(2, 3\), not the planned"):
        cb.on_step_end(None, _state(2), None)
    with pytest.raises(MemfitError, match="no forward pass seen"):
        cb.on_step_end(None, _state(3), None)
