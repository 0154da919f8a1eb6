"""The fault matrix's DeepSpeed rows and ``memfit train --nproc 2`` (issue 25), on CPU/gloo, 2 processes.

* ZeRO-2, an exception on rank 1, started with ``memfit train RUN --nproc 2``; ZeRO-3, rank 0 killed
  (kill -9), started with ``memfit launch RUN --nproc 2``. Each: the command exits non-zero within the
  bound with one line naming the rank, the port is free, checkpoint-2 is complete and ``--resume`` (the
  same command) redoes step 3 to the loss the interrupted run logged.
* SIGINT / SIGTERM to ``memfit train RUN --nproc 2`` alone (not its process group): exit 130 / 143,
  every process below it gone, and a line saying how to resume.

The other rows: tests/distributed/test_rank_faults.py (DDP kill -9, FSDP2 out of memory) and
tests/distributed/test_multinode.py
(ZeRO-3 on 2 node ranks, rank 1 killed, then resumed); the table is in docs/distributed.md.
"""

import json
import signal
import subprocess
import sys
import time

import pytest
import yaml

from fault_helper import alive, cause_lines, clean_env, descendants, fault_run, losses, memfit, port_free, sets

TIMEOUT_S = 60  # distributed.timeout_s of these runs
BOUND_S = 120  # a failing case ends within this (start-up of 2 processes on a loaded 2-core machine included)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_model_dir):
    return fault_run(tmp_path_factory, tiny_model_dir, "matrix", TIMEOUT_S)


# command, overrides, drill (the rank fails as it starts step 4: steps 1-3 logged, checkpoint-2 complete),
# what its line says
CASES = {
    "zero2-raise": ("train", ["strategy.zero_stage=2"], "1:4:raise",
                    "rank 1 of 2 (node 0): RuntimeError: injected failure on rank 1 at step 4"),
    "zero3-kill": ("launch", ["strategy.zero_stage=3"], "0:4:kill", "rank 0 was killed by SIGKILL"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_deepspeed_rank_fails_then_resume_gives_the_same_loss(base, case):
    from memfit.distributed.launch import free_port

    root, spec = base
    command, overrides, drill, says = CASES[case]
    run_file = root / f"{case}.yaml"
    run_file.write_text(yaml.safe_dump({**spec, "output_dir": str(root / case)}))
    port = free_port()
    args = [command, run_file, "--nproc", "2", "--master-port", port, *sets(overrides)]
    failed, took = memfit(*args, drill=drill)
    cause = cause_lines(failed.stderr)
    assert failed.returncode != 0 and len(cause) == 1 and says in cause[0], failed.stderr[-3000:]
    assert took < BOUND_S, took
    assert "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert port_free(port)
    out = root / case
    before = losses(out)
    assert sorted(before) == [1, 2, 3] and (out / "checkpoint-2").is_dir() and not (out / "checkpoint-4").exists()
    assert not (out / ".staging").exists() or not any((out / ".staging").iterdir())
    # ZeRO-3 resumed after a kill: tests/distributed/test_multinode.py; one resume here keeps CI short (every
    # engine x fault x layout resumed: tests/distributed/test_fault_matrix_full.py)
    if case == "zero3-kill":
        return
    args[args.index("--master-port") + 1] = free_port()
    resumed, _ = memfit(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = losses(out)
    assert sorted(after) == [1, 2, 3, 4]
    assert after[3] == pytest.approx(before[3], rel=1e-5, abs=1e-6)  # step 3 again, from checkpoint-2
    assert json.loads((out / "summary.json").read_text())["resumed_from"].endswith("checkpoint-2")


@pytest.mark.slow
@pytest.mark.parametrize("sig, extra", [("SIGINT", []), ("SIGTERM", []), ("SIGINT", ["--fallback"])])
def test_a_signal_to_train_nproc_2_stops_every_process(base, sig, extra):
    """The signal reaches ``memfit train`` only (``kill -INT PID``, not a terminal's Ctrl-C to the group); with
    ``--fallback`` each attempt's torchrun is started the same way (a session of its own, the signal passed once)."""
    root, spec = base
    out = root / f"signal-{sig}{''.join(extra)}"
    run_file = root / f"signal-{sig}{''.join(extra)}.yaml"
    run_file.write_text(yaml.safe_dump({**spec, "output_dir": str(out),
                                        "training": {**spec["training"], "max_steps": 10_000}}))
    from memfit.distributed.launch import free_port

    p = subprocess.Popen([sys.executable, "-m", "memfit", "train", str(run_file), "--nproc", "2", "--master-port",
                          str(free_port()), *extra],
                         env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoint-2").is_dir() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        below = descendants(p.pid)  # torchrun and its 2 workers (in sessions of their own)
        assert p.poll() is None and len(below) >= 3, below
        t0 = time.monotonic()
        p.send_signal(getattr(signal, sig))
        _, err = p.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        p.kill()
    assert p.returncode == {"SIGINT": 130, "SIGTERM": 143}[sig], err[-3000:]
    assert took < 45, (took, err[-3000:])  # torchrun's grace for its workers is 30 s
    assert not [pid for pid in below if alive(pid)]
    stopped = [ln for ln in err.splitlines() if ln.startswith(f"stopped ({sig})")]
    assert len(stopped) == 1 and "--resume" in stopped[0], err[-3000:]
    if sig == "SIGINT" and not extra:  # rank 0 says where it stopped (once; --fallback keeps the ranks' output)
        assert len([ln for ln in err.splitlines() if ln.startswith("interrupted at step")]) == 1, err[-3000:]
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()


def test_torchruns_own_traceback_gives_way_to_the_one_line():
    """A worker's traceback passes through; torchrun's closing traceback + report is replaced by the line."""
    from memfit.distributed.launch import run_torchrun

    worker = "Traceback (most recent call last):\n  File \"w.py\", line 1\nValueError: worker's own\n"
    torchrun = ("Traceback (most recent call last):\n  File \"/x/torch/distributed/run.py\", line 9, in <module>\n"
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
                "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n"
                "  exitcode  : -9 (pid: 7)  (SIGKILL)\n")
    text = worker + "between\n" + torchrun
    stand_in = f"import sys; sys.stderr.write({text!r}); sys.exit(1)"
    shown, causes = [], []
    code = run_torchrun([sys.executable, "-c", stand_in], clean_env(), shown.append, causes.append)
    assert code == 1 and "".join(shown) == worker + "between\n"
    assert causes == ["rank 1 was killed by SIGKILL (no error of its own: killed from outside, or out of host "
                      "memory)"]
    shown.clear()
    assert run_torchrun([sys.executable, "-c", stand_in], clean_env(), shown.append, None) == 1
    assert "".join(shown) == worker + "between\n" + torchrun  # no line to replace it: all of it shown
