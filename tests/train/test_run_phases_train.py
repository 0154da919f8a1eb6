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
    out = planning_only(_run(strategy={"method": "lora", "fsdp": "full_shard"}, save={"mode": "sharded"},
                             eval={"loss_only": False, "examples": 10}))
    assert len(out) == 2 and all("\n" not in r for r in out)
    assert out[0].startswith("eval.loss_only=false") and out[1].startswith("save.mode=sharded")
    assert "set it to full" in out[1]
