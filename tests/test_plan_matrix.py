"""The model × context matrix on 8xV100-32GB, checked against what arXiv 2406.02290 (Fig. 4) reports."""

import pytest

from memfit.plan.matrix import DEFAULT_MODELS, DEFAULT_SEQ_LENS, NO_FIT, matrix, short_label
from memfit.spec.hardware import parse_hardware
from memfit.spec.strategy import Strategy

V100 = parse_hardware("8xV100-32GB")
LLAMAS = ("llama-2-7b", "llama-2-13b", "llama-2-70b")


@pytest.fixture(scope="module")
def one_node():
    return matrix(V100)


def _saving(cell) -> int:
    """How much memory saving the recipe uses: the sharding stage, and checkpointing counted as two."""
    s = cell.recommended.strategy
    stage = s.zero_stage or {"full_shard": 3, "shard_grad_op": 2}.get(s.fsdp or "", 0)
    return stage + 2 * int(s.gradient_checkpointing)


def test_shape_and_json(one_node):
    assert one_node.models == list(DEFAULT_MODELS) and one_node.seq_lens == list(DEFAULT_SEQ_LENS)
    d = one_node.to_dict()
    assert len(d["cells"]) == 4 * 5
    assert {k for c in d["cells"] for k in c} >= {"model", "seq_len", "recommended"}
    fitting = [c for c in d["cells"] if c["recommended"] is not None]
    assert fitting and all(c["recommended"]["fits"] for c in fitting)


def test_the_study_levers_only(one_node):
    for c in one_node.cells:
        if c.recommended is not None:
            s = c.recommended.strategy
            assert s.method in ("full", "lora") and not s.fsdp and s.offload in ("none", "optimizer")
            assert s.precision == "fp16-mixed" and s.attention != "fa2"  # V100: no bf16, no FA2


def test_small_model_short_context_needs_little(one_node):
    cell = one_node.cell("llama-2-7b", 256)
    s = cell.recommended.strategy
    assert s.zero_stage <= 2 and not s.gradient_checkpointing


def test_more_saving_as_size_and_context_grow(one_node):
    """The paper's trend: down a column (bigger model) the recipe never saves less; along a row the
    longest context needs at least what the shortest does, and bigger models need heavy levers in more
    cells. (A row need not be monotone cell by cell: the planner is time-optimal, and at short contexts
    ZeRO-3's fixed all-gather cost can exceed checkpointing's recompute, e.g. 13B picks Z2+GC at 256 and
    Z3 at 512.)"""
    for s in DEFAULT_SEQ_LENS:
        levels = [_saving(one_node.cell(m, s)) for m in LLAMAS]
        assert levels == sorted(levels), (s, [one_node.cell(m, s).label for m in LLAMAS])
    heavy = []
    for model in LLAMAS:
        row = [one_node.cell(model, s) for s in DEFAULT_SEQ_LENS]
        assert _saving(row[-1]) >= _saving(row[0]), [c.label for c in row]
        heavy.append(sum(c.recommended.strategy.zero_stage == 3 or c.recommended.strategy.gradient_checkpointing
                         for c in row))
    assert heavy == sorted(heavy) and heavy[0] < heavy[-1] == len(DEFAULT_SEQ_LENS)
    # checkpointing is what lets 13B and 70B reach 4096 tokens
    for model in ("llama-2-13b", "llama-2-70b"):
        assert one_node.cell(model, 4096).recommended.strategy.gradient_checkpointing


def test_llama_70b_needs_zero3_and_lora_on_one_node(one_node):
    for s in DEFAULT_SEQ_LENS:
        rec = one_node.cell("llama-2-70b", s).recommended
        assert rec is not None, s
        assert rec.strategy.method == "lora" and rec.strategy.zero_stage == 3


def test_falcon_180b_does_not_fit_on_one_node_but_on_two(one_node):
    assert all(one_node.cell("falcon-180b", s).label == NO_FIT for s in DEFAULT_SEQ_LENS)
    two = matrix(parse_hardware("2x8xV100-32GB"), ["falcon-180b"], [256, 512])
    for s in (256, 512):
        rec = two.cell("falcon-180b", s).recommended
        assert rec is not None
        assert rec.strategy.method == "lora" and rec.strategy.zero_stage == 3 and rec.strategy.gradient_checkpointing
    # the matrix can find the node count itself
    grown = matrix(V100, ["falcon-180b"], [256], max_nodes=2)
    assert grown.cell("falcon-180b", 256).nodes == 2 and grown.cell("falcon-180b", 256).label.endswith("×2n")


def test_short_labels():
    assert short_label(Strategy(method="lora", zero_stage=2)) == "LoRA+Z2"
    assert short_label(Strategy(method="lora", zero_stage=3, gradient_checkpointing=True)) == "LoRA+Z3+GC"
    assert short_label(Strategy(method="qlora", fsdp="full_shard", offload="optimizer+params",
                                attention="fa2")) == "QLoRA+FSDP+FA2+OffP"
    assert short_label(Strategy(method="full", zero_stage=1, offload="optimizer", attention="eager")) == \
        "Full+Z1+eager+Off"


def test_picture_is_written_atomically(tmp_path):
    from memfit.plan.picture import draw

    m = matrix(V100, ["llama-2-7b", "falcon-180b"], [256, 1024])
    out = draw(m, tmp_path / "m.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(data) < 300_000
    assert [p.name for p in tmp_path.iterdir()] == ["m.png"]
