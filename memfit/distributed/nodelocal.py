"""One output folder for the whole job, or one per node (node-local disks): who completes a checkpoint where.

A shared folder (one machine, or a network file system) is written as on one node: every rank writes its
part of a checkpoint under ``.staging/``, rank 0 renames it into place once all have. With a folder per
node (``--set output_dir=...`` on each node, or the same path on each node's own disk), each node's first
process is that folder's *leader*: it writes the trainer's files there too (``save_on_each_node``), gets
the few files only rank 0 writes that every rank needs to resume (DeepSpeed's ``latest`` tag and ZeRO-1/2
model states: :data:`COMMON`) sent from rank 0, and renames
its node's checkpoint into place. ``--resume`` then starts from the newest checkpoint complete in every
rank's folder. FSDP's sharded checkpoints (torch.distributed.checkpoint) cannot be split that way: a
rank reads items other ranks wrote (replicated ones are saved once), so FSDP needs a shared folder.

Which case holds is found, not configured: rank 0 leaves a token file in its folder and every rank looks
for it in its own (:func:`folder_roles`, collective). torch is imported inside the functions.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

TOKEN_PREFIX = ".memfit-node-token-"
# files rank 0 alone writes into a checkpoint that every rank reads back on resume (relative patterns)
COMMON = ("latest", "global_step*/mp_rank_00_model_states.pt")


@dataclass(frozen=True)
class FolderRoles:
    shared: bool = True         # this rank's output folder is rank 0's
    leader: bool = False        # this rank completes checkpoints in its folder (rank 0, or a node's first)
    node_local: bool = False    # some rank writes to a folder of its own (any rank: the same on all)


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def folder_roles(out: Path) -> FolderRoles:
    """Which ranks share rank 0's folder, and who leads each other one (collective where a group is up)."""
    from memfit.distributed.ranks import this_process

    dist = _dist()
    me = this_process()
    if dist is None or dist.get_world_size() == 1:
        return FolderRoles(shared=True, leader=True, node_local=False)
    token = [TOKEN_PREFIX + uuid.uuid4().hex if me["rank"] == 0 else None]
    mark = Path(out) / str(token[0])
    if me["rank"] == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        mark.touch()
    dist.broadcast_object_list(token, src=0)
    # a directory listing, not a lookup: a network file system may cache "no such file" for a while
    shared = Path(out).is_dir() and token[0] in os.listdir(out)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {**me, "shared": shared})
    if me["rank"] == 0:
        mark.unlink(missing_ok=True)
    own = [p for p in everyone if not p["shared"] and p["node_rank"] == me["node_rank"]]
    leader = me["rank"] == 0 or (not shared and min(p["rank"] for p in own) == me["rank"])
    return FolderRoles(shared=shared, leader=leader, node_local=any(not p["shared"] for p in everyone))


def share_common_files(staged: Path, roles: FolderRoles) -> None:
    """After every rank wrote its part of ``staged`` (a checkpoint being written): rank 0 sends the
    :data:`COMMON` files of its copy; the leader of each node-local folder writes those it lacks."""
    dist = _dist()
    if dist is None or not roles.node_local:
        return
    files: list = [None]
    if dist.get_rank() == 0:
        found = {str(p.relative_to(staged)): p.read_bytes()
                 for pattern in COMMON for p in sorted(Path(staged).glob(pattern)) if p.is_file()}
        files = [found]
    dist.broadcast_object_list(files, src=0)
    if roles.shared or not roles.leader:
        return
    from memfit.io import write_bytes

    for rel, data in files[0].items():
        dst = Path(staged) / rel
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            write_bytes(dst, data)


def agree_step(steps: list[int]) -> Optional[int]:
    """``--resume``: the newest checkpoint step that every rank holds complete in its own folder
    (collective; ``steps``: this rank's). A node that died after the others renamed their copy makes
    the job fall back to the one before. None when no step is common (the caller says what to do)."""
    dist = _dist()
    if dist is None:
        return max(steps, default=None)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(steps))
    common = set.intersection(*(set(s) for s in everyone))
    return max(common, default=None)
