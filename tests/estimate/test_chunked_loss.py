"""strategy.loss=chunked: same loss and gradients as transformers' standard path (fp32, rel 1e-5)."""

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

from memfit.train.loss import chunked_causal_lm_loss, head_postprocess, install_chunked_loss  # noqa: E402

V, H = 97, 16


def _close(a, b, rel=1e-5):
    a, b = a.detach().double(), b.detach().double()
    return (a - b).abs().max().item() <= rel * max(b.abs().max().item(), 1e-12)


def _labels(b, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    lab = torch.randint(0, V, (b, s), generator=g)
    lab[0, :3] = -100  # a masked prompt
    lab[-1, -2:] = -100  # right padding
    return lab


@pytest.mark.parametrize("num_items", [None, 37])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_function_equals_for_causal_lm_loss(num_items, chunk):
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=True)
    hidden = torch.randn(3, 11, H, requires_grad=True)
    labels = _labels(3, 11)
    n = None if num_items is None else torch.tensor(num_items)
    ref = ForCausalLMLoss(head(hidden), labels, V, num_items_in_batch=n)
    ref_grads = torch.autograd.grad(ref, [hidden, head.weight, head.bias])
    got = chunked_causal_lm_loss(hidden, head, labels, num_items_in_batch=n, chunk=chunk)
    got_grads = torch.autograd.grad(got, [hidden, head.weight, head.bias])
    assert _close(got, ref)
    for a, b in zip(got_grads, ref_grads):
        assert _close(a, b)


def test_softcapping_and_scaling_follow_the_config():
    cfg = LlamaConfig(final_logit_softcapping=3.0)
    cfg.logits_scaling = 2.0
    post = head_postprocess(cfg)
    x = torch.randn(4, 5)
    assert torch.allclose(post(x), torch.tanh(x / 2.0 / 3.0) * 3.0)
    assert head_postprocess(LlamaConfig()) is None


@pytest.mark.parametrize("cfg", [dict(final_logit_softcapping=3.0), dict(logits_scaling=2.0),
                                 dict(logit_scale=0.5, final_logit_softcapping=2.0)])
def test_fused_gradients_through_the_post_processing(cfg):
    """The fused path differentiates softcapping / scaling by hand: equal to autograd through post()."""
    torch.manual_seed(0)
    config = LlamaConfig()
    for k, v in cfg.items():
        setattr(config, k, v)
    post = head_postprocess(config)
    head = torch.nn.Linear(H, V, bias=True)
    hidden = (3 * torch.randn(3, 11, H)).requires_grad_()
    labels = _labels(3, 11)
    ref = ForCausalLMLoss(post(head(hidden)), labels, V)
    ref_grads = torch.autograd.grad(ref * 3.0, [hidden, head.weight, head.bias])
    got = chunked_causal_lm_loss(hidden, head, labels, chunk=4, post=post)
    assert type(got.grad_fn.next_functions[0][0]).__name__ == "_FusedLinearCEBackward"
    got_grads = torch.autograd.grad(got * 3.0, [hidden, head.weight, head.bias])
    assert _close(got, ref)
    for a, b in zip(got_grads, ref_grads):
        assert _close(a, b)


def _path(loss):
    """'fused' or 'recompute': which path made ``loss`` (its divide's input)."""
    fn = loss.grad_fn.next_functions[0][0]
    return "fused" if type(fn).__name__ == "_FusedLinearCEBackward" else "recompute"


def test_path_is_chosen_per_call():
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(2, 9, H, requires_grad=True)
    labels = _labels(2, 9)
    ref = ForCausalLMLoss(head(hidden), labels, V)
    ref_grads = torch.autograd.grad(ref, [hidden, head.weight])
    assert _path(chunked_causal_lm_loss(hidden, head, labels, chunk=4)) == "fused"
    # a head the engine owns (ZeRO-3 marks its parameters with ds_id), a hooked head, an unknown
    # post-processing: the recomputing path, same numbers
    head.weight.ds_id = 0
    got = chunked_causal_lm_loss(hidden, head, labels, chunk=4)
    assert _path(got) == "recompute"
    for a, b in zip(torch.autograd.grad(got, [hidden, head.weight]), ref_grads):
        assert _close(a, b)
    del head.weight.ds_id
    handle = head.register_forward_pre_hook(lambda m, a: None)
    assert _path(chunked_causal_lm_loss(hidden, head, labels, chunk=4)) == "recompute"
    handle.remove()
    assert _path(chunked_causal_lm_loss(hidden, head, labels, chunk=4, post=lambda x: x * 2)) == "recompute"
    with torch.no_grad():  # eval: no gradients to make, the plain chunk loop
        assert chunked_causal_lm_loss(hidden, head, labels, chunk=4).grad_fn is None


def test_fused_backward_runs_once():
    head = torch.nn.Linear(H, V)
    hidden = torch.randn(1, 6, H, requires_grad=True)
    loss = chunked_causal_lm_loss(hidden, head, _labels(1, 6), chunk=4)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def _tiny(tied: bool, seed: int = 0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    m = LlamaForCausalLM(cfg).float()
    m.config.use_cache = False
    return m


def _lora(m):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(m, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                        task_type="CAUSAL_LM"))


def _accumulated_step(model, micro_batches):
    """What the Trainer does per optimizer step: num_items over all micro-batches' labels[..., 1:]."""
    n = sum((lab[..., 1:] != -100).sum() for _, lab in micro_batches)
    losses = []
    for ids, lab in micro_batches:
        loss = model(input_ids=ids, labels=lab, num_items_in_batch=n).loss
        loss.backward()
        losses.append(loss.detach())
    return losses, {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("tied", [False, True])
def test_model_loss_and_every_trainable_gradient_equal_standard(method, tied):
    g = torch.Generator().manual_seed(1)
    micro = [(torch.randint(0, V, (2, 9), generator=g), _labels(2, 9, seed=k)) for k in range(2)]
    results = []
    for chunked in (False, True):
        m = _tiny(tied)
        if chunked:
            install_chunked_loss(m, chunk=4)  # 18 tokens -> 5 chunks, the last one short
        if method == "lora":
            m = _lora(m)
        assert (m.get_output_embeddings().weight is m.get_input_embeddings().weight) == tied
        if chunked:  # the fused path (no recomputation) is the one this model takes
            ids, lab = micro[0]
            assert _path(m(input_ids=ids, labels=lab).loss) == "fused"
            m.zero_grad(set_to_none=True)
        results.append(_accumulated_step(m, micro))
    (ref_losses, ref_grads), (losses, grads) = results
    for a, b in zip(losses, ref_losses):
        assert _close(a, b)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for k in grads:
        assert _close(grads[k], ref_grads[k]), k
    if method == "full":
        assert any("lm_head" in k or "embed_tokens" in k for k in grads)


def test_without_labels_the_model_returns_logits():
    m = _tiny(False)
    install_chunked_loss(m)
    ids = torch.randint(0, V, (1, 5))
    out = m(input_ids=ids)
    assert out.logits.shape == (1, 5, V)
    assert m(input_ids=ids, labels=ids).logits is None


def test_trainer_sees_loss_kwargs():
    """The Trainer passes num_items_in_batch only to a forward with **kwargs (trainer.py, 'introspection')."""
    import inspect

    m = _tiny(False)
    install_chunked_loss(m)
    params = inspect.signature(_lora(m).get_base_model().forward).parameters.values()
    assert any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


# ---------------------------------------------------------------- through memfit train
from tests.train.test_train import assets, make_run  # noqa: E402,F401  (the micro Llama fixture)

from memfit.spec.run import load_run  # noqa: E402
from memfit.train.api import train  # noqa: E402


@pytest.mark.parametrize("method", ["lora", pytest.param("full", marks=pytest.mark.slow),
                                    pytest.param("qlora", marks=pytest.mark.slow),
                                    pytest.param("meft", marks=pytest.mark.slow)])
def test_training_with_chunked_loss_logs_the_standard_losses(assets, tmp_path, method):  # noqa: F811
    if method == "qlora":
        pytest.importorskip("bitsandbytes")
    kw = dict(overrides=["max_steps=2"], method=method, grad_accum=2, micro_batch_size=2)
    if method == "meft":
        kw.update(meft_neurons=64, meft_top_k=8)
    std = train(make_run(assets, tmp_path / "std", **kw))
    chk = train(make_run(assets, tmp_path / "chk", loss="chunked", **kw))
    assert [x[1] for x in chk.losses] == pytest.approx([x[1] for x in std.losses], rel=1e-5)
    assert load_run(tmp_path / "chk" / "run.yaml").strategy.loss == "chunked"


@pytest.mark.slow
def test_resume_with_chunked_loss(assets, tmp_path):  # noqa: F811
    from safetensors.torch import load_file

    from tests.train.test_train import _Crash, _crash_after

    kw = dict(overrides=["max_steps=4", "training.checkpoint_interval=2"], loss="chunked")
    full = train(make_run(assets, tmp_path / "a", **kw))
    with pytest.raises(_Crash):
        train(make_run(assets, tmp_path / "b", **kw), callbacks=[_crash_after(3)])
    resumed = train(make_run(assets, tmp_path / "b", **kw), resume=True)
    assert resumed.resumed_from.endswith("checkpoint-2") and resumed.steps == 4
    a = load_file(str(Path(full.saved_to) / "adapter_model.safetensors"))
    b = load_file(str(Path(resumed.saved_to) / "adapter_model.safetensors"))
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k
