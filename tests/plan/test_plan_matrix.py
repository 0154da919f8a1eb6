"""The model × context matrix on 8xV100-32GB, checked cell by cell against what arXiv 2406.02290 reports for
its Figure 4 (the seed text, ../shared/reference/seeds/000_*.txt, §2.4.5; the figure itself is an image, so
the cells checked are those the text names):

- "even a 7B model needs model + data parallelism (ZeRO) on few GPUs": 7B full fine-tuning fits only with
  ZeRO, and every 7B cell is LoRA;
- "gradient checkpointing lets LLaMA-2 13B and 70B go from 512 to 4096 tokens, impossible otherwise":
  13B and 70B fit without GC at 256 and 512, and at 1024, 2048 and 4096 only with GC;
- LLaMA-2 70B is fine-tuned on one 8xV100 node with ZeRO-3 + LoRA (§2.4.3, Table 2);
- Falcon-180B needs two nodes (16 V100s), with ZeRO-3 + LoRA + GC at every context;
- moving right or down needs a higher ZeRO stage (the trend test below).

Where memfit's answer differs from the paper the cell is a strict xfail naming why (docs/plan.md), so the
disagreement is visible and a change that removes it fails until the test is updated. The fit checks hold
gradient checkpointing fixed and ask whether any recipe of the study's levers fits: memory only, whatever
the time model prefers.
"""

from functools import lru_cache

import pytest

from memfit.plan.matrix import DEFAULT_MODELS, DEFAULT_SEQ_LENS, NO_FIT, short_label
from memfit.plan.matrix import matrix as plan_matrix
from memfit.spec.hardware import parse_hardware
from memfit.spec.strategy import Strategy


def matrix(*args, **kwargs):
    """The paper's study: its levers only (no long-context levers, which it did not have)."""
    return plan_matrix(*args, long_context=False, **kwargs)

V100 = parse_hardware("8xV100-32GB")
V100_2N = parse_hardware("2x8xV100-32GB")
LLAMAS = ("llama-2-7b", "llama-2-13b", "llama-2-70b")
PARAM_OFFLOAD = ("none", "optimizer", "optimizer+params")

# memfit against the paper, cell by cell (model, seq_len, with GC, nodes) -> why they differ
DIFFERS = {
    ("llama-2-13b", 1024, False, 1): "memfit fits LoRA+Z3 without GC (20.5 GB of 32.4 usable at micro-batch 1, SDPA); "
                                     "the paper's batch is not in the seed",
    ("llama-2-13b", 2048, False, 1): "memfit fits Full+Z3+optimizer offload without GC (LoRA+Z3: 33.9 GB, just over)",
    ("llama-2-70b", 256, False, 1): "LoRA+Z3+optimizer offload without GC needs 32.53 GB, 0.16 GB over the planner's "
                                    "5 % margin on the 34.08 GB a V100-32GB gives CUDA (fits at margin 0)",
    ("llama-2-70b", 512, False, 1): "LoRA+Z3 without GC needs 44.1 GB of 32.4; fits with parameter offload",
    ("falcon-180b", 2048, True, 2): "LoRA+Z3+GC needs 35.4 GB per GPU on 16 V100s, 32.4 usable; fits with "
                                    "parameter offload (the study's runs most likely offloaded)",
    ("falcon-180b", 4096, True, 2): "LoRA+Z3+GC needs 43.2 GB per GPU on 16 V100s; fits with parameter offload",
}


@pytest.fixture(scope="module")
def one_node():
    return matrix(V100)


@lru_cache(maxsize=None)
def _fits(model: str, seq_len: int, gc: bool, nodes: int = 1, offloads: tuple = ("none", "optimizer")) -> bool:
    """Does any recipe of the study's levers (GC held fixed) fit this cell?"""
    m = matrix(V100 if nodes == 1 else V100_2N, [model], [seq_len], offloads=offloads,
               fixed={"gradient_checkpointing": gc})
    return m.cell(model, seq_len).recommended is not None


def _paper(model, seq_len, gc, nodes, fits):
    """(model, seq_len, gc, nodes, fits the paper reports), marked xfail where memfit differs."""
    why = DIFFERS.get((model, seq_len, gc, nodes))
    marks = [pytest.mark.xfail(strict=True, reason=f"memfit differs from the paper: {why}")] if why else []
    return pytest.param(model, seq_len, gc, nodes, fits, marks=marks,
                        id=f"{model}-{seq_len}-{'gc' if gc else 'nogc'}-{nodes}n")


FIG4_FITS = [
    # 13B and 70B: without GC up to 512 tokens, beyond only with GC
    *[_paper(m, s, False, 1, s <= 512) for m in ("llama-2-13b", "llama-2-70b") for s in DEFAULT_SEQ_LENS],
    *[_paper(m, s, True, 1, True) for m in ("llama-2-13b", "llama-2-70b") for s in (1024, 2048, 4096)],
    # Falcon-180B: on no single node; on two with GC at every context
    *[_paper("falcon-180b", s, True, 1, False) for s in DEFAULT_SEQ_LENS],
    *[_paper("falcon-180b", s, True, 2, True) for s in DEFAULT_SEQ_LENS],
]


@pytest.mark.parametrize("model,seq_len,gc,nodes,fits", FIG4_FITS)
def test_fig4_cell_fits_as_the_paper_reports(model, seq_len, gc, nodes, fits):
    assert _fits(model, seq_len, gc, nodes) is fits


@pytest.mark.parametrize("seq_len", DEFAULT_SEQ_LENS)
def test_fig4_7b_uses_zero(one_node, seq_len):
    """'Even a 7B model needs model and data parallelism combined' (ZeRO, not plain DDP): its full fine-tuning
    fits only sharded (memory), and the recommended cell is LoRA. With LoRA the shards save nothing a 32 GB
    card needs, and memfit ranks plain DDP first (DeepSpeed's per-gradient hooks cost host time: the paper
    ran every configuration under DeepSpeed)."""
    assert one_node.cell("llama-2-7b", seq_len).recommended.strategy.method == "lora"
    full = dict(methods=["full"], offloads=["none"], zero_stages=[0, 1, 2, 3])
    ddp = matrix(V100, ["llama-2-7b"], [seq_len], fixed={"zero_stage": 0, "fsdp": False}, **full)
    assert ddp.cell("llama-2-7b", seq_len).recommended is None
    sharded = matrix(V100, ["llama-2-7b"], [seq_len], **full).cell("llama-2-7b", seq_len).recommended
    assert sharded is not None and sharded.strategy.zero_stage >= 1


@pytest.mark.parametrize("seq_len", DEFAULT_SEQ_LENS)
def test_fig4_falcon_180b_two_nodes_zero3_lora_gc(seq_len):
    two = matrix(V100_2N, ["falcon-180b"], [seq_len])
    rec = two.cell("falcon-180b", seq_len).recommended
    if ("falcon-180b", seq_len, True, 2) in DIFFERS:
        assert rec is None  # the known difference (see DIFFERS)
        return
    assert (rec.strategy.method, rec.strategy.zero_stage, rec.strategy.gradient_checkpointing) == ("lora", 3, True)


def test_fig4_70b_with_parameter_offload():
    """Where the study's 70B and 180B runs must have offloaded parameters (the 70B run measured 15.5 GB per GPU,
    below its 17.3 GB of 16-bit weights): with ZeRO-3 parameter offload memfit gives the paper's cells —
    70B without GC to 512 tokens and not beyond, Falcon-180B on two nodes with GC at every context."""
    for s in DEFAULT_SEQ_LENS:
        assert _fits("llama-2-70b", s, False, 1, PARAM_OFFLOAD) is (s <= 512), s
        assert _fits("falcon-180b", s, True, 2, PARAM_OFFLOAD), s


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
