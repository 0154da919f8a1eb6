"""``resolve(run)``: the one place a RunSpec becomes what the estimator and the rules read.

Every prediction of a run (the train summary, the pre-flight, ``memfit measure``, ``train --fallback``,
``plan --emit``, ``memfit launch``) comes from :func:`resolve`, so they all see the same pool:

- ``model``: the run's model (preset, folder, config.json or Hub id ``owner/name[@revision]``) as a
  :class:`~memfit.spec.model.ModelSpec`;
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
import os
from dataclasses import dataclass
from pathlib import Path

from memfit.errors import ConfigError
from memfit.spec.hardware import HardwareSpec, default_cpu_ram, parse_hardware
from memfit.spec.model import HubId, ModelSpec, hub_config_file, hub_id, resolve_model
from memfit.spec.run import RunSpec
from memfit.spec.strategy import Strategy


_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


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
    return estimate(r.model, r.hardware, r.strategy, profile=profile, distributed=run.distributed,
                    phases=run.phases)


def model_dir(name: str) -> Path | HubId:
    """A local model folder with weights, or a Hub id ``owner/name[@revision]`` that is not a local path
    (its config.json fetched now, so a gated or missing repository or no network is one line before
    anything loads; training loads its weights by id, as transformers does). Anything else is a clear
    ConfigError."""
    p = Path(name).expanduser()
    if p.is_file() and p.name == "config.json":
        p = p.parent
    if not p.is_dir():
        hub = hub_id(name)
        if hub is not None:
            hub_config_file(hub)
            return hub
        if p.is_file():
            hint = "it is a file, not a folder"
        elif os.sep not in name and not p.suffix:
            hint = "it looks like a preset name: presets hold architecture numbers only (for planning), no weights"
        else:
            hint = "no such folder"
        raise ConfigError(f"model: '{name}' is not a local model folder ({hint}); memfit train needs a "
                          "folder with config.json and weights (*.safetensors), e.g. one written by "
                          "save_pretrained, or a Hub id (owner/name), or run `memfit demo` for the embedded "
                          "tiny model")
    if not (p / "config.json").is_file():
        raise ConfigError(f"model: {p} has no config.json; give a Hugging Face model folder")
    if not any(next(p.glob(g), None) for g in _WEIGHT_GLOBS):
        raise ConfigError(f"model: {p} has a config.json but no weights (*.safetensors); memfit train "
                          "cannot start from a config alone (use `memfit plan` for planning only)")
    return p
