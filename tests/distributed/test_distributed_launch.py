"""The torchrun command memfit builds, per node (nothing is started, no address is contacted)."""

import json
import subprocess
import sys

import pytest
import yaml

from memfit.distributed.launch import launch_command, launch_env
from memfit.errors import ConfigError, IncompatibleError


@pytest.fixture
def run_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "model": "llama-2-7b", "strategy": {"zero_stage": 3, "offload": "optimizer"},
        "distributed": {"nproc": 4, "nodes": 1}, "output_dir": str(tmp_path / "out")}))
    return path


def _after(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def test_multinode_command(run_file):
    cmd = launch_command(run_file, nproc=8, nodes=2, node_rank=1, master_addr="10.0.0.1",
                         master_port=29400, overrides=["lora.r=8"], resume=True, python="python")
    assert cmd[:3] == ["python", "-m", "torch.distributed.run"]
    assert (_after(cmd, "--nnodes"), _after(cmd, "--node-rank"), _after(cmd, "--nproc-per-node")) == ("2", "1", "8")
    assert (_after(cmd, "--master-addr"), _after(cmd, "--master-port")) == ("10.0.0.1", "29400")
    tail = cmd[cmd.index("memfit.train") - 1:]
    assert tail[:3] == ["-m", "memfit.train", str(run_file)] and tail[-1] == "--resume"
    sets = [tail[i + 1] for i, a in enumerate(tail) if a == "--set"]
    assert sets[0] == "lora.r=8"  # the user's overrides, then the layout each process checks against
    assert {"distributed.nproc=8", "distributed.nodes=2", "distributed.node_rank=1",
            "distributed.master_addr=10.0.0.1"} <= set(sets)


@pytest.mark.parametrize("kwargs, needle", [
    ({"nproc": 0}, "--nproc 0"),
    ({"nproc": 2, "nodes": 2, "node_rank": 2, "master_addr": "10.0.0.1"}, "must be 0..1"),
    ({"nproc": 2, "nodes": 2}, "loopback"),
    ({"nproc": 2, "master_port": 70000}, "1..65535"),
])
def test_bad_layouts(run_file, kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        launch_command(run_file, **kwargs)


def test_one_node_draws_a_free_port_many_nodes_share_29500(run_file, tmp_path):
    """Two one-node jobs on a machine must not meet at torchrun's 29500 (the second cannot bind it); every node of
    a multi-node job must name the same port, so there it is 29500 unless given."""
    import socket

    from memfit.distributed.launch import rendezvous_port

    assert rendezvous_port(29400, 1) == 29400 and rendezvous_port(None, 2) == 29500
    with socket.socket() as held:  # the port a first job holds
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        drawn = {rendezvous_port(None, 1) for _ in range(5)}
    assert taken not in drawn
    one = launch_command(run_file, nproc=2)
    assert _after(one, "--master-port") != "29500"
    assert "distributed.master_port=" + _after(one, "--master-port") in one  # the run says the port it used
    many = launch_command(run_file, nproc=2, nodes=2, master_addr="10.0.0.1")
    assert _after(many, "--master-port") == "29500"


def test_fallback_runs_on_one_node_and_takes_nproc(tmp_path, capsys):
    from cli_helper import run_cli
    from memfit.cli.train_cmds import _fallback_layout
    from memfit.spec.run import run_from_dict

    run = run_from_dict({"model": "llama-2-7b", "output_dir": str(tmp_path / "o")})
    assert _fallback_layout(run, 2, 1).distributed.nproc == 2 and _fallback_layout(run, 1, 1) is run
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": str(tmp_path), "output_dir": str(tmp_path / "o")}))
    code, _, err = run_cli(capsys, "train", str(path), "--fallback", "--nodes", "2")
    assert code == 2 and err.strip().splitlines()[-1] == (
        "error: --fallback with 2 nodes: --fallback restarts the processes itself and runs on one node; across "
        "nodes use `memfit launch RUN --nodes N --node-rank R` on each node")
    assert not (tmp_path / "o").exists()


def test_thread_share():
    env = launch_env({"PATH": "/bin"}, nproc=64)
    assert env["OMP_NUM_THREADS"] == "1" and env["PATH"] == "/bin"
    assert launch_env({"OMP_NUM_THREADS": "3"}, nproc=2)["OMP_NUM_THREADS"] == "3"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "memfit", *args], capture_output=True, text=True, timeout=120)


def test_cli_dry_run_json(run_file):
    p = _cli("launch", str(run_file), "--nodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1",
             "--nproc", "8", "--dry-run", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["world_size"] == 16 and out["engine"] == "zero3"
    assert _after(out["command"], "--nproc-per-node") == "8"
    assert out["deepspeed_config"]["train_batch_size"] == 16
    assert out["deepspeed_config"]["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert out["accelerate_config"]["num_machines"] == 2


def test_cli_defaults_from_run_file_and_errors(run_file):
    p = _cli("launch", str(run_file), "--dry-run", "--json")
    assert p.returncode == 0, p.stderr
    assert _after(json.loads(p.stdout)["command"], "--nproc-per-node") == "4"
    p = _cli("launch", str(run_file), "--nodes", "2", "--dry-run")
    assert p.returncode == 2 and "loopback" in p.stderr and "Traceback" not in p.stderr
    p = _cli("launch", str(run_file), "--set", "strategy.zero_stage=7", "--dry-run")
    assert p.returncode == 2 and "zero_stage" in p.stderr and "Traceback" not in p.stderr


def test_launch_validates_then_runs_torchrun(run_file, monkeypatch):
    from memfit.distributed import launch as mod

    seen = {}

    def fake_run(cmd, env, on_output, on_failure):
        seen.update(cmd=cmd, env=env)
        return 3

    from memfit.distributed import preflight

    monkeypatch.setattr(mod, "run_torchrun", fake_run)
    monkeypatch.setattr(preflight, "before_launch", lambda run: [])  # llama-2-7b is a preset, no weights
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert mod.launch(run_file, nproc=2, overrides=["lora.r=4"]) == 3  # the children's exit status
    assert seen["cmd"][1:3] == ["-m", "torch.distributed.run"] and "lora.r=4" in seen["cmd"]
    assert int(seen["env"]["OMP_NUM_THREADS"]) >= 1
    seen.clear()
    with pytest.raises(ConfigError, match="lora.rank"):  # a typo fails here, before any process starts
        mod.launch(run_file, nproc=2, overrides=["lora.rank=4"])
    monkeypatch.setattr(preflight, "before_launch", lambda run: ["model: no weights"])
    with pytest.raises(IncompatibleError, match="cannot run here: model: no weights"):
        mod.launch(run_file, nproc=2)
    assert not seen


def test_planning_modules_do_not_import_torch():
    code = ("import sys, memfit.distributed.launch, memfit.distributed.preflight, memfit.distributed.engines, "
            "memfit.cli.launch_cmds; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
