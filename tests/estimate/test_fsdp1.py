"""FSDP1 as its own engine (issue 22): the strategy key, the configs memfit writes, and the memory terms
read from torch 2.13's FSDP1 source (memfit/estimate/fsdp1.py), each pinned on hand-computed bytes."""

from __future__ import annotations

import json

import pytest
import yaml

from memfit.distributed.config import accelerate_config, fsdp_trainer_config
from memfit.estimate import estimate
from memfit.estimate import fsdp1 as F1
from memfit.estimate.constants import DEFAULT_PROFILE
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import model_from_config, resolve_model
from memfit.spec.run import run_from_dict
from memfit.spec.strategy import Strategy

RAW = {"hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8, "num_key_value_heads": 2,
       "num_hidden_layers": 4, "vocab_size": 2000}
TINY = model_from_config({"model_type": "llama", **RAW}, name="tiny")


def _mem(model, hw, **keys):
    return estimate(model, parse_hardware(hw), Strategy(**keys)).to_dict()["memory"]


# ---------------------------------------------------------------- the strategy key
def test_strategy_fsdp_version_label_engine_and_json():
    s1 = Strategy(fsdp="full_shard", fsdp_version=1)
    assert s1.engine == "fsdp1-full_shard" and s1.label() == "lora+fsdp1-full_shard+sdpa"
    assert Strategy(fsdp="shard_grad_op", fsdp_version=1).engine == "fsdp1-shard_grad_op"
    s2 = Strategy(fsdp="full_shard")  # the default stays FSDP2
    assert s2.fsdp_version == 2 and s2.engine == "fsdp-full_shard"
    # without FSDP the version means nothing: one form of each DDP / ZeRO strategy
    assert Strategy(zero_stage=2, fsdp_version=1) == Strategy(zero_stage=2)
    with pytest.raises(ValueError, match="fsdp_version"):
        Strategy(fsdp="full_shard", fsdp_version=3)
    assert json.loads(s1.model_dump_json())["fsdp_version"] == 1


def test_run_file_and_set_carry_the_version():
    run = run_from_dict({"model": "llama-2-7b", "strategy": {"fsdp": "full_shard", "fsdp_version": 1}},
                        ["strategy.fsdp_version=2"])
    assert run.strategy.fsdp_version == 2
    run = run_from_dict({"model": "llama-2-7b", "strategy": {"fsdp": "full_shard"}}, ["strategy.fsdp_version=1"])
    assert run.strategy.engine == "fsdp1-full_shard"


def test_cli_estimate_json_and_plan_emit(tmp_path):
    from typer.testing import CliRunner

    from memfit.cli.app import app

    r = CliRunner().invoke(app, ["estimate", "--model", "llama-2-7b", "--gpus", "2xA100-80GB", "--fsdp",
                                 "full_shard", "--fsdp-version", "1", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["strategy"]["fsdp_version"] == 1
    r = CliRunner().invoke(app, ["plan", "--model", "llama-2-7b", "--gpus", "2xA100-80GB", "--fsdp", "full_shard",
                                 "--fsdp-version", "1", "--methods", "lora", "--emit", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["recommended"]["strategy"]["fsdp_version"] == 1
    acc = yaml.safe_load((tmp_path / "accelerate.yaml").read_text())
    f = acc["fsdp_config"]
    assert acc["distributed_type"] == "FSDP" and f["fsdp_version"] == 1
    assert f["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    assert f["fsdp_reshard_after_forward"] == "FULL_SHARD"
    assert yaml.safe_load((tmp_path / "run.yaml").read_text())["strategy"]["fsdp_version"] == 1


# ---------------------------------------------------------------- the configs memfit writes
def test_fsdp1_trainer_and_accelerate_config():
    run = run_from_dict({"model": "llama-2-7b", "strategy": {"fsdp": "shard_grad_op", "fsdp_version": 1}})
    f = fsdp_trainer_config(run)
    # the keys transformers/training_args.py reads for fsdp_config["version"] == 1
    assert f == {"version": 1, "reshard_after_forward": "shard_grad_op", "cpu_offload": False,
                 "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "use_orig_params": True, "limit_all_gathers": True,
                 "backward_prefetch": "BACKWARD_PRE", "forward_prefetch": False, "sync_module_states": True,
                 "cpu_ram_efficient_loading": True, "state_dict_type": "SHARDED_STATE_DICT"}
    # FSDP1 broadcasts module states from a GPU (_init_utils.py); accelerate wants both or neither
    cpu = fsdp_trainer_config(run, "cpu")
    assert cpu["sync_module_states"] is False and cpu["cpu_ram_efficient_loading"] is False
    a = accelerate_config(run, layer_cls="LlamaDecoderLayer")["fsdp_config"]
    assert a == {"fsdp_version": 1, "fsdp_reshard_after_forward": "SHARD_GRAD_OP", "fsdp_offload_params": False,
                 "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                 "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "fsdp_use_orig_params": True,
                 "fsdp_sync_module_states": True, "fsdp_cpu_ram_efficient_loading": True,
                 "fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_forward_prefetch": False,
                 "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_activation_checkpointing": False}
    two = run_from_dict({"model": "llama-2-7b", "strategy": {"fsdp": "full_shard"}})
    assert accelerate_config(two)["fsdp_config"]["fsdp_version"] == 2


def test_accelerate_config_keys_exist_in_accelerate():
    """Every key memfit writes is one accelerate's launcher reads (accelerate/commands/launch.py flags)."""
    from accelerate.commands.launch import launch_command_parser

    flags = {a.dest for a in launch_command_parser()._actions}
    run = run_from_dict({"model": "llama-2-7b", "strategy": {"fsdp": "full_shard", "fsdp_version": 1,
                                                             "offload": "optimizer+params"}})
    for key in accelerate_config(run, layer_cls="LlamaDecoderLayer")["fsdp_config"]:
        assert key in flags, key


def test_launcher_names_the_version(monkeypatch):
    from memfit.distributed.engines import ENGINES, for_run
    from memfit.distributed.engines.fsdp import with_launcher_version

    run = run_from_dict({"model": "llama-2-7b", "strategy": {"fsdp": "full_shard"}})
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")  # accelerate launch exports it ("1" when the file has none)
    adopted = with_launcher_version(run)
    assert adopted.strategy.fsdp_version == 1 and for_run(adopted) is ENGINES["fsdp1-full_shard"]
    ddp = run_from_dict({"model": "llama-2-7b"})
    assert with_launcher_version(ddp) is ddp  # not an FSDP run: nothing to adopt
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    assert with_launcher_version(run) is run


# ---------------------------------------------------------------- FlatParameter sizes
def test_flat_parameter_alignment_and_world_padding_by_hand():
    # fp32, use_orig_params: each parameter starts at 16 B = 4 elements: [5] -> pad 3 -> [3] = 11, then to a
    # multiple of world 2: 12; each rank keeps 6
    assert F1.flat_param_numel([5, 3], 2, 4) == 12 and F1.shard_numel([5, 3], 2, 4) == 6
    # bf16 aligns to 8 elements: 5 + 3 pad + 3 = 11 -> world 3: 12
    assert F1.flat_param_numel([5, 3], 3, 2) == 12
    # without use_orig_params no alignment; _get_shard pads the last chunk: ceil(8 / 3) = 3 per rank
    assert F1.flat_param_numel([5, 3], 3, 4, use_orig_params=False) == 9


def test_tiny_llama_units_as_torch_builds_them():
    # torch 2.13 FSDP1 on 2 gloo ranks wrapped this model's decoder layers: flat numel 692,736 per layer (shard
    # 346,368) and the root 1,024,256 = embedding 512,000 + norm 256 + head 512,000 (shard 512,128)
    assert sum(F1.layer_numels(TINY)) == TINY.layer_parameters == 692_736
    assert F1.shard_numel(F1.layer_numels(TINY), 2, 4) == 346_368
    assert F1.root_parameters(TINY) == 1_024_256
    assert F1.padding_bytes(TINY, 2, 4) == 0.0
    # 3 ranks: 692,736 % 3 = 0; root 1,024,256 = 3 x 341,418 + 2 -> 1 element of padding, 4 B over 3 ranks
    assert F1.padding_bytes(TINY, 3, 4) == pytest.approx(4 / 3)


# ---------------------------------------------------------------- the buffers, by hand
def test_fsdp1_gathered_and_gradient_buffers_by_hand():
    """fp32 full fine-tuning of the tiny Llama on 2 CPU ranks: FSDP2 gathers 2 layers + the tail (norm +
    head); FSDP1 gathers 2 layers + the root (embedding + norm + head), and the same one layer's gradient +
    reduce-scatter output, plus the head's gradient autograd holds through the layers' backward."""
    one = _mem(TINY, "2xCPU", method="full", precision="fp32", seq_len=512, micro_batch_size=2, fsdp="full_shard",
               fsdp_version=1)["gpu_bytes"]
    two = _mem(TINY, "2xCPU", method="full", precision="fp32", seq_len=512, micro_batch_size=2, fsdp="full_shard",
               fsdp_version=2)["gpu_bytes"]
    layer, root, tail = 692_736 * 4, 1_024_256 * 4, (512_000 + 256) * 4
    assert DEFAULT_PROFILE.gathered_layers == 2
    assert two["gathered_params"] == 2 * layer + tail
    assert one["gathered_params"] == 2 * layer + root  # fp32 flat = fp32 param dtype: no low-precision shard
    head_grad = (512_000 + 256) * 4
    assert one["comm_buffers"] == pytest.approx(layer * 1.5 + head_grad)
    assert two["comm_buffers"] == pytest.approx(layer * 1.5)
    assert one["weights"] == two["weights"] == (692_736 * 4 + 1_024_256) * 4 / 2  # no padding at world 2


def test_fsdp1_low_precision_shard_and_lora_units():
    """bf16-mixed full fine-tuning: accelerate upcasts the flat parameters to fp32, so FSDP1 allocates the
    prefetched unit's _mp_shard (shard numel x 2 B) beside the gathered layers; LoRA's frozen layers are
    bf16 flat parameters (no shard copy) and the root (embedding + head, frozen bf16) stays gathered. With
    PEFT's adapter units nested in every decoder layer, BACKWARD_PRE's target is the layer's own last adapter
    unit (_exec_order_utils.py get_handle_to_backward_prefetch): one decoder layer — its frozen weights, the
    adapters being units of their own — gathered at a time, where FSDP2 gathers two whole layers."""
    llama = resolve_model("llama-2-7b")
    full1 = _mem(llama, "4xA100-80GB", method="full", fsdp="full_shard", fsdp_version=1)["gpu_bytes"]
    layer = llama.layer_parameters * 2.0
    root = (llama.parameters - 32 * llama.layer_parameters) * 2.0
    assert full1["gathered_params"] == pytest.approx(2 * layer + layer / 4 + root)
    lora1 = _mem(llama, "4xA100-80GB", method="lora", fsdp="full_shard", fsdp_version=1)["gpu_bytes"]
    lora2 = _mem(llama, "4xA100-80GB", method="lora", fsdp="full_shard", fsdp_version=2)["gpu_bytes"]
    tail = (llama.head_parameters + llama.hidden) * 2.0
    assert lora1["gathered_params"] == pytest.approx(layer + root)  # frozen bf16 layer: no shard copy
    assert lora2["gathered_params"] > 2 * layer + tail  # + the adapters inside FSDP2's layer units


def test_fsdp1_offload_keeps_a_shard_copy_on_the_device():
    llama = resolve_model("llama-2-7b")
    keys = dict(method="lora", fsdp="full_shard", fsdp_version=1)
    on = _mem(llama, "4xA100-80GB", **keys)["gpu_bytes"]
    off = _mem(llama, "4xA100-80GB", offload="optimizer+params", **keys)
    assert off["gpu_bytes"]["weights"] < on["weights"] / 10  # the shards moved to the host
    layer_b = on["gathered_params"] - (llama.parameters - 32 * llama.layer_parameters) * 2.0  # one layer (LoRA)
    # + one bf16 shard of the prefetched layer (frozen: no low-precision copy, the H2D copy is its own dtype)
    assert off["gpu_bytes"]["gathered_params"] - on["gathered_params"] == pytest.approx(layer_b / 4)
    assert off["cpu_bytes"]["offloaded_params"] > 0


def test_fsdp1_never_fits_where_fsdp2_does_not_by_the_version_alone():
    """Full fine-tuning: FSDP1's terms are FSDP2's plus the root unit and the root's gradient, never less memory.
    Adapter methods: FSDP1 (PEFT's adapter units) gathers one decoder layer in backward where FSDP2 gathers two
    (measured on 2 gloo ranks, docs/distributed.md), so it may hold less — at most one layer's frozen weights
    less, the root it keeps gathered counting against that."""
    for name in ("llama-2-7b", "llama-3.1-70b", "mixtral-8x7b"):
        model = resolve_model(name)
        for method in ("full", "lora", "qlora"):
            for gc in (False, True):
                keys = dict(method=method, fsdp="full_shard", gradient_checkpointing=gc, seq_len=2048,
                            quant_storage="bf16" if method == "qlora" else "uint8")
                one = _mem(model, "8xA100-80GB", fsdp_version=1, **keys)
                two = _mem(model, "8xA100-80GB", fsdp_version=2, **keys)
                spare = 0.0 if method == "full" else two["gpu_bytes"]["gathered_params"] / 2
                assert one["gpu_allocated_bytes"] >= two["gpu_allocated_bytes"] - spare, (name, method, gc)


def test_fsdp1_phases_by_hand():
    """The tiny Llama in fp32 on 2 CPU ranks (bench/studies/distributed_memory.py --peak). Without checkpointing the
    peak is the loss's backward: FSDP1 holds its root (embedding + norm + head, 1,024,256 x 4 B) where FSDP2
    holds its tail (512,256 x 4 B), and the last decoder layer the root's pre-backward hook prefetched
    (692,736 x 4 B; LoRA: the frozen layer alone, its adapters are units of their own). Measured: 138.41 -
    133.59 = 4.82 MB (full), 115.25 - 110.43 = 4.82 MB (LoRA). With checkpointing the peak is the last
    layer's recomputation: FSDP1 adds the root and the head's pending gradient (512,256 x 4 B), holds no
    unsharded gradient + reduce-scatter output there (1.5 x 692,736 x 4 B: its post-backward hook's), where
    FSDP2 keeps the previous layer's reduce-scatter input, and no head gradient shard yet (512,000 x 4 B / 2:
    FSDP1 reduces its root at the backward's end)."""
    keys = dict(precision="fp32", seq_len=512, micro_batch_size=2, fsdp="full_shard", lora_dropout=0.0, lora_r=16,
                lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    layer, root, tail = 692_736 * 4, 1_024_256 * 4, 512_256 * 4
    for method in ("full", "lora"):
        one = _mem(TINY, "2xCPU", method=method, fsdp_version=1, **keys)["gpu_allocated_bytes"]
        two = _mem(TINY, "2xCPU", method=method, fsdp_version=2, **keys)["gpu_allocated_bytes"]
        assert one - two == pytest.approx(root - tail + layer, abs=2), method  # 4,818,944 B
    one = _mem(TINY, "2xCPU", method="full", fsdp_version=1, gradient_checkpointing=True, **keys)
    two = _mem(TINY, "2xCPU", method="full", fsdp_version=2, gradient_checkpointing=True, **keys)
    assert one["gpu_allocated_bytes"] - two["gpu_allocated_bytes"] == pytest.approx(
        root + tail - 1.5 * layer - 512_000 * 4 / 2, abs=2)  # 965,632 B; measured 66.05 - 63.70 = 2.35 MB


# ---------------------------------------------------------------- CPU RAM follows the loading path
def test_cpu_ram_loading_one_copy_per_node_under_fsdp():
    llama = resolve_model("llama-3.1-70b")
    p = DEFAULT_PROFILE
    for fsdp in ("full_shard", "shard_grad_op"):
        for version in (1, 2):
            mem = _mem(llama, "4xA100-80GB", method="lora", fsdp=fsdp, fsdp_version=version)
            cpu, load = mem["cpu_bytes"], mem["run_phases"]["load"]["cpu_bytes"]
            # rank 0 reads the 16-bit checkpoint; the other ranks start on the meta device
            assert cpu["model_loading"] == llama.parameters * 2.0
            assert load == pytest.approx(4 * p.process_baseline_bytes + llama.parameters * 2.0)
            # memfit train's final save gathers the full state dict on rank 0 (#39): the 16-bit base + the fp32
            # adapters, the node's peak
            assert cpu["total"] == mem["run_phases"]["save"]["cpu_bytes"] > load and mem["cpu_peak_phase"] == "saving"
    # DDP: every process builds its own copy
    ddp = _mem(llama, "4xA100-80GB", method="lora")["cpu_bytes"]
    assert ddp["model_loading"] == 4 * llama.parameters * 2.0


def test_cpu_ram_fsdp_qlora_loads_quantised_on_rank_0():
    """Answer.AI's loader: rank 0 keeps the quantised model, one checkpoint shard being read; no 16-bit copy
    (141 GB) in RAM. Seed 004 (Kaitchup, Llama 3.1 70B on 2 x RTX 3090) asks for 200 GB of CPU RAM: the step
    holds 102 GB, the first step 143 GB (FSDP1's lazy init pins a copy of every offloaded shard while the unpinned
    one stays until the unit first runs, #39); memfit train's full final save about as much."""
    llama = resolve_model("llama-3.1-70b")
    est = estimate(llama, parse_hardware("2xRTX3090-24GB", cpu_ram="200GB"),
                   Strategy(method="qlora", fsdp="full_shard", fsdp_version=1, offload="optimizer+params",
                            gradient_checkpointing=True, quant_storage="bf16", seq_len=2048))
    cpu, phases = est.cpu, est.phases
    assert cpu["model_loading"] < 50e9 and phases["train_step"][1] < 110e9
    assert 128e9 < cpu["total"] == max(c for _, c in phases.values()) < 200e9
    assert not any("CPU RAM" in r for r in est.reasons)


def test_gpu_count_search_cpu_ram_no_longer_a_copy_per_process():
    """The issue's command: CPU RAM per node was 286 GB at 2 GPUs (shard_grad_op counted a 16-bit copy per
    process) and 1,146 GB at 8 (every process); now one copy per node (or the quantised one), so going from
    2 to 8 GPUs adds only the 6 more processes' baselines."""
    from memfit.plan.gpu_count import gpu_count_search

    llama = resolve_model("llama-3.1-70b")
    res = gpu_count_search(llama, "A100-80GB", max_gpus=8, seq_len=2048, micro_batch_size=1)
    cpu = {row.gpus: row.recommended.cpu_total for row in res.rows if row.recommended is not None}
    assert cpu[8] < 170e9 and cpu[2] < 170e9
    assert cpu[8] - cpu[3] == pytest.approx(5 * DEFAULT_PROFILE.process_baseline_bytes)


def test_fsdp1_refused_on_the_cpu_device_in_one_line():
    from memfit.plan.rules import check
    from memfit.spec.hardware import HardwareSpec, cpu_device

    cpu = HardwareSpec(cpu_device(), gpus_per_node=2)
    reasons = check(TINY, cpu, Strategy(method="lora", fsdp="full_shard", fsdp_version=1, precision="fp32"))
    assert reasons == ["fsdp_version=1 on the CPU device: FSDP1's final full-state-dict gather crashes under gloo "
                       "(docs/distributed.md); use fsdp_version=2 on the CPU, FSDP1 on CUDA GPUs, or train with "
                       "save.mode=sharded or adapter"]
    assert check(TINY, cpu, Strategy(method="lora", fsdp="full_shard", fsdp_version=2, precision="fp32")) == []
    assert check(TINY, parse_hardware("2xA100-80GB"),
                 Strategy(method="lora", fsdp="full_shard", fsdp_version=1)) == []
