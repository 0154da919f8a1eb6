"""Two node ranks on one machine, started as a cluster user starts them (docs/distributed.md):

    memfit launch RUN --nodes 2 --node-rank R --nproc 1 --master-addr 127.0.0.1 --master-port P --single-host

ZeRO-3 and FSDP2 on CPU/gloo, 2 nodes x 1 process, against one process at micro-batch 2 on the same
run file: the same losses, the ranks in the summary, and a checkpoint at step 2 that ``--resume``
continues to step 3 with the uninterrupted losses, in one folder per node (ZeRO-3: node-local disks)
and in one shared output folder (FSDP).
"""

import json

import pytest
import yaml

from fault_helper import cause_lines, launch_nodes, losses


ENGINES = {"z3": ["strategy.zero_stage=3"], "fsdp": ["strategy.fsdp=full_shard"]}
STEPS = 3


def _ok(procs) -> None:
    for p in procs:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]


def test_loopback_needs_single_host(tmp_path):
    from memfit.distributed.launch import launch_command
    from memfit.errors import ConfigError

    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump({"model": "llama-2-7b", "output_dir": str(tmp_path / "out")}))
    with pytest.raises(ConfigError, match="--single-host"):  # the real-cluster mistake stays refused
        launch_command(run_file, nproc=1, nodes=2, node_rank=1, master_addr="127.0.0.1")
    cmd = launch_command(run_file, nproc=1, nodes=2, node_rank=1, master_addr="127.0.0.1", single_host=True)
    assert cmd[cmd.index("--node-rank") + 1] == "1" and cmd[cmd.index("--master-addr") + 1] == "127.0.0.1"


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, tiny_model_dir):
    from conftest import lora_dialogue_run, reference_losses

    root = tmp_path_factory.mktemp("multinode")
    base = {**lora_dialogue_run(root, tiny_model_dir, "multinode", records=32, seq_len=128, max_steps=STEPS,
                                logging_interval=1), "output_dir": str(root / "ref")}
    run_file = root / "run.yaml"
    run_file.write_text(yaml.safe_dump(base))
    # the reference: one process at micro-batch 2 (the same global batches; tests/distributed/test_distributed_train.py
    # checks that ZeRO-3 and FSDP on 2 ranks give one process's losses)
    results = {"ref": reference_losses(run_file, ["method=lora", "strategy.micro_batch_size=2"]), "root": root}
    for key, sets in ENGINES.items():
        # ZeRO-3: a folder per node (node-local disks); FSDP: one output folder both nodes write (a shared
        # file system). 2 steps with a checkpoint at 2, then --resume to step 3.
        per_node = (lambda r: [f"output_dir={root / key}-node{r}"]) if key == "z3" else None
        out = root / (f"{key}-node0" if per_node else key)
        first = [f"output_dir={out}", "training.max_steps=2", "training.checkpoint_interval=2", *sets]
        _ok(p1 := launch_nodes(run_file, first, per_node_sets=per_node))
        _ok(p2 := launch_nodes(run_file, [f"output_dir={out}", *sets], resume=True, per_node_sets=per_node))
        results[key] = {"first": p1, "resumed": p2, "out": out, "node1": root / f"{key}-node1" if per_node else out}
    return results


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINES))
def test_two_nodes_match_one_node_and_resume(nodes, engine):
    out = nodes[engine]["out"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["resumed_from"].endswith("checkpoint-2")
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == STEPS  # steps 1-2 from the first job, 3 after --resume (trimmed, not repeated)
    assert losses == pytest.approx(nodes["ref"], rel=1e-4, abs=1e-4)
    assert (out / "checkpoint-2").is_dir() and (out / "adapter").is_dir()
    node1 = nodes[engine]["node1"]  # node 1's own folder (ZeRO-3) holds a complete checkpoint of its own
    assert (node1 / "checkpoint-2" / "trainer_state.json").is_file() and not (node1 / ".staging").exists()
    if node1 != out:
        assert (node1 / "run.yaml").is_file() and (node1 / "checkpoint-2" / "latest").is_file()
        assert [p.name for p in (node1 / "checkpoint-2").glob("global_step2/*optim_states.pt")] == \
            ["zero_pp_rank_1_mp_rank_00_optim_states.pt"]  # its own shard only
        assert "resumed from" in nodes[engine]["resumed"][0].stdout


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINES))
def test_summary_names_every_rank(nodes, engine):
    summary = json.loads((nodes[engine]["out"] / "summary.json").read_text())
    assert [(r["rank"], r["node_rank"], r["local_rank"], r["world_size"]) for r in summary["ranks"]] == \
        [(0, 0, 0, 2), (1, 1, 0, 2)]
    assert any("world size 2 on 2 node(s)" in n for n in summary["notes"])
    run = yaml.safe_load((nodes[engine]["out"] / "run.yaml").read_text())
    assert run["distributed"]["nodes"] == 2 and run["distributed"]["nproc"] == 1
    banner = " ".join(nodes[engine]["first"][1].stderr.split())  # (the console wraps it)
    assert "node 1 of 2" in banner and "world size 2" in banner


@pytest.mark.slow
def test_a_rank_killed_on_node_1_ends_both_nodes_and_resume_gives_the_same_loss(nodes):
    """kill -9 of rank 1 (node 1) as it starts step 3: both launchers end non-zero within timeout_s, each
    with one line; ``--resume`` on both nodes redoes step 3 from checkpoint-2 to the uninterrupted loss."""
    import time

    root = nodes["root"]
    sets = [f"output_dir={root / 'killed'}", "distributed.timeout_s=60", "training.checkpoint_interval=2",
            *ENGINES["z3"]]
    t0 = time.monotonic()
    procs = launch_nodes(root / "run.yaml", sets, env={"MEMFIT_FAULT_DRILL": "1:3:kill"})
    assert time.monotonic() - t0 < 60 + 240
    lines = [cause_lines(p.stderr) for p in procs]
    assert all(p.returncode != 0 for p in procs) and [len(x) for x in lines] == [1, 1], procs[0].stderr[-2000:]
    assert "rank 1 was killed by SIGKILL" in lines[1][0]
    assert "rank 0 of 2 (node 0): lost a peer rank" in lines[0][0]
    assert "--resume on every node" in lines[0][0]
    assert sorted(losses(root / "killed")) == [1, 2] and (root / "killed" / "checkpoint-2").is_dir()
    resumed = launch_nodes(root / "run.yaml", sets, resume=True)
    _ok(resumed)
    after = losses(root / "killed")
    assert sorted(after) == [1, 2, 3]
    assert [after[s] for s in (1, 2, 3)] == pytest.approx(nodes["ref"], rel=1e-4, abs=1e-4)
