"""#36 item 5, in one process: activation offloading (the hooks run, the bytes they pack, the same losses), DeepSpeed's
TiledMLP (same loss and gradients), torch context parallelism (refused on the CPU in one line; its config and
batches with the torch.cuda stand-ins of tests/cuda_fakes.py). Ulysses across 2 processes:
tests/distributed/test_sequence_parallel.py."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from cuda_fakes import cuda_tensors_on_cpu, fake_cuda  # noqa: E402,F401
from memfit.errors import IncompatibleError  # noqa: E402
from memfit.spec.run import run_from_dict  # noqa: E402
from memfit.train.api import train  # noqa: E402
from memfit.train.demo import make_dialogue_records, write_jsonl  # noqa: E402

SEQ = 64  # micro Llama: hidden 64, 2 layers; every text row is cut at SEQ tokens, so each batch is 2 x SEQ


@pytest.fixture(scope="module")
def texts(tmp_path_factory, tiny_model_dir):
    recs = make_dialogue_records(24, seed=2)
    model = tiny_model_dir("longctx", [r["dialogue"] + "\n" + r["summary"] for r in recs])
    root = tmp_path_factory.mktemp("longctx")
    data = write_jsonl([{"text": r["dialogue"] + "\n" + r["summary"] + "\n" + r["dialogue"]} for r in recs],
                       root / "text.jsonl")
    return model, data


def _run(texts, out, **strategy):
    model, data = texts
    return run_from_dict({
        "model": str(model), "output_dir": str(out),
        "data": {"path": str(data), "format": "text", "eval_fraction": 0.0},
        "strategy": {"method": "lora", "precision": "fp32", "seq_len": SEQ, "micro_batch_size": 2, "lora_r": 4,
                     "lora_alpha": 8, "lora_dropout": 0.0, **strategy},
        "training": {"max_steps": 2, "learning_rate": 1e-2, "seed": 0, "lr_scheduler": "constant"}})


def _offloaded(out: Path, key: str = "act_offload_bytes") -> list:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r.get(key) for r in rows if "loss" in r]


def test_activation_offload_hooks_run_count_the_bytes_and_keep_the_losses(texts, tmp_path):
    """checkpointed: each checkpointed layer's input goes through the offload hooks, layers x 2 x SEQ x hidden x 4 B
    a step, which is what the estimate puts in pinned host memory (Estimate.cpu["offloaded_activations"] on a GPU
    node, per process); all: every tensor saved outside the checkpoints too. Losses equal the run without."""
    from memfit.estimate import estimate
    from memfit.spec.hardware import parse_hardware
    from memfit.spec.model import resolve_model

    plain = train(_run(texts, tmp_path / "none", gradient_checkpointing=True))
    runs = {mode: _run(texts, tmp_path / mode, gradient_checkpointing=True, activation_offload=mode)
            for mode in ("checkpointed", "all")}
    results = {mode: train(run) for mode, run in runs.items()}
    layer_inputs = 2 * (2 * SEQ * 64 * 4)  # 2 layers, micro-batch 2, hidden 64, fp32
    counted = {mode: _offloaded(tmp_path / mode) for mode in runs}
    assert counted["checkpointed"] == [layer_inputs, layer_inputs], counted
    # all: + what autograd saves outside the checkpointed layers: the final norm's and the head's inputs, the head's
    # weight (a linear saves W^T for its input's gradient; save_on_cpu copies it too) and the loss's fp32 logits twice
    # (the cross-entropy's input and its log-softmax)
    vocab = json.loads((Path(texts[0]) / "config.json").read_text())["vocab_size"]  # the tokenizer's (490)
    head = 2 * (2 * SEQ * 64 * 4) + vocab * 64 * 4 + 2 * (2 * SEQ * vocab * 4)
    assert all(layer_inputs + 0.9 * head <= b <= layer_inputs + 1.1 * head for b in counted["all"]), counted
    assert _offloaded(tmp_path / "checkpointed", "act_offload_weight_bytes") == [0, 0]
    assert all(w >= 0.9 * vocab * 64 * 4 for w in _offloaded(tmp_path / "all", "act_offload_weight_bytes"))
    for r in results.values():
        assert [loss for _, loss in r.losses] == [loss for _, loss in plain.losses]
    assert any("no device to leave" in n for n in results["checkpointed"].notes)
    hw = parse_hardware("1xH100-80GB")
    est = estimate(resolve_model(str(texts[0])), hw, runs["checkpointed"].strategy)
    per_process = est.cpu["offloaded_activations"] / hw.gpus_per_node
    assert abs(per_process - layer_inputs) <= 0.05 * layer_inputs, (per_process, layer_inputs)


def test_offload_hooks_pin_on_cuda_and_give_the_same_gradients(cuda_tensors_on_cpu, tiny_llama):  # noqa: F811
    """On CUDA the hooks pack into pinned buffers (torch's save_on_cpu), recorded by the stand-in; what backward
    gets back is what the forward saved. transformers' own offload=True path (memfit's CUDA path) runs too."""
    from memfit.train.longctx import OffloadCount, offload_checkpointed, offload_hooks

    ids = torch.randint(0, 100, (2, 32))

    def grads(model, ctx=None):
        model.train()
        model.zero_grad()
        if ctx is None:
            model(input_ids=ids, labels=ids).loss.backward()
        else:
            with ctx:
                model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    count = OffloadCount()
    ref = grads(tiny_llama(vocab_size=100))
    got = grads(tiny_llama(vocab_size=100), offload_hooks(count, pin_memory=True))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    pinned = [c for c in cuda_tensors_on_cpu.calls if c == ("pin_memory", "empty")]
    assert count.tensors > 0 and len(pinned) == count.tensors and count.unpacked > 0
    model = tiny_llama(vocab_size=100)
    model.activation_checkpointing_enable({"use_reentrant": False})
    before = len(cuda_tensors_on_cpu.calls)
    assert offload_checkpointed(model, OffloadCount(), cuda=True) == 0  # transformers' own path on "CUDA"
    got = grads(model)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(ref, got))
    pinned = [c for c in cuda_tensors_on_cpu.calls[before:] if c[0] == "pin_memory"]
    assert len(pinned) >= 2  # each checkpointed layer's input


def test_tiled_mlp_gives_the_same_loss_and_gradients(tiny_llama, monkeypatch):
    """DeepSpeed's TiledMLP on every decoder layer's mlp: ceil(seq / hidden) tiles, the same loss and gradients."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    from memfit.train.longctx import install_tiled_mlp

    tiles = []
    original = TiledMLP.forward

    def spy(ctx, fn, self, x, shards, compute_params):
        tiles.append(shards)
        return original(ctx, fn, self, x, shards, compute_params)

    monkeypatch.setattr(TiledMLP, "forward", staticmethod(spy))
    ids = torch.randint(0, 100, (2, 160))

    def run(model):
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    ref_loss, ref = run(tiny_llama(vocab_size=100))
    model = tiny_llama(vocab_size=100)
    assert install_tiled_mlp(model) == 2
    loss, got = run(model)
    assert tiles == [3, 3]  # 160 tokens / hidden 64, per layer
    assert torch.allclose(loss, ref_loss, rtol=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ref, got))


def test_tiled_mlp_trains_under_zero_with_the_same_losses(texts, tmp_path, monkeypatch):
    """Under ZeRO-1 (its gradient hooks told by ds_grad_is_ready when the last tile's gradient is in), rows of
    up to 128 tokens: 2 tiles of the hidden size 64 per layer."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    tiles = []
    original = TiledMLP.forward
    monkeypatch.setattr(TiledMLP, "forward", staticmethod(lambda ctx, fn, self, x, shards, params: (
        tiles.append(shards), original(ctx, fn, self, x, shards, params))[1]))
    import os

    from conftest import release_process_group

    env = dict(os.environ)
    try:  # DeepSpeed in this process: its one-rank group and rendezvous variables must not outlive the test
        plain = train(_run(texts, tmp_path / "z1", zero_stage=1, seq_len=128))
        tiled = train(_run(texts, tmp_path / "z1-tiled", zero_stage=1, seq_len=128, tiled_mlp=True))
    finally:
        release_process_group(env)
    assert tiles and max(tiles) == 2, tiles
    assert [loss for _, loss in tiled.losses] == pytest.approx([loss for _, loss in plain.losses], rel=1e-6)


def test_context_parallel_is_refused_on_the_cpu_in_one_line(texts, tmp_path):
    run = _run(texts, tmp_path / "cp", fsdp="full_shard", context_parallel=2, seq_len=SEQ)
    with pytest.raises(IncompatibleError) as err:
        train(run)
    line = str(err.value)
    assert "\n" not in line and "context_parallel=2: torch intercepts only the CUDA flash / memory-efficient " \
        "attention kernels" in line, line
    assert not (tmp_path / "cp" / "metrics.jsonl").exists()


def test_context_parallel_config_and_batches_on_cuda(fake_cuda, texts, tmp_path):  # noqa: F811
    """What train hands accelerate for CP on CUDA (the stand-in answers torch.cuda): ParallelismConfig(cp_size=N)
    beside FSDP2's shard dimension; batches of position_ids, no padding mask, a width divisible by 2N."""
    from memfit.distributed.parallelism import context_config
    from memfit.train.trainer import collator

    run = _run(texts, tmp_path / "cp", fsdp="full_shard", context_parallel=2)
    pc = context_config(run, world=4)
    assert (pc.cp_size, pc.dp_shard_size, pc.cp_backend, pc.cp_enabled) == (2, 2, "torch", True)
    batch = collator(run, None)([{"input_ids": [5] * 9, "labels": [5] * 9}, {"input_ids": [6] * 3, "labels": [6] * 3}])
    assert batch["input_ids"].shape == (2, 12) and "attention_mask" not in batch
    assert batch["position_ids"][1].tolist() == list(range(12)) and batch["labels"][1, 3:].eq(-100).all()


def test_ulysses_batches_and_refusals(texts, tmp_path):
    """Ulysses' batches: position_ids, no mask, padded to seq_len on the CPU (gloo's equal gather shapes); packing
    under sdpa refused (Ulysses drops the mask)."""
    from memfit.distributed.parallelism import reasons
    from memfit.train.trainer import collator

    run = _run(texts, tmp_path / "sp", zero_stage=1, sequence_parallel=2)
    batch = collator(run, None)([{"input_ids": [5] * 9, "labels": [5] * 9}])
    assert batch["input_ids"].shape == (1, SEQ) and "attention_mask" not in batch
    assert reasons(run) == []
    packed = run.model_copy(update={"data": run.data.model_copy(update={"packing": True})})
    assert reasons(packed)[0].startswith("sequence_parallel=2 with data.packing and attention=sdpa: Ulysses drops")


def test_liger_is_refused_on_the_cpu_in_one_line(texts, tmp_path):
    run = _run(texts, tmp_path / "liger", liger=True)
    with pytest.raises(IncompatibleError) as err:
        train(run)
    line = str(err.value)
    assert "\n" not in line and "liger=true: Liger Kernel's kernels are Triton kernels for GPUs; the CPU device " \
        "cannot run them (estimate it for a GPU pool, or set liger=false)" in line, line
    assert not (tmp_path / "liger").exists() or not any((tmp_path / "liger").iterdir())


def test_liger_training_arguments_on_cuda(monkeypatch, texts, tmp_path):
    """What train hands the Trainer for liger: true (its use_liger_kernel applies the kernels); Liger's SwiGLU off
    under the tiled MLP, whose forward memfit patches; without the package, one line."""
    import importlib.util

    from memfit.train import trainer as T

    run = _run(texts, tmp_path / "l", liger=True, tiled_mlp=True, zero_stage=1)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "liger_kernel"
                        else real(name, *a))
    kw = T.liger_kwargs(run.strategy)
    assert kw == {"use_liger_kernel": True, "liger_kernel_config": {
        "rope": True, "rms_norm": True, "swiglu": False, "cross_entropy": False, "fused_linear_cross_entropy": True}}
    assert run.strategy.loss == "chunked"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel"
                        else real(name, *a))
    with pytest.raises(IncompatibleError, match="^strategy.liger=true needs the liger-kernel package"):
        T.liger_kwargs(run.strategy)
