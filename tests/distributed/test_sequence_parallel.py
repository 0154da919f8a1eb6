"""Ulysses sequence parallelism on the CPU (#36 item 5): 2 processes (gloo) with sequence_parallel=2 reproduce one
process's losses at the same global batch. accelerate's ParallelismConfig(sp_size=2, sp_backend='deepspeed') through
the Trainer: DeepSpeed's UlyssesSPAttentionHF (the all-to-all around sdpa) and UlyssesSPDataLoaderAdapter (each
sample's tokens split over the 2 ranks). One torchrun: ZeRO-1 and ZeRO-3 LoRA with SP, then ZeRO-1 without it in the
same processes (the SP groups and attention function reset between runs)."""

import json
from pathlib import Path

import pytest

from conftest import reference_losses
from memfit.distributed.launch import torchrun_command
from test_distributed_train import _run

pytestmark = pytest.mark.slow
STEPS = 3
# 2 ranks x micro-batch 2 sharing each sample = a global batch of 2 sequences; one process: micro-batch 2.
# (The Trainer averages SP micro-batches' means, not tokens, across accumulation: transformers/trainer.py:527
# turns num_items_in_batch off under SP, so grad_accum stays 1 for the comparison.)
SP = ["strategy.sequence_parallel=2", "strategy.micro_batch_size=2"]
CASES = {
    "sp2-z1": SP + ["strategy.zero_stage=1"],
    "sp2-z3": SP + ["strategy.zero_stage=3"],
    "z1-after-sp": ["strategy.zero_stage=1", "strategy.micro_batch_size=1"],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model_dir):
    import yaml

    from conftest import lora_dialogue_run

    root = tmp_path_factory.mktemp("sp")
    base = lora_dialogue_run(root, tiny_model_dir, "sp", records=48, seq_len=128, max_steps=STEPS)
    (root / "sp.yaml").write_text(yaml.safe_dump({**base, "output_dir": str(root / "out2")}))
    (root / "cases.json").write_text(json.dumps([{"name": k, "set": v} for k, v in CASES.items()]))
    _run(torchrun_command("memfit.measure.engine_matrix",
                          [str(root / "sp.yaml"), str(root / "cases.json"), str(root / "out.json")], nproc=2),
         root, timeout=600)
    (root / "ref.yaml").write_text(yaml.safe_dump({**base, "output_dir": str(root / "out1")}))
    ref = reference_losses(root / "ref.yaml", ["strategy.zero_stage=1", "strategy.micro_batch_size=2"])
    return json.loads(Path(root / "out.json").read_text())["cases"], ref


@pytest.mark.parametrize("case", list(CASES))
def test_two_sp_ranks_give_one_process_losses(results, case):
    cases, ref = results
    got = cases[case]["losses"]
    assert len(got) == STEPS == len(ref)
    assert got == pytest.approx(ref, rel=1e-4), (case, got, ref)
