"""MEFT on a tiny random Llama: training, save/load, optimizer checkpoint, import boundaries."""

from __future__ import annotations

import json

import pytest
import torch

from memfit.errors import MemfitError
from memfit.meft import (MeftConfig, add_meft, adapters, build_meft_optimizer, load_meft, meft_state,
                         save_meft, traffic)

pytest.importorskip("transformers")


@pytest.fixture
def llama(tiny_llama):
    """A random-init Llama (hidden 64, 2 layers, vocabulary 256), seeded: llama(seed=0)."""
    return lambda seed=0: tiny_llama(seed, intermediate_size=128, vocab_size=256)


CFG = dict(neurons=256, top_k=16, experts="auto", n_probe=4, buffer_size=128)


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (2, 24), generator=g)


def train(model, opt, ids, steps):
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_tiny_llama_trains_with_meft_and_loss_falls(llama):
    model = add_meft(llama(), MeftConfig(**CFG))
    assert list(adapters(model)) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    base_trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert base_trainable == ["model.layers.0.mlp.meft.router.weight", "model.layers.1.mlp.meft.router.weight"]
    first = adapters(model)["model.layers.0.mlp"].store
    assert torch.equal(first.keys[:128], model.model.layers[0].mlp.gate_proj.weight)  # keys from the FFN
    assert len({tuple(row) for row in first.keys[:, :4].tolist()}) == 256  # no duplicated neurons
    ids = batch()
    with torch.no_grad():  # W_V starts at zero: the adapted model starts as the base model
        before = model(input_ids=ids).logits
        clean = llama()(input_ids=ids).logits
    torch.testing.assert_close(before, clean)
    opt = build_meft_optimizer(model, lr=1e-2)
    losses = train(model, opt, ids, 30)
    assert losses[-1] < losses[0] - 0.5, losses
    state = meft_state(model)
    assert state["layers"] == 2 and state["experts"] == 16
    assert state["device_bytes"] == 2 * (2 * 128 * 64 * 4 + 16 * 64 * 4)  # fixed buffers + router
    assert state["cpu_optimizer_bytes"] > 0 and traffic(model)["h2d"] > 0


def test_save_load_gives_identical_outputs(llama, tmp_path):
    model = add_meft(llama(), MeftConfig(**CFG))
    ids = batch()
    train(model, build_meft_optimizer(model, lr=1e-2), ids, 3)
    save_meft(model, tmp_path / "meft")
    meta = json.loads((tmp_path / "meft" / "meft_config.json").read_text())
    assert meta["config"]["neurons"] == 256 and not list((tmp_path / "meft").glob("*.tmp"))
    save_meft(model, tmp_path / "one" / "meft.safetensors")  # file form; config also in its metadata
    (tmp_path / "one" / "meft.json").unlink()
    with torch.no_grad():
        expect = model(input_ids=ids).logits
        for path in (tmp_path / "meft", tmp_path / "one" / "meft.safetensors"):
            other = load_meft(llama(), path)  # adds the adapters from the saved config
            torch.testing.assert_close(other(input_ids=ids).logits, expect, rtol=0, atol=0)


def test_optimizer_state_dict_resumes_tables_and_moments(llama, tmp_path):
    """What the Trainer does on resume: model weights (base + router) and optimizer state from disk."""
    model = add_meft(llama(), MeftConfig(**CFG))
    opt = build_meft_optimizer(model, lr=1e-2, weight_decay=0.01)
    ids = batch()
    train(model, opt, ids, 3)
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    other = add_meft(llama(), MeftConfig(**CFG))  # fresh tables
    other.load_state_dict(model.state_dict())
    opt2 = build_meft_optimizer(other, lr=1e-2, weight_decay=0.01)
    opt2.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    train(model, opt, ids, 2)
    train(other, opt2, ids, 2)
    for name, a in adapters(model).items():
        b = adapters(other)[name]
        torch.testing.assert_close(b.store.keys, a.store.keys, rtol=0, atol=0)
        torch.testing.assert_close(b.store.values, a.store.values, rtol=0, atol=0)
        torch.testing.assert_close(b.router.weight, a.router.weight, rtol=0, atol=0)
    bad = opt.state_dict()
    bad["meft_tables"] = {k: v[:3] for k, v in bad["meft_tables"].items()}
    with pytest.raises(MemfitError, match="has another shape"):
        opt2.load_state_dict(bad)


def test_gradient_checkpointing_gives_the_same_gradients(llama):
    ids = batch()
    grads = []
    for checkpointing in (False, True):
        model = add_meft(llama(), MeftConfig(**CFG))
        for a in adapters(model).values():
            a.store.values.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append([a.store.grad_keys.clone() for a in adapters(model).values()])
    for g0, g1 in zip(*grads):
        assert g0.abs().sum() > 0
        torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6)


def test_load_errors_are_one_clear_line(llama, tmp_path):
    with pytest.raises(MemfitError, match="meft_config.json: not found"):
        load_meft(llama(), tmp_path)
    model = add_meft(llama(), MeftConfig(**CFG))
    save_meft(model, tmp_path / "a")
    wrong = add_meft(llama(), MeftConfig(**{**CFG, "neurons": 128}))
    with pytest.raises(MemfitError, match="has shape"):
        load_meft(wrong, tmp_path / "a")


def test_meft_imports_nothing_from_train_or_measure():
    import ast
    from pathlib import Path

    import memfit.meft

    for path in Path(memfit.meft.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(("memfit.train", "memfit.measure", "transformers")), (path, name)
