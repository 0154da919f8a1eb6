"""The whole fault matrix, engine x fault x layout (issue 25), on CPU/gloo. Opt in:

    MEMFIT_FAULT_MATRIX=full .venv/bin/python -m pytest tests/distributed/test_fault_matrix_full.py

(32 cases, each run twice: the failing run and its ``--resume``.) CI runs a sample of these rows
(tests/distributed/test_fault_matrix.py, tests/distributed/test_rank_faults.py, tests/distributed/test_multinode.py).

Every case: the tiny LoRA run of the tests, 4 steps, a checkpoint every 2, ``distributed.timeout_s`` 30;
rank 1 fails as it starts step 4 (``MEMFIT_FAULT_DRILL``; on 2 nodes rank 1 is node 1's process). Each
launcher ends within the bound and non-zero, the failing rank's node says so in one line naming rank 1,
the port is free, steps 1-3 are logged, checkpoint-2 is complete and nothing half-written is left, and
``--resume`` (the same commands) redoes step 3 to the loss the interrupted run logged.
"""

import os
import subprocess
import sys
import time

import pytest
import yaml

from fault_helper import alive, cause_lines, clean_env, descendants, fault_run, losses, port_free, sets

TIMEOUT_S = 30  # distributed.timeout_s of these runs
BOUND_S = TIMEOUT_S + 150  # start-up of 2 processes with torch on a loaded 2-core machine included
ENGINES = {"ddp": [], "zero2": ["strategy.zero_stage=2"], "zero3": ["strategy.zero_stage=3"],
           "fsdp2": ["strategy.fsdp=full_shard"]}
KINDS = ("kill", "raise", "oom", "hang")
LAYOUTS = ("1x2", "2x1")  # nodes x processes per node
SAYS = {"kill": "rank 1 was killed by SIGKILL", "raise": "rank 1 of 2 (node {node}): RuntimeError",
        "oom": "rank 1 of 2 (node {node}): out of memory", "hang": "rank 1 did not answer",
        "hang-2x1": "rank 1 of 2 (node 1): stopped: the job"}  # node 1's torchrun sees no timeout: memfit's watch

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("MEMFIT_FAULT_MATRIX") != "full",
                                 reason="the whole matrix: set MEMFIT_FAULT_MATRIX=full (CI runs its sample)")]


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_model_dir):
    return fault_run(tmp_path_factory, tiny_model_dir, "fullmatrix", TIMEOUT_S)


def _start(layout: str, run_file, overrides: list[str], port: int, env: dict, resume: bool) -> list:
    """``memfit launch`` as a user starts it: once (1 node x 2), or once per node rank (2 nodes x 1)."""
    tail = [*sets(overrides), *(["--resume"] if resume else [])]
    if layout == "1x2":
        cmds = [["launch", run_file, "--nproc", "2", "--master-port", port, *tail]]
    else:
        cmds = [["launch", run_file, "--nodes", "2", "--node-rank", r, "--nproc", "1", "--master-addr",
                 "127.0.0.1", "--master-port", port, "--single-host", *tail] for r in (0, 1)]
    return [subprocess.Popen([sys.executable, "-m", "memfit", *map(str, c)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for c in cmds]


def _finish(procs: list, bound: float) -> tuple[list, float, list[int]]:
    """Wait for every launcher up to ``bound`` seconds in all; then kill what is left. Returns the finished
    processes, the seconds the slowest took, and the pids still alive at the bound (killed)."""
    t0, done, left = time.monotonic(), [], []
    below = {pid for p in procs for pid in descendants(p.pid)}
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, bound - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            below |= descendants(p.pid)
            left += [p.pid, *[pid for pid in below if alive(pid)]]
            for pid in {p.pid, *below}:
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
            out, err = p.communicate()
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done, time.monotonic() - t0, sorted(set(left))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_failing_rank(base, engine, kind, layout):
    from memfit.distributed.launch import free_port

    root, spec = base
    case = f"{engine}-{kind}-{layout}"
    out = root / case
    run_file = root / f"{case}.yaml"
    run_file.write_text(yaml.safe_dump({**spec, "output_dir": str(out)}))
    port = free_port()
    failed, took, left = _finish(_start(layout, run_file, ENGINES[engine], port,
                                        clean_env(MEMFIT_FAULT_DRILL=f"1:4:{kind}"), False), BOUND_S)
    said = [cause_lines(p.stderr) for p in failed]
    report = f"{case}: {took:.0f} s, exits {[p.returncode for p in failed]}, lines {said}\n" + \
        "\n----\n".join(p.stderr[-2500:] for p in failed)
    assert not left, f"still running at {BOUND_S} s (killed): {left}\n{report}"
    assert all(p.returncode != 0 for p in failed), report
    node = 0 if layout == "1x2" else 1  # the failing rank's node
    says = SAYS.get(f"{kind}-{layout}", SAYS[kind]).format(node=node)
    assert len(said[node]) == 1 and says in said[node][0], report
    assert all(len(lines) == 1 for lines in said), report  # every launcher ends with its one line
    assert port_free(port), report
    before = losses(out)
    assert sorted(before) == [1, 2, 3], report
    assert (out / "checkpoint-2").is_dir() and not (out / "checkpoint-4").exists(), report
    assert not (out / ".staging").exists() or not any((out / ".staging").iterdir()), report
    resumed, _, left = _finish(_start(layout, run_file, ENGINES[engine], free_port(), clean_env(), True), 600)
    assert not left and all(p.returncode == 0 for p in resumed), "\n----\n".join(p.stderr[-2500:] for p in resumed)
    after = losses(out)
    assert sorted(after) == [1, 2, 3, 4]
    assert after[3] == pytest.approx(before[3], rel=1e-4, abs=1e-4)  # step 3 again, from checkpoint-2
