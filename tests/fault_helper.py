"""What the multi-process fault tests share: memfit started as a user starts it (``memfit launch``, ``memfit
train --nproc N``, one ``memfit launch`` per node rank), the one failure line it prints, the losses a run
logged, and whether its processes and port are gone."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

TIMEOUT = 900  # a test's own limit on one command (the cases' bounds are asserted separately)


def clean_env(**extra) -> dict:
    """This environment without a launcher's variables or a drill (unless given), one thread per process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", MEMFIT_QUIET="1",
               PYTHONFAULTHANDLER="1", **extra)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MEMFIT_FAULT_DRILL"):
        if key not in extra:
            env.pop(key, None)
    return env


def memfit(*args, drill: str | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """``python -m memfit ARGS`` to its end: (the finished process, seconds it took)."""
    env = clean_env(**({"MEMFIT_FAULT_DRILL": drill} if drill else {}))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "memfit", *map(str, args)], env=env, capture_output=True,
                       text=True, timeout=TIMEOUT)
    return p, time.monotonic() - t0


def sets(items) -> list[str]:
    """``--set`` before each override."""
    return [a for s in items for a in ("--set", s)]


def launch_nodes(run_file: Path, overrides: list[str], *, nodes: int = 2, resume: bool = False,
                 per_node_sets=None, env=None) -> list[subprocess.CompletedProcess]:
    """``memfit launch`` once per node rank, all at once, as on a cluster (one shell per node)."""
    from memfit.distributed.launch import free_port

    port = free_port()
    procs = []
    for rank in range(nodes):
        cmd = [sys.executable, "-m", "memfit", "launch", str(run_file), "--nodes", str(nodes), "--node-rank",
               str(rank), "--nproc", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
               "--single-host", *sets([*overrides, *(per_node_sets(rank) if per_node_sets else [])])]
        if resume:
            cmd.append("--resume")
        procs.append(subprocess.Popen(cmd, env={**clean_env(), **(env or {})}, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    done = []
    for p in procs:
        out, err = p.communicate(timeout=TIMEOUT)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def cause_lines(stderr: str) -> list[str]:
    """The launcher's failure line(s): ``error: ...`` that say how to resume."""
    return [ln for ln in stderr.splitlines() if ln.startswith("error: ") and "--resume" in ln]


def losses(out: Path) -> dict[int, float]:
    """{step: loss} of a run's metrics.jsonl."""
    rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def port_free(port: int) -> bool:
    """Whether a new listener could take ``port`` (as torchrun's store would: SO_REUSEADDR, so a closed
    connection's TIME_WAIT does not count; a process still listening does)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (read from /proc; torchrun's workers sit in sessions of their own)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting to be reaped counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def fault_run(tmp_path_factory, tiny_model_dir, name: str, timeout_s: int) -> tuple[Path, dict]:
    """(folder, run dict) of the fault tests: the tiny LoRA run, 4 steps, a checkpoint every 2, 2 processes,
    ``distributed.timeout_s`` as given."""
    from conftest import lora_dialogue_run

    root = tmp_path_factory.mktemp(name)
    return root, {**lora_dialogue_run(root, tiny_model_dir, "multinode", records=32, seq_len=128, max_steps=4,
                                      checkpoint_interval=2),
                  "distributed": {"nproc": 2, "timeout_s": timeout_s}}
