"""One rank of two fails (kill -9 under DDP, an out-of-memory error under FSDP2) on CPU/gloo,
started with ``memfit launch RUN --nproc 2`` (MEMFIT_FAULT_DRILL picks the rank, step and kind).

Every process ends within the run's collective timeout, the launcher exits non-zero with one line naming
the rank, nothing is left holding the port, the newest complete checkpoint is there, and (DDP kill -9)
``--resume`` continues from it to the loss the interrupted run had logged for the same step.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from fault_helper import cause_lines, fault_run, losses, memfit, port_free, sets
from memfit.distributed.faults import failure_line, root_cause

TIMEOUT_S = 60  # distributed.timeout_s of these runs: every process must be gone well within it


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_model_dir):
    return fault_run(tmp_path_factory, tiny_model_dir, "faults", TIMEOUT_S)


CASES = {  # engine, fault; the rank fails as it starts step 4: steps 1-3 are logged, checkpoint-2 is complete
    "ddp-kill": ([], "1:4:kill", "killed by SIGKILL"),  # no word from the rank: torchrun names it
    "fsdp-oom": (["strategy.fsdp=full_shard"], "0:4:oom", "out of memory"),  # an exception on one rank
}
# (an exception of another type on rank 1 of FSDP, "1:4:raise", takes the OOM's path: ~60 s more, not in CI)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_failing_rank_ends_the_job_and_resume_continues(base, case):
    from memfit.distributed.launch import free_port

    root, spec = base
    overrides, drill, says = CASES[case]
    run_file = root / f"{case}.yaml"
    run_file.write_text(yaml.safe_dump({**spec, "output_dir": str(root / case)}))
    port = free_port()
    failed, took = memfit("launch", run_file, "--nproc", "2", "--master-port", port, *sets(overrides),
                          drill=drill)
    assert failed.returncode != 0
    assert took < TIMEOUT_S + 240, took  # (process start-up on a loaded 2-core machine included)
    cause = cause_lines(failed.stderr)
    assert len(cause) == 1 and says in cause[0] and f"rank {drill[0]}" in cause[0], failed.stderr[-3000:]
    assert port_free(port)  # no process left holding the rendezvous
    out = root / case
    before = losses(out)
    assert sorted(before) == [1, 2, 3] and (out / "checkpoint-2").is_dir() and not (out / "checkpoint-4").exists()
    if case != "ddp-kill":
        return  # (FSDP's resume from a checkpoint: tests/distributed/test_multinode.py; one resume here keeps CI short)
    resumed, _ = memfit("launch", run_file, "--nproc", "2", "--master-port", free_port(), *sets(overrides),
                        "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = losses(out)
    assert sorted(after) == [1, 2, 3, 4]
    assert after[3] == pytest.approx(before[3], rel=1e-5, abs=1e-6)  # step 3 again, from checkpoint-2
    assert json.loads((out / "summary.json").read_text())["resumed_from"].endswith("checkpoint-2")


def test_failure_lines():
    err = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")
    assert "lost a peer rank" in failure_line(err) and failure_line(err).startswith("rank 0 of 1 (node 0)")
    assert failure_line(ValueError("bad batch\nat row 7")) == "rank 0 of 1 (node 0): ValueError: bad batch at row 7"
    import torch

    assert "out of memory" in failure_line(torch.OutOfMemoryError("CUDA out of memory. Tried 2 GiB"))
    report = ("Root Cause (first observed failure):\n[0]:\n  time      : t\n  host      : h\n"
              "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 7)  (SIGKILL)\n")
    assert root_cause("error: rank 0 of 2 (node 0): lost a peer rank in a collective (x)\n" + report) == \
        "rank 1 was killed by SIGKILL (no error of its own: killed from outside, or out of host memory)"
    hung = ("error: rank 0 of 2 (node 0): lost a peer rank in a collective (RuntimeError: Timed out waiting "
            "30000ms for send operation to complete); ...\n"
            + report.replace("-9 (pid: 7)  (SIGKILL)", "-15 (pid: 7)  (SIGTERM)"))
    assert root_cause(hung).startswith("rank 1 did not answer within distributed.timeout_s")
    own = ("error: rank 1 of 2 (node 0): RuntimeError: bad batch\n"
           + report.replace("-9 (pid: 7)  (SIGKILL)", "1 (pid: 7) "))
    assert root_cause(own) == "rank 1 of 2 (node 0): RuntimeError: bad batch"


def test_drill_variable_is_checked():
    from memfit.distributed.faults import drill_callback
    from memfit.errors import ConfigError

    assert drill_callback({}) is None
    with pytest.raises(ConfigError, match="RANK:STEP:KIND"):
        drill_callback({"MEMFIT_FAULT_DRILL": "1:x:explode"})


def test_sigterm_to_the_launcher_stops_torchrun_and_exits_143(tmp_path):
    """``memfit launch`` passes a SIGTERM on to torchrun (which stops its workers) and exits 143."""
    import signal

    pid_file = tmp_path / "child.pid"
    (tmp_path / "child.py").write_text("import os, sys, time\n"
                                       "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
                                       "time.sleep(120)\n")
    script = ("import os, sys\n"
              "from memfit.distributed.launch import run_torchrun\n"
              "cmd = [sys.executable, sys.argv[1], sys.argv[2]]  # a stand-in for torchrun\n"
              "sys.exit(run_torchrun(cmd, dict(os.environ), sys.stderr.write, None))\n")
    p = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "child.py"), str(pid_file)])
    for _ in range(600):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 143
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)  # the stand-in is gone (terminated and reaped)
