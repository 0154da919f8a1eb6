"""MEFT adapter numerics on a toy FFN: against a dense parallel adapter written here, on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memfit.errors import ConfigError
from memfit.meft import MeftConfig, add_meft, adapters, build_meft_optimizer, traffic
from memfit.meft.router import batch_union, brute_force_topk, key_experts_topk

D = 16


class Toy(nn.Module):
    def __init__(self, d: int = D):
        super().__init__()
        self.mlp = nn.Linear(d, d)

    def forward(self, x):
        return self.mlp(x)


def toy(**cfg) -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    model = add_meft(Toy(), MeftConfig(target=r"^mlp$", init_keys_from_ffn=False, **cfg))
    adapter = adapters(model)["mlp"]
    adapter.store.values.normal_(0.0, 0.5)  # W_V starts at zero; make the test see its gradient path
    return model, adapter


def dense_reference(model, adapter, x, mask=None, gate=None):
    """FFN(x) + (relu(x K^T) [* mask] [* gate]) V with autograd; returns out and leaf tensors."""
    k = adapter.store.keys.clone().requires_grad_(True)
    v = adapter.store.values.clone().requires_grad_(True)
    xr = x.detach().clone().requires_grad_(True)
    act = torch.relu(xr.reshape(-1, D) @ k.T)
    if mask is not None:
        act = act * mask
    if gate is not None:
        act = act * gate
    base = nn.functional.linear(xr, model.mlp.weight, model.mlp.bias)  # the FFN without its hooks
    out = base + (act @ v).reshape(x.shape)
    return out, xr, k, v


def run_meft(model, x, weight):
    xm = x.detach().clone().requires_grad_(True)
    out = model(xm)
    (out * weight).sum().backward()
    return out, xm


def test_all_neurons_no_router_equals_dense_adapter():
    model, a = toy(neurons=24, top_k=24, experts=1)
    x = torch.randn(2, 5, D)
    w = torch.randn(2, 5, D)
    out, xm = run_meft(model, x, w)
    ref, xr, k, v = dense_reference(model, a, x)
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xm.grad, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.store.grad_keys, k.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.store.grad_values, v.grad, rtol=1e-5, atol=1e-5)


def test_sparse_top_k_grads_zero_outside_union_and_match_masked_dense():
    model, a = toy(neurons=64, top_k=3, experts=1, buffer_size=64)
    x = torch.randn(1, 4, D)
    w = torch.randn(1, 4, D)
    out, xm = run_meft(model, x, w)
    scores = x.reshape(-1, D) @ a.store.keys.T
    top = scores.topk(3, dim=1).indices
    mask = torch.zeros_like(scores).scatter_(1, top, 1.0)
    ref, xr, k, v = dense_reference(model, a, x, mask=mask)
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xm.grad, xr.grad, rtol=1e-5, atol=1e-5)
    touched = torch.zeros(64, dtype=torch.bool)
    touched[top.unique()] = True
    assert torch.equal(a.store.touched, touched)
    assert touched.sum() < 64
    assert torch.all(a.store.grad_keys[~touched] == 0) and torch.all(a.store.grad_values[~touched] == 0)
    torch.testing.assert_close(a.store.grad_keys[touched], k.grad[touched], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.store.grad_values[touched], v.grad[touched], rtol=1e-5, atol=1e-5)
    assert k.grad[touched].abs().sum() > 0


def test_buffer_cap_keeps_most_selected_neurons_and_device_buffers_stay_fixed():
    neurons = torch.tensor([[0, 1, 2], [0, 1, 3], [0, 4, 5], [6, 1, -1]])
    union = batch_union(neurons, cap=2)
    assert union.rows.tolist() == [0, 1]  # 0 and 1 are chosen by three tokens each
    assert union.dropped == 5  # (2), (3), (4), (5), (6) lose their slot
    assert union.local.tolist() == [[0, 1, 2], [0, 1, 2], [0, 2, 2], [2, 1, 2]]
    model, a = toy(neurons=64, top_k=8, experts=1, buffer_size=10)
    out, _ = run_meft(model, torch.randn(3, 7, D), torch.ones(3, 7, D))
    assert a.last_stats.union == 10 and a.last_stats.dropped > 0
    assert tuple(a.transfer.buf_keys.shape) == (10, D) == tuple(a.transfer.buf_values.shape)
    assert int(a.store.touched.sum()) == 10


def test_key_experts_scores_fewer_keys_and_matches_naive_search():
    torch.manual_seed(1)
    x, keys = torch.randn(12, D), torch.randn(100, D)
    experts = torch.stack([torch.randperm(10)[:3] for _ in range(12)])  # 10 experts of 10, probe 3
    sel = key_experts_topk(x, keys, experts, expert_size=10, k=5)
    brute = brute_force_topk(x, keys, 5)
    assert sel.keys_scored == 12 * 3 * 10 < brute.keys_scored == 12 * 100
    for t in range(12):
        cand = torch.cat([torch.arange(e * 10, e * 10 + 10) for e in experts[t].tolist()])
        expect = cand[(keys[cand] @ x[t]).topk(5).indices]
        assert set(sel.neurons[t].tolist()) == set(expect.tolist())
    all_probed = key_experts_topk(x, keys, torch.arange(10).repeat(12, 1), expert_size=10, k=5)
    assert torch.equal(all_probed.neurons.sort(1).values, brute.neurons.sort(1).values)


def test_router_is_trained_through_the_gate_and_counts_scored_keys():
    model, a = toy(neurons=64, top_k=4, experts=8, n_probe=2, buffer_size=64)
    assert a.router is not None and a.router.weight.shape == (8, D)
    run_meft(model, torch.randn(2, 6, D), torch.randn(2, 6, D))
    assert a.last_stats.keys_scored == 12 * 2 * 8 < 12 * 64
    assert a.router.weight.grad is not None and a.router.weight.grad.abs().sum() > 0
    before = a.router.weight.detach().clone()
    build_meft_optimizer(model, lr=1e-2).step()
    assert not torch.equal(before, a.router.weight.detach())


@pytest.mark.parametrize("experts,n_probe", [(1, 1), (8, 2)])
def test_bytes_counted_equal_formula(experts, n_probe):
    model, a = toy(neurons=64, top_k=4, experts=experts, n_probe=n_probe, buffer_size=32)
    b, s = 2, 6
    n = b * s
    run_meft(model, torch.randn(b, s, D), torch.randn(b, s, D))
    u = a.last_stats.union
    f32, i64, i32 = 4, 8, 4
    # forward: hidden states down, key rows + value rows up, the per-token slot map up;
    # router: probed expert ids down, union row ids up. backward: slice gradients down.
    d2h = n * D * f32 + 2 * u * D * f32
    h2d = 2 * u * D * f32 + n * 4 * i32
    if experts > 1:
        d2h += n * n_probe * i64
        h2d += u * i64
    assert traffic(model, "current") == {"h2d": h2d, "d2h": d2h, "keys_scored": a.last_stats.keys_scored,
                                         "dropped": a.last_stats.dropped}
    opt = build_meft_optimizer(model)
    opt.step()
    assert traffic(model)["h2d"] == h2d and traffic(model, "current")["h2d"] == 0


def test_lazy_adam_leaves_untouched_rows_and_accumulates_micro_batches():
    model, a = toy(neurons=64, top_k=2, experts=1, buffer_size=64)
    opt = build_meft_optimizer(model, lr=0.1, weight_decay=0.1)
    x1, x2 = torch.randn(1, 2, D), torch.randn(1, 2, D)
    run_meft(model, x1, torch.ones(1, 2, D))
    g_one = a.store.grad_keys.clone()
    run_meft(model, x2, torch.ones(1, 2, D))  # gradient accumulation: adds into the CPU gradients
    touched = a.store.touched.clone()
    keys_before = a.store.keys.clone()
    assert not torch.equal(g_one, a.store.grad_keys) or touched.sum() > 0
    opt.step()
    assert torch.equal(a.store.keys[~touched], keys_before[~touched])  # not decayed either
    assert not torch.equal(a.store.keys[touched], keys_before[touched])
    st = opt.state[a.store.keys]
    assert torch.all(st["row_step"][touched] == 1) and torch.all(st["row_step"][~touched] == 0)
    assert torch.all(st["exp_avg"][~touched] == 0)
    assert int(a.store.touched.sum()) == 0 and float(a.store.grad_keys.abs().sum()) == 0.0
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert all(g["lr"] == pytest.approx(0.05) for g in opt.param_groups)
    del sched


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="top_k=9 exceeds meft.neurons=8"):
        MeftConfig(neurons=8, top_k=9)
    with pytest.raises(ConfigError, match="buffer_size"):
        MeftConfig(neurons=64, top_k=8, buffer_size=4)
    with pytest.raises(ConfigError, match="matches no module"):
        add_meft(Toy(), MeftConfig(neurons=8, top_k=2, target="nope"))
    cfg = MeftConfig(neurons=16384, top_k=64)
    assert (cfg.num_experts, cfg.expert_size, cfg.probes, cfg.buffer_rows) == (128, 128, 8, 4096)


def test_device_memory_is_bounded_by_the_buffer_not_by_neurons():
    from memfit.meft import meft_state

    sizes = []
    for neurons in (64, 1024):
        model, _ = toy(neurons=neurons, top_k=4, experts=1, buffer_size=16)
        run_meft(model, torch.randn(2, 8, D), torch.ones(2, 8, D))
        state = meft_state(model)
        sizes.append((state["device_bytes"], state["cpu_bytes"]))
    assert sizes[0][0] == sizes[1][0] == 2 * 16 * D * 4  # two fixed fp32 buffers of 16 rows
    assert sizes[1][1] > 10 * sizes[0][1]  # the CPU store grows with neurons instead


def test_clipping_scales_cpu_and_router_grads_and_non_finite_steps_are_skipped():
    model, a = toy(neurons=64, top_k=4, experts=8, n_probe=2, buffer_size=64)
    run_meft(model, torch.randn(2, 6, D), 100 * torch.randn(2, 6, D))
    rows = a.store.touched_rows()
    g = torch.cat([a.store.grad_keys[rows].flatten(), a.store.grad_values[rows].flatten(),
                   a.router.weight.grad.flatten()])
    norm = float(g.double().norm())
    opt = build_meft_optimizer(model, lr=0.1, max_grad_norm=1.0)
    assert opt._check_and_clip() and opt.last_grad_norm == pytest.approx(norm, rel=1e-6) and norm > 1.0
    g2 = torch.cat([a.store.grad_keys[rows].flatten(), a.store.grad_values[rows].flatten(),
                    a.router.weight.grad.flatten()])
    assert float(g2.double().norm()) == pytest.approx(1.0, rel=1e-4)
    keys = a.store.keys.clone()
    a.store.grad_keys[rows[0], 0] = float("inf")
    opt.step()
    assert opt.skipped_steps == 1 and torch.equal(a.store.keys, keys)  # nothing applied
    assert int(a.store.touched.sum()) == 0 and a.router.weight.grad is None  # gradients discarded


def test_config_from_the_run_files_strategy_keys():
    from memfit.spec.strategy import Strategy

    cfg = MeftConfig.from_strategy(Strategy(method="meft", meft_neurons=512, meft_top_k=16, meft_experts=8,
                                            meft_n_probe=2), buffer_size=64)
    assert (cfg.neurons, cfg.top_k, cfg.num_experts, cfg.probes, cfg.buffer_rows) == (512, 16, 8, 2, 64)
    assert MeftConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown field"):
        MeftConfig.from_dict({"neurons": 8, "top_k": 2, "bogus": 1})
