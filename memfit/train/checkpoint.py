"""Atomic checkpoints and resume.

The Trainer writes ``checkpoint-N`` file by file; a run killed half-way would leave a folder that looks
like a checkpoint. Here every checkpoint is written under ``OUT/.staging/`` and renamed into place only
once complete, so any ``OUT/checkpoint-N`` is whole. Final outputs (adapter / model folders) are written
the same way.
"""

from __future__ import annotations

import os
import shutil

from pathlib import Path
from typing import Optional

from memfit.errors import MemfitError
from memfit.io import WriteError, atomic_dir, reason, replace_dir  # noqa: F401 - atomic_dir re-exported

STAGING = ".staging"
PREFIX = "checkpoint-"


def _is_main() -> bool:
    from memfit.distributed.ranks import is_main_process

    return is_main_process()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_write_failure(err: BaseException) -> bool:
    """An OS write failure, also as torch.save reports it (a RuntimeError from its zip writer)."""
    if isinstance(err, OSError):
        return True
    text = str(err).lower()
    return "no space left" in text or "file write failed" in text or "unexpected pos" in text


def _why(err: BaseException) -> str:
    if isinstance(err, OSError):
        return reason(err)
    return "no space left on device" if "space" in str(err).lower() else str(err).splitlines()[0][:160]


class AtomicCheckpointMixin:
    """Mix into ``transformers.Trainer``: checkpoints are staged and renamed into place when complete."""

    _memfit_staging = False

    def _get_output_dir(self, trial):  # noqa: D401 - Trainer hook
        out = super()._get_output_dir(trial)
        return os.path.join(out, STAGING) if self._memfit_staging else out

    def _save_checkpoint(self, model, trial):
        run_dir = Path(super()._get_output_dir(trial))
        name = f"{PREFIX}{self.state.global_step}"
        staged = run_dir / STAGING / name
        leader = self._memfit_leader()
        if leader and staged.exists():
            shutil.rmtree(staged)
        _barrier()
        self._memfit_staging = True
        try:
            super()._save_checkpoint(model, trial)
        except (OSError, RuntimeError) as err:
            if not _is_write_failure(err):
                raise
            shutil.rmtree(run_dir / STAGING, ignore_errors=True)  # no half-written checkpoint left
            found = checkpoints(run_dir)
            kept = f"the last checkpoint {found[-1]} is kept" if found else "no earlier checkpoint exists"
            raise WriteError(f"cannot write checkpoint {name} in {run_dir}: {_why(err)}; {kept} "
                             "(free space, then continue with --resume)") from None
        finally:
            self._memfit_staging = False
        _barrier()  # every rank has written its part
        roles = getattr(self, "_memfit_roles", None)
        if roles is not None:  # node-local folders: rank 0's tag / metadata files to each node's copy
            from memfit.distributed.nodelocal import share_common_files

            share_common_files(staged, roles)
        if leader:
            replace_dir(staged, run_dir / name)
            shutil.rmtree(run_dir / STAGING, ignore_errors=True)
            rotate(run_dir, self.args.save_total_limit)
        _barrier()

    def _memfit_leader(self) -> bool:
        """Whether this process completes checkpoints in its folder: rank 0 in a shared folder, each
        node's first process in a folder of its own (memfit.distributed.nodelocal)."""
        roles = getattr(self, "_memfit_roles", None)
        return roles.leader if roles is not None else self.args.should_save


def prepare_folders(trainer, run, out: Path, ckpt: Optional[Path]) -> Optional[Path]:
    """Collective, once the process group is up: find whether the ranks share ``out`` (see
    memfit.distributed.nodelocal); a node-local folder's leader saves the trainer's files there too and
    gets run.yaml. Returns the checkpoint to resume from: the newest one complete in every rank's folder."""
    from memfit.distributed.nodelocal import agree_step, folder_roles

    roles = folder_roles(out)
    trainer._memfit_roles = roles
    if roles.node_local and run.strategy.fsdp and run.training.checkpoint_interval > 0:
        raise MemfitError(f"output_dir {out}: FSDP with one output folder per node cannot resume: its sharded "
                          "checkpoint (torch.distributed.checkpoint) reads other ranks' files; give every "
                          "node the same shared output_dir, or set training.checkpoint_interval=0")
    if roles.leader and not roles.shared:
        from memfit.io import make_dir
        from memfit.spec.run import save_run

        make_dir(Path(out), "output_dir")
        trainer.args.save_on_each_node = True  # should_save: this node's first process
        shutil.rmtree(Path(out) / STAGING, ignore_errors=True)
        save_run(run, Path(out) / "run.yaml")
    if ckpt is None or not roles.node_local:
        return ckpt
    step = agree_step([int(p.name[len(PREFIX):]) for p in checkpoints(out)])
    if step is None:
        raise MemfitError(f"--resume: no checkpoint is complete in every node's output folder ({out} here); "
                          "copy the newest checkpoint-N folder to every node, or start anew with --overwrite")
    return Path(out) / f"{PREFIX}{step}"


def checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoints in ``out_dir``, oldest first."""
    out_dir = Path(out_dir)
    found = []
    for p in out_dir.glob(f"{PREFIX}*"):
        step = p.name[len(PREFIX):]
        if p.is_dir() and step.isdigit() and (p / "trainer_state.json").is_file():
            found.append((int(step), p))
    return [p for _, p in sorted(found)]


def rotate(out_dir: Path, keep: Optional[int]) -> None:
    if not keep:
        return
    for p in checkpoints(out_dir)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(out_dir: Path) -> Path:
    """The newest complete checkpoint, or a MemfitError saying there is none."""
    found = checkpoints(out_dir)
    if not found:
        raise MemfitError(f"--resume: no complete checkpoint in {out_dir} (set "
                          "training.checkpoint_interval to write some, or run without --resume)")
    return found[-1]


def clean_staging(out_dir: Path) -> None:
    """Remove what a killed run left half-written (only on the main process)."""
    if not _is_main():
        return
    out_dir = Path(out_dir)
    shutil.rmtree(out_dir / STAGING, ignore_errors=True)
    for p in out_dir.glob(".*.tmp-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in out_dir.glob(".memfit-node-token-*"):  # a folder check cut short (memfit.distributed.nodelocal)
        p.unlink(missing_ok=True)
