"""Start one training process per device with ``torchrun``, on this node or one node of many.

``launch(run.yaml, nproc=8, nodes=2, node_rank=0, master_addr="10.0.0.1")`` runs, on this node::

    python -m torch.distributed.run --nnodes 2 --node-rank 0 --nproc-per-node 8 \
        --master-addr 10.0.0.1 --master-port 29500 -m memfit.train run.yaml --set distributed.nproc=8 ...

Every node runs the same command with its own ``node_rank``. The layout is also passed as ``--set``
overrides so each process's run (and the run.yaml rank 0 saves) says how it was launched; the
pre-flight compares it with the launched world size. DeepSpeed goes through torchrun as well (on the CPU
``accelerate launch --use_deepspeed`` does not set up the process group; torchrun does, everywhere).

Plain Python: torch is imported by the launched processes, not here.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from memfit.errors import ConfigError
from memfit.spec.run import DEFAULT_PORT

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a one-node rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_port(port: Optional[int], nodes: int) -> int:
    """The port node 0 listens on: ``port`` when one was given (``--master-port`` or the run file's
    ``distributed.master_port``); else, across nodes, 29500 (every node must name the same one, so it cannot
    be drawn), and on one node a port that is free now, so a second one-node job on the same machine does
    not meet the first at 29500 (its TCPStore cannot bind the port and the job fails at start-up)."""
    if port is not None:
        return port
    return DEFAULT_PORT if nodes > 1 else free_port()


def _is_loopback(addr: str) -> bool:
    if addr.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def check_layout(nproc: int, nodes: int, node_rank: int, master_addr: str, master_port: int,
                 single_host: bool = False) -> None:
    """One-line ConfigErrors for a layout torchrun would reject later (or hang on). ``single_host``: every
    node rank runs on this machine (a deliberate test of a multi-node config): loopback is then right."""
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: give the number of processes on this node (1 or more)")
    if nodes < 1:
        raise ConfigError(f"--nodes {nodes}: give the number of nodes (1 or more)")
    if not 0 <= node_rank < nodes:
        raise ConfigError(f"--node-rank {node_rank}: with --nodes {nodes} it must be 0..{nodes - 1} "
                          "(0 on the node whose address is --master-addr)")
    if not 1 <= master_port <= 65535:
        raise ConfigError(f"--master-port {master_port}: must be 1..65535 (default: a free port on one node, "
                          f"{DEFAULT_PORT} across nodes)")
    if nodes > 1 and _is_loopback(master_addr) and not single_host:
        raise ConfigError(f"--master-addr {master_addr} with --nodes {nodes}: the other nodes cannot reach a "
                          "loopback address; give node 0's address on the cluster network, e.g. 10.0.0.1 "
                          "(or add --single-host when every node rank runs on this machine)")


def layout_overrides(nproc: int, nodes: int, node_rank: int, master_addr: str, master_port: int) -> list[str]:
    return [f"distributed.nproc={nproc}", f"distributed.nodes={nodes}", f"distributed.node_rank={node_rank}",
            f"distributed.master_addr={master_addr}", f"distributed.master_port={master_port}"]


def torchrun_command(module: str, args: Sequence[str], *, nproc: int, nodes: int = 1, node_rank: int = 0,
                     master_addr: str = "127.0.0.1", master_port: Optional[int] = None,
                     python: Optional[str] = None) -> list[str]:
    """``python -m torch.distributed.run ... -m MODULE ARGS``: ``nproc`` processes of ``module`` on this
    node (a free local port when ``master_port`` is None). The one place memfit spells torchrun."""
    return [python or sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(nodes), "--node-rank", str(node_rank), "--nproc-per-node", str(nproc),
            "--master-addr", master_addr, "--master-port", str(master_port or free_port()),
            "-m", module, *map(str, args)]


def launch_command(run_path: str | Path, *, nproc: int, nodes: int = 1, node_rank: int = 0,
                   master_addr: str = "127.0.0.1", master_port: Optional[int] = None,
                   overrides: Sequence[str] = (), resume: bool = False, overwrite: bool = False,
                   python: Optional[str] = None, single_host: bool = False) -> list[str]:
    """The torchrun command line this node runs (what :func:`launch` executes); ``master_port`` None:
    :func:`rendezvous_port`."""
    master_port = rendezvous_port(master_port, nodes)
    check_layout(nproc, nodes, node_rank, master_addr, master_port, single_host)
    cmd = torchrun_command("memfit.train", [str(run_path)], nproc=nproc, nodes=nodes, node_rank=node_rank,
                           master_addr=master_addr, master_port=master_port, python=python)
    for item in [*overrides, *layout_overrides(nproc, nodes, node_rank, master_addr, master_port)]:
        cmd += ["--set", item]
    if resume:
        cmd.append("--resume")
    if overwrite:
        cmd.append("--overwrite")
    return cmd


def launch_env(base: Optional[dict[str, str]] = None, nproc: int = 1) -> dict[str, str]:
    """The processes' environment: one BLAS/OpenMP thread pool share per process unless the user set it
    (:func:`memfit.spec.threads.run_threads`, the count the prediction reads). ``nproc``: the processes
    sharing this machine (every node's, with ``--single-host``)."""
    from memfit.spec.threads import ENV, run_threads

    env = dict(os.environ if base is None else base)
    if ENV not in env:
        env[ENV] = str(run_threads(nproc, environ=env))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def launch(run_path: str | Path, *, nproc: int, nodes: int = 1, node_rank: int = 0,
           master_addr: str = "127.0.0.1", master_port: Optional[int] = None, overrides: Sequence[str] = (),
           resume: bool = False, overwrite: bool = False, single_host: bool = False,
           on_start: Optional[Callable[[Any], None]] = None,
           on_output: Optional[Callable[[str], None]] = None,
           on_failure: Optional[Callable[[str], None]] = None) -> int:
    """Run this node's share of the training with torchrun; returns its exit status (0 = all ranks ok).

    The run file, the overrides and what can be checked without torch (:func:`~memfit.distributed.
    preflight.before_launch`: model folder, planner rules, engines) are validated first, as one error
    line, so a mistake does not start ``nproc`` processes that all fail the same way. ``on_start(run)``
    is called once that passed, just before the processes start (the CLI prints what it launches).
    ``on_output(line)``: the processes' stderr goes through it (default: on to this stderr), so that
    on a failure ``on_failure(line)`` gets one line naming the first rank that failed and why
    (:func:`memfit.distributed.faults.root_cause`). A SIGINT / SIGTERM stops every process of this node
    (:func:`run_torchrun`) and returns 130 / 143.
    """
    from memfit.distributed.preflight import before_launch
    from memfit.errors import IncompatibleError
    from memfit.spec.run import load_run

    run_path = Path(run_path)
    master_port = rendezvous_port(master_port, nodes)  # once: the run, the banner and torchrun name the same
    layout = layout_overrides(nproc, nodes, node_rank, master_addr, master_port)
    run = load_run(run_path, [*overrides, *layout])
    problems = before_launch(run)
    if problems:
        raise IncompatibleError(f"{run_path}: strategy {run.strategy.label()} cannot run here: "
                                + "; ".join(problems))
    cmd = launch_command(run_path, nproc=nproc, nodes=nodes, node_rank=node_rank, master_addr=master_addr,
                         master_port=master_port, overrides=overrides, resume=resume, overwrite=overwrite,
                         single_host=single_host)
    if on_start is not None:
        on_start(run)
    env = launch_env(nproc=nproc * nodes if single_host else nproc)
    try:
        return run_torchrun(cmd, env, on_output or sys.stderr.write, on_failure)
    except KeyboardInterrupt:  # before the handlers were in place: torchrun had not started its workers
        return 130


STOP_CODES = {"SIGINT": 130, "SIGTERM": 143, "SIGHUP": 129}  # a stop's exit status: 128 + the signal


def run_torchrun(cmd: list[str], env: dict[str, str], on_output: Callable[[str], None],
                 on_failure: Optional[Callable[[str], None]], stdout: Any = None) -> int:
    """Run torchrun to its end, its stderr passed line by line to ``on_output``; its tail names a
    failure. torchrun runs in a session of its own, and a SIGINT / SIGTERM / SIGHUP to this process is
    passed on to it once (it stops its workers: the same signal, SIGKILL after 30 s), so a Ctrl-C in the
    terminal reaches torchrun exactly once and never this process's ``subprocess`` teardown, which would
    SIGKILL torchrun and leave its workers running. Waits until every worker closed its stderr, then
    returns 130 / 143 / 129. ``stdout``: where the processes' stdout goes (default: this stdout)."""
    import signal
    import threading
    from collections import deque

    from memfit.distributed.faults import root_cause

    tail: deque = deque(maxlen=400)
    stopped: list[int] = []
    with subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True, errors="replace",
                          start_new_session=True) as proc:
        def stop(signum, _frame) -> None:
            if not stopped:
                proc.send_signal(signum)
            stopped.append(128 + signum)

        main = threading.current_thread() is threading.main_thread()
        sigs = [getattr(signal, name) for name in STOP_CODES]
        before = {s: signal.signal(s, stop) for s in sigs} if main else {}
        try:
            held: list[str] = []  # from the newest traceback on (torchrun's own ends its output)
            for line in proc.stderr:  # type: ignore[union-attr]
                tail.append(line)
                if line.startswith(_TRACEBACK):
                    held, earlier = [line], held
                    for text in earlier:
                        on_output(text)
                elif held:
                    held.append(line)
                else:
                    on_output(line)
            code = proc.wait()
        finally:
            for s, handler in before.items():
                signal.signal(s, handler)
    cause = root_cause("".join(tail)) if code != 0 and not stopped and on_failure is not None else None
    if not ((stopped or cause) and _torchrun_exit(held)):  # the one line below says it instead
        for text in held:
            on_output(text)
    if cause:
        on_failure(cause)  # type: ignore[misc]
    return stopped[0] if stopped else code


_TRACEBACK = "Traceback (most recent call last)"


def _torchrun_exit(lines: list[str]) -> bool:
    """Whether ``lines`` are torchrun's own traceback as it ends (its workers failed, or it was stopped by
    a signal) with its failure report: what memfit's one line replaces."""
    text = "".join(lines)
    return "torch/distributed/run.py" in text and ("ChildFailedError" in text or "SignalException" in text)
