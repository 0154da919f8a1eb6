import pytest

from memfit.errors import ConfigError
from memfit.spec.run import dump_run, load_run, run_from_dict
from memfit.spec.strategy import Strategy


def test_strategy_defaults_and_label():
    s = Strategy()
    assert s.method == "lora" and s.engine == "ddp"
    assert Strategy(zero_stage=3, gradient_checkpointing=True).label() == "lora+zero3+gc+sdpa"


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"zero_stage": 2, "fsdp": "full_shard"}, "two sharding engines"),
        ({"offload": "optimizer"}, "zero_stage>=1"),
        ({"zero_stage": 2, "offload": "optimizer+params"}, "zero_stage=3"),
        ({"method": "meft", "meft_top_k": 64, "meft_buffer_size": 32}, "meft_buffer_size=32 is below meft_top_k=64"),
    ],
)
def test_strategy_rejects_impossible(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        Strategy(**kwargs)


def test_run_aliases_and_overrides():
    run = run_from_dict(
        {"model": "llama-2-7b", "lora": {"r": 8}, "meft": {"top_k": 32, "buffer_size": 512}, "max_steps": 7},
        ["strategy.gradient_checkpointing=true", "lora.alpha=64", "strategy.fsdp=full_shard"],
    )
    s = run.strategy
    assert (s.lora_r, s.lora_alpha, s.meft_top_k, s.gradient_checkpointing, s.fsdp) == (8, 64, 32, True, "full_shard")
    assert run.training.max_steps == 7
    assert s.meft_buffer_size == 512 and Strategy().meft_buffer_size is None  # None: memfit.meft's default rule


def test_run_unknown_key_names_field():
    with pytest.raises(ConfigError, match=r"strategy\.lora_rank: unknown key"):
        run_from_dict({"model": "x", "strategy": {"lora_rank": 4}})
    with pytest.raises(ConfigError, match=r"lora\.rank"):
        run_from_dict({"model": "x", "lora": {"rank": 4}})
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        run_from_dict({"model": "x"}, ["oops"])


def test_run_file_roundtrip(tmp_path):
    run = run_from_dict({"model": "llama-2-7b", "strategy": {"zero_stage": 3, "lora_targets": ["q_proj"]}})
    p = tmp_path / "run.yaml"
    p.write_text(dump_run(run))
    assert load_run(p) == run


def test_missing_run_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_run(tmp_path / "nope.yaml")


def test_save_run_is_atomic_and_world_readable(tmp_path):
    import os
    import stat

    from memfit.spec.run import save_run

    run = run_from_dict({"model": "llama-2-7b"})
    path = save_run(run, tmp_path / "out" / "run.yaml")
    assert load_run(path) == run
    assert stat.S_IMODE(os.stat(path).st_mode) & 0o044  # group/other can read, like any written file
    assert [p.name for p in path.parent.iterdir()] == ["run.yaml"]  # no temp file left
