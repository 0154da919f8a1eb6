"""memfit train runs the eval and save keys the estimate priced (#39), refuses the ones it does not run, and its
summary says which were used."""

from memfit.distributed.preflight import planning_only
from memfit.spec.run import run_from_dict
from memfit.train.api import phases_note


def _run(**kw):
    return run_from_dict({"model": "llama-3.2-1b", **kw})


def test_defaults_are_what_train_does():
    assert planning_only(_run()) == []
    assert phases_note(_run()) == ("run phases: evaluation batch 1, loss only (no compute_metrics); final save "
                                   "adapter; checkpoints whole")  # the default method trains an adapter
    lora = _run(strategy={"method": "lora", "micro_batch_size": 2}, eval={"batch_size": 8})
    assert "evaluation batch 8" in phases_note(lora) and "final save adapter" in phases_note(lora)
    fsdp = _run(strategy={"method": "lora", "fsdp": "full_shard"}, save={"mode": "full"})
    assert planning_only(fsdp) == [] and "final save full; checkpoints sharded" in phases_note(fsdp)


def test_keys_train_does_not_run_are_refused_in_one_line():
    out = planning_only(_run(strategy={"method": "lora", "zero_stage": 3}, save={"mode": "sharded"},
                             eval={"loss_only": False, "examples": 10}))
    assert len(out) == 2 and all("\n" not in r for r in out)
    assert out[0].startswith("eval.loss_only=false") and out[1].startswith("save.mode=sharded")
    assert "set it to adapter" in out[1]
    # FSDP runs sharded and adapter-only saves too (#39 item 5); full fine-tuning has no adapter to save
    assert planning_only(_run(strategy={"method": "lora", "fsdp": "full_shard"}, save={"mode": "sharded"})) == []
    assert planning_only(_run(strategy={"method": "full", "fsdp": "full_shard"}, save={"mode": "adapter"}))


def test_fsdp1_on_the_cpu_runs_with_a_sharded_or_adapter_save():
    """FSDP1's full-state-dict gather crashes under gloo; without it (save.mode sharded or adapter) the rule that
    refuses FSDP1 on the CPU device does not apply to the run."""
    from memfit.distributed.preflight import rule_reasons
    from memfit.resolve import resolve
    from memfit.train.adapter_save import peft_keys

    base = {"model": "llama-3.2-1b", "hardware": "local",
            "strategy": {"method": "lora", "fsdp": "full_shard", "fsdp_version": 1, "precision": "fp32"}}
    for mode, refused in ((None, True), ("adapter", False), ("sharded", False)):
        run = _run(**{k: v for k, v in base.items() if k != "model"}, save={"mode": mode})
        r = resolve(run)
        reasons = rule_reasons(run, r.model, r.hardware)
        assert any(x.startswith("fsdp_version=1 on the CPU device") for x in reasons) == (
            refused and r.hardware.gpu.is_cpu)
    keys = peft_keys({"base_model.model.l.q_proj.lora_A.default.weight": _t(),
                      "base_model.model.l.q_proj.lora_magnitude_vector.default.weight": _t()}, "default")
    assert sorted(keys) == ["base_model.model.l.q_proj.lora_A.weight",
                            "base_model.model.l.q_proj.lora_magnitude_vector"]


def _t():
    import torch

    return torch.zeros(2)
