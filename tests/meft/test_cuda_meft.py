"""MEFT's copy stream (memfit.meft.transfer) on a CPU through the torch.cuda stand-in (tests/cuda_fakes.py)."""

from __future__ import annotations

import torch
from torch import nn

from memfit.meft import MeftConfig, add_meft, adapters
from memfit.meft.transfer import Traffic, Transfer
from cuda_fakes import FakeStream, cuda_tensors_on_cpu, fake_cuda  # noqa: F401


# --------------------------------------------------------------------------- MEFT's copy stream
class _Store:
    def __init__(self) -> None:
        self.got: list = []

    def accumulate(self, rows, gkeys, gvalues) -> None:
        self.got.append((rows.clone(), gkeys.clone(), gvalues.clone()))


def test_meft_transfer_on_cuda_copies_on_its_stream(cuda_tensors_on_cpu):
    cuda, traffic = cuda_tensors_on_cpu, Traffic()
    tr = Transfer(8, 4, torch.device("cuda"), torch.float32, traffic, pin=True)
    assert tr.cuda and tr.pin and isinstance(tr.stream, FakeStream) and str(tr.stream.device) == "cuda"
    assert cuda.calls.count(("zeros on cuda", None)) == 2  # the fixed device buffers
    assert cuda.calls.count(("pin_memory", "zeros")) == 4  # the four staging buffers, pinned
    stream = tr.stream

    # rows of the CPU tables into the device buffers, on the copy stream, the compute stream told to wait
    keys, values = torch.arange(40.0).reshape(10, 4), -torch.arange(40.0).reshape(10, 4)
    rows = torch.tensor([7, 2, 5])
    cuda.calls.clear()
    assert tr.load_rows(keys, values, rows) == 1
    assert torch.equal(tr.buf_keys[:3], keys[rows]) and torch.equal(tr.buf_values[:3], values[rows])
    assert traffic.current["h2d"] == 2 * 3 * 4 * 4
    done = tr._h2d_done
    assert done.recorded_on is stream
    assert ("event", done) in cuda.default.waited  # compute waits for the copy
    assert stream.waited and stream.waited[0][1].recorded_on is cuda.default  # the copy waits for compute
    assert cuda.names()[:3] == ["current_stream", "event.record", "stream.enter"]
    tr.load_rows(keys, values, torch.tensor([1]))
    assert done.synchronized == 1  # the staging is rewritten only after the last copy out of it finished

    # device -> host: a pinned host tensor and an event to wait on
    x = torch.randn(3, 4)
    cuda.calls.clear()
    host, event = tr.to_host(x)
    assert torch.equal(host, x) and event.recorded_on is stream
    assert ("record_stream", "side") in cuda.calls and ("pin_memory", "empty") in cuda.calls
    Transfer.wait_host(event)
    assert event.synchronized == 1
    assert traffic.current["d2h"] == x.numel() * 4

    # host -> device (indices): pinned, copied on the stream, handed to the compute stream
    idx = torch.tensor([0, 2, 1])
    cuda.calls.clear()
    out = tr.to_device(idx)
    assert torch.equal(out, idx)
    assert ("pin_memory", "tensor") in cuda.calls and ("to cuda", True) in cuda.calls
    assert ("stream", stream) in cuda.default.waited and ("record_stream", "default") in cuda.calls

    # gradients: copied on the stream now, scattered into the store only at the next flush
    store, gk, gv = _Store(), torch.randn(2, 4), torch.randn(2, 4)
    tr.push_grads(store, torch.tensor([3, 1]), gk, gv)
    assert store.got == []
    pending = tr._pending[0]
    assert pending.recorded_on is stream and pending.synchronized == 0
    tr.flush()
    assert pending.synchronized == 1 and len(store.got) == 1
    r, k, v = store.got[0]
    assert torch.equal(r, torch.tensor([3, 1])) and torch.equal(k, gk) and torch.equal(v, gv)
    tr.flush()
    assert len(store.got) == 1  # nothing left in flight


def test_meft_layer_gradients_through_the_cuda_copy_path_equal_the_cpu_path(cuda_tensors_on_cpu):
    """A MEFT layer's forward and backward with its Transfer on the CUDA branch (the copy stream, events,
    deferred gradient scatter) give the CPU branch's output and gradients."""
    def run(cuda_branch: bool):
        torch.manual_seed(0)
        model = add_meft(nn.Sequential(nn.Linear(16, 16)), MeftConfig(target=r"^0$", neurons=32, top_k=8,
                                                                      init_keys_from_ffn=False))
        a = adapters(model)["0"]
        a.store.values.normal_(0.0, 0.5)
        x = torch.randn(2, 5, 16)
        model(x)  # makes the Transfer
        if cuda_branch:
            a.transfer.cuda = True
            a.transfer.stream = torch.cuda.Stream(device=a.transfer.device)
        out = model(x)
        out.square().sum().backward()
        a.transfer.flush()
        return out.detach(), a.store.grad_keys.clone(), a.store.grad_values.clone()
    fake_cuda = cuda_tensors_on_cpu
    ref = run(False)
    assert ("pin_memory", "zeros") in fake_cuda.calls  # with CUDA, MEFT pins its CPU store by default
    calls_before = len(fake_cuda.calls)
    got = run(True)
    assert len(fake_cuda.calls) > calls_before and "record_stream" in fake_cuda.names()
    for r, g in zip(ref, got):
        assert torch.allclose(r, g)
    assert ref[1].abs().sum() > 0 and ref[2].abs().sum() > 0  # the gradients did flow
