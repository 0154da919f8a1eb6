"""``resolve(run)``: the one place a RunSpec becomes what the estimator and the rules read.

Every prediction of a run (the train summary, the pre-flight, ``memfit measure``, ``train --fallback``,
``plan --emit``, ``memfit launch``) comes from :func:`resolve`, so they all see the same pool:

- ``model``: the run's model (preset, folder or config.json) as a :class:`~memfit.spec.model.ModelSpec`;
- ``hardware``: the run's ``hardware`` (a catalog pool or ``"local"``: this machine's device kind)
  laid out as the run launches it, ``distributed.nproc`` processes on each of ``distributed.nodes``
  nodes, one device per process. On the CPU device every process is one (pseudo-)device sharing the
  node's RAM, so ``local`` with ``nproc=2`` is a pool of two. A pool whose per-node count differs from
  ``nproc`` keeps its GPU kind; its assumed CPU RAM follows the catalog default unless ``cpu_ram`` was
  given;
- ``strategy``: the run's strategy;
- ``world``: processes over all nodes (``nproc × nodes``), the world size the estimator shards by.

Plain Python (spec only, no torch): a leaf that plan, engines, train and measure may all import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from memfit.spec.hardware import HardwareSpec, default_cpu_ram, parse_hardware
from memfit.spec.model import ModelSpec, resolve_model
from memfit.spec.run import RunSpec
from memfit.spec.strategy import Strategy


@dataclass(frozen=True)
class Resolved:
    model: ModelSpec
    hardware: HardwareSpec
    strategy: Strategy
    world: int


def run_hardware(run: RunSpec) -> HardwareSpec:
    """The run's pool with one device per launched process (``nproc`` per node × ``nodes``)."""
    hw = parse_hardware(run.hardware, cpu_ram=run.cpu_ram)
    d = run.distributed
    if (hw.gpus_per_node, hw.nodes) == (d.nproc, d.nodes):
        return hw
    ram = hw.cpu_ram_bytes
    if not hw.cpu_ram_given and not hw.gpu.is_cpu and hw.label != "local":
        ram = default_cpu_ram(hw.gpu, d.nproc)
    return dataclasses.replace(hw, gpus_per_node=d.nproc, nodes=d.nodes, cpu_ram_bytes=ram)


def resolve(run: RunSpec) -> Resolved:
    """(model, hardware, strategy, world) of ``run``; a ConfigError names an unreadable model/pool."""
    hardware = run_hardware(run)
    return Resolved(model=resolve_model(run.model), hardware=hardware, strategy=run.strategy,
                    world=hardware.world_size)


def predict(run: RunSpec, profile=None):
    """The estimator's :class:`~memfit.estimate.result.Estimate` for ``run`` as :func:`resolve` sees it."""
    from memfit.estimate import estimate

    r = resolve(run)
    return estimate(r.model, r.hardware, r.strategy, profile=profile)
