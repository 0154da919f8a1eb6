"""Where a sharded engine's step goes on this machine (docs/time.md "Sharded engines on a CPU").

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/studies/engine_probe.py cell 6
        # ZeRO-2 row of bench/time_grid.py
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/studies/engine_probe.py cell 7 --ops
        # FSDP2, + aten ops counted
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/studies/engine_probe.py collectives
        # gloo per-call times, 2 ranks

``cell N`` trains bench/time_grid.py's configuration N through memfit's measured worker (1 warm-up, 1
profiled, 5 timed steps) with the engines' functions wrapped: per timed step (median, rank 0) the wall,
the main thread's CPU time, and the main thread's CPU and wall inside DeepSpeed's gradient hooks and step,
FSDP2's four hooks, AdamW.step, clip_grad_norm_ and the collectives, and the collectives issued per step
(every call, FSDP2's ``all_gather_single`` / ``reduce_scatter_single`` included); ``--ops`` counts the aten ops issued
inside them (a TorchDispatchMode; slows the step). memfit's small-op cost (op_seconds) is measured before
and after, so ratios to it come from the same minutes. ``collectives``: per-call wall of gloo's
all-reduce / all-gather / reduce-scatter at ZeRO-2's and FSDP2's sizes, 60 calls each: min, median, mean.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

WRAPPED = {"deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer":
           ("step", "reduce_independent_p_g_buckets_and_remove_grads"),
           "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup":
           ("pre_forward", "post_forward", "pre_backward", "post_backward"),
           "torch.optim:AdamW": ("step",), "torch.nn.utils:clip_grad_norm_": (),
           "torch.distributed:all_reduce": (), "torch.distributed:all_gather_into_tensor": (),
           "torch.distributed:reduce_scatter_tensor": ()}
# every call of these is counted, also inside the wrapped functions (FSDP2 issues the *_single forms)
COUNTED = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
           "reduce_scatter_single")


def _count_collectives(calls: dict) -> None:
    """Count every call of COUNTED in torch.distributed, also those inside the wrapped functions."""
    import torch.distributed as dist

    for name in COUNTED:
        if hasattr(dist, name):
            def counted(*a, _f=getattr(dist, name), _n=name, **k):
                calls[_n] = calls.get(_n, 0) + 1
                return _f(*a, **k)
            setattr(dist, name, counted)


def _worker(spec: str, out: str, count_ops: bool) -> int:
    """In each rank: wrap the engines' functions (outermost call only), record per step, run memfit's worker."""
    import importlib

    from torch.utils._python_dispatch import TorchDispatchMode

    from memfit.measure import callback as C

    acc: dict = {}
    ops: dict = {}
    depth = [0]

    class Count(TorchDispatchMode):
        def __init__(self, key: str) -> None:
            super().__init__()
            self.key = key

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            d = ops.setdefault(self.key, {})
            d[func.overloadpacket.__name__] = d.get(func.overloadpacket.__name__, 0) + 1
            return func(*args, **(kwargs or {}))

    def wrap(owner, name: str, key: str) -> None:
        f = getattr(owner, name)

        def g(*a, **k):
            if depth[0]:
                return f(*a, **k)
            depth[0] += 1
            mode = Count(key) if count_ops else None
            if mode:
                mode.__enter__()
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                if mode:
                    mode.__exit__(None, None, None)
                depth[0] -= 1
                v = acc.setdefault(key, [0, 0.0, 0.0])
                v[0], v[1], v[2] = v[0] + 1, v[1] + time.thread_time() - c0, v[2] + time.perf_counter() - w0
        setattr(owner, name, g)

    for target, names in WRAPPED.items():
        mod, attr = target.split(":")
        try:
            obj = importlib.import_module(mod)
        except ImportError:
            continue
        if names:
            cls = getattr(obj, attr)
            for n in names:
                wrap(cls, n, f"{attr}.{n}")
        else:
            wrap(obj, attr, attr)
    calls: dict = {}
    _count_collectives(calls)
    rec: list = []
    start: dict = {}
    begin, end = C.ProbeCallback.on_step_begin, C.ProbeCallback.on_step_end

    def on_begin(self, args, state, control, **kw):
        r = begin(self, args, state, control, **kw)
        start.update(t=time.perf_counter(), c=time.thread_time(), acc=json.loads(json.dumps(acc)), calls=dict(calls))
        return r

    def on_end(self, args, state, control, **kw):
        r = end(self, args, state, control, **kw)
        parts = {k: [v[i] - start["acc"].get(k, [0, 0.0, 0.0])[i] for i in range(3)] for k, v in acc.items()}
        rec.append({"wall": time.perf_counter() - start["t"], "main_cpu": time.thread_time() - start["c"],
                    "parts": parts, "calls": {k: v - start["calls"].get(k, 0) for k, v in calls.items()}})
        if self._done:
            Path(out.format(rank=os.environ.get("RANK", "0"))).write_text(
                json.dumps({"steps": rec, "ops": ops, "all_steps": self.warmup + self.steps}))
        return r
    C.ProbeCallback.on_step_begin, C.ProbeCallback.on_step_end = on_begin, on_end
    from memfit.measure.worker import main
    return main([spec])


def _op_seconds() -> float:
    import torch

    from memfit.measure.kernels import Timer, op_seconds

    torch.set_num_threads(1)
    return statistics.median(op_seconds("cpu", Timer("cpu")) for _ in range(5))


def probe_cell(index: int, count_ops: bool) -> None:
    from bench import time_grid as tg
    from memfit.measure.probe import env_for_measurement

    tg._measuring_environment()
    models = tg.build_models(Path("/tmp/memfit-time-grid-models"))
    run = tg.make_run(tg.CELLS[index], models)
    work = Path(tempfile.mkdtemp(prefix="memfit-engine-probe-"))
    spec = {"run": run.model_dump(mode="json"), "warmup": 1, "steps": 6, "out": str(work / "rank{rank}.json"),
            "categories": False, "threads": 1}
    spec["run"]["strategy"]["lora_targets"] = list(run.strategy.lora_targets)
    (work / "spec.json").write_text(json.dumps(spec))
    out = str(work / "probe{rank}.json")
    before = _op_seconds()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(run.distributed.nproc),
           "--master-port", str(29600 + os.getpid() % 300), __file__, "worker", str(work / "spec.json"), out,
           "1" if count_ops else "0"]
    env = env_for_measurement()
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), env.get("PYTHONPATH", "")])
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    after = _op_seconds()
    d = json.loads(Path(out.format(rank=0)).read_text())
    steps = d["steps"][1:]  # the first recorded step is the profiled one
    med = statistics.median
    print(f"{tg.label(tg.CELLS[index])}: wall {med(s['wall'] for s in steps) * 1e3:.0f} ms, main-thread CPU "
          f"{med(s['main_cpu'] for s in steps) * 1e3:.0f} ms per step; op_seconds {before * 1e6:.1f} / "
          f"{after * 1e6:.1f} us before / after")
    names = sorted({k for st in steps for k in st["calls"]})
    print("  collectives per step: "
          + ", ".join(f"{k} {med(st['calls'].get(k, 0) for st in steps):.0f}" for k in names))
    for k in sorted({k for s in steps for k in s["parts"]}):
        v = [s["parts"].get(k, [0, 0.0, 0.0]) for s in steps]
        n_ops = sum(d["ops"].get(k, {}).values()) / d["all_steps"] if count_ops else None
        print(f"  {k:58s} calls {med(x[0] for x in v):4.0f}  CPU {med(x[1] for x in v) * 1e3:6.1f} ms  wall "
              f"{med(x[2] for x in v) * 1e3:6.1f} ms" + (f"  aten ops {n_ops:6.1f}" if n_ops is not None else ""))


def _collectives_rank() -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for numel in (256, 65536, 176128, 1 << 20):
        x, g, big, o2 = torch.randn(numel), torch.empty(2 * numel), torch.randn(2 * numel), torch.empty(numel)
        for name, fn in (("all_reduce", lambda: dist.all_reduce(x)),
                         ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(g, x)),
                         ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(o2, big))):
            dist.barrier()
            ts = []
            for _ in range(60):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            if dist.get_rank() == 0:
                ts.sort()
                print(f"{name:24s} {numel:8d} elements per rank: min {ts[0] * 1e3:5.2f}  median "
                      f"{ts[30] * 1e3:5.2f}  mean {statistics.mean(ts) * 1e3:5.2f} ms", flush=True)
    dist.destroy_process_group()


def main() -> int:
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "worker":
        return _worker(sys.argv[2], sys.argv[3], sys.argv[4] == "1")
    if what == "collectives-rank":
        _collectives_rank()
        return 0
    if what == "collectives":
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               "--master-port", str(29600 + os.getpid() % 300), __file__, "collectives-rank"],
                              stderr=subprocess.DEVNULL).returncode
    if what == "cell" and len(sys.argv) > 2:
        probe_cell(int(sys.argv[2]), "--ops" in sys.argv)
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
