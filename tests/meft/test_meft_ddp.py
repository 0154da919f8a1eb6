"""MEFT under torch.distributed (gloo, 2 CPU processes): CPU gradients are averaged across ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from memfit.meft import MeftConfig, add_meft, adapters, build_meft_optimizer

D = 8


def _model():
    torch.manual_seed(0)
    model = add_meft(nn.Sequential(nn.Linear(D, D)), MeftConfig(neurons=32, top_k=4, experts=1,
                                                                target=r"^0$", init_keys_from_ffn=False))
    adapters(model)["0"].store.values.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    return model


def _inputs():
    return torch.randn(2, 3, D, generator=torch.Generator().manual_seed(7))


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = _model()
    opt = build_meft_optimizer(model, lr=0.1)
    model(_inputs()[rank:rank + 1]).square().sum().backward()  # each rank its half of the batch
    opt.step()
    torch.save(adapters(model)["0"].store.keys.clone(), os.path.join(out_dir, f"keys{rank}.pt"))
    # memfit's end of a launched process: barrier, destroy, and free the group (the optimizer imported
    # torch.distributed.nn after init_process_group; a bare destroy left gloo's threads running into
    # interpreter shutdown, the SIGABRT "terminate called without an active exception" of issue 25)
    from memfit.distributed.ranks import finish

    finish()


def test_ddp_ranks_average_cpu_grads_and_stay_identical(tmp_path):
    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    from memfit.distributed.launch import free_port

    port = free_port()  # so parallel test runs do not collide
    mp.spawn(_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    k0 = torch.load(tmp_path / "keys0.pt", weights_only=True)
    k1 = torch.load(tmp_path / "keys1.pt", weights_only=True)
    torch.testing.assert_close(k0, k1, rtol=0, atol=0)
    # one process on the whole batch with the mean of the two ranks' losses gives the same update
    model = _model()
    opt = build_meft_optimizer(model, lr=0.1)
    x = _inputs()
    ((model(x[0:1]).square().sum() + model(x[1:2]).square().sum()) / 2).backward()
    opt.step()
    torch.testing.assert_close(k0, adapters(model)["0"].store.keys, rtol=1e-5, atol=1e-6)
