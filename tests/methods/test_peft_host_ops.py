"""memfit/methods/peft/host_ops.json is what bench/peft_host_ops.py counts: LoRA's kernels per wrapped module
(the unit: GENERIC_OPS module-level ops) and one type's count beyond them, recounted here on a smaller Llama
(the counts do not depend on the width: the same ops run)."""

import json

import pytest

pytest.importorskip("peft")


def test_host_ops_file_is_what_the_bench_counts(monkeypatch):
    from bench import peft_host_ops as bench

    from memfit.methods.peft.work import HOST_OPS_FILE, host_ops

    monkeypatch.setattr(bench, "SHAPE", {**bench.SHAPE, "hidden_size": 256, "intermediate_size": 512,
                                         "num_attention_heads": 4, "num_key_value_heads": 2})
    have = json.loads(HOST_OPS_FILE.read_text())
    cfg = {"peft_type": "DELORA", "task_type": "CAUSAL_LM", "r": 8, "target_modules": ["q_proj", "v_proj"]}
    got = bench.count_all({"DELORA": cfg})
    assert got["lora_kernels_per_module"] == have["lora_kernels_per_module"] == 13.5
    assert got["types"]["DELORA"]["ops"] == have["types"]["DELORA"]["ops"] == host_ops("DELORA")
    assert host_ops("NOT_COUNTED") == 0.0 and host_ops("IA3") == pytest.approx(-2.29)
