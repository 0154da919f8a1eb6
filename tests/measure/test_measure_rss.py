"""memfit measure's RSS comparison: on the CPU pseudo-device the predicted RSS is the planner's figure
(memfit.estimate.host.node_ram: every process's device lines + cpu_bytes), not cpu_bytes alone."""

import json

import pytest

from memfit.estimate.constants import Profile
from memfit.measure.compare import compare, heap_holes_resident
from memfit.measure.runner import measure, merge_ranks
from memfit.spec.run import run_from_dict

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
          "intermediate_size": 344, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
          "vocab_size": 1024, "max_position_embeddings": 2048, "tie_word_embeddings": False,
          "torch_dtype": "float32"}
P = Profile()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rss") / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    return d


def _record(model_dir, nproc=1, rss=700_000_000, **extra):
    """measure()'s record for a measurement given by hand (no run): the estimate is the real one."""
    run = run_from_dict({"model": str(model_dir), "hardware": "local", "output_dir": str(model_dir.parent / "o"),
                         "strategy": {"method": "full", "precision": "fp32", "seq_len": 512, "micro_batch_size": 2},
                         "distributed": {"nproc": nproc}})
    measured = {"device": "cpu", "peak_allocated_bytes": 60_000_000, "peak_rss_bytes": rss, "components": {},
                "step_seconds": 1.0, "ranks": [{"rank": r, "peak_rss_bytes": rss} for r in range(nproc)], **extra}
    return measure(run, measured=measured)


def _rss_row(rec):
    (row,) = [r for r in rec["rows"] if r["metric"].startswith("RSS")]
    return row


def test_cpu_rss_is_tensors_plus_process(model_dir):
    rec = _record(model_dir)
    mem = rec["predicted"]["memory"]
    heap = mem["gpu_overhead_bytes"]["allocator_fragmentation"]
    assert heap > 0  # the case tells the two figures apart
    # memfit measure's processes unmap every freed block over 64 KiB: RSS holds the tensors, not the heap holes
    tensors = mem["gpu_bytes"]["total"] - heap
    assert tensors == pytest.approx(mem["gpu_allocated_bytes"], abs=1)
    assert mem["cpu_bytes"]["total"] == P.process_baseline_bytes_cpu == 600e6
    row = _rss_row(rec)
    assert (row["component"], row["metric"]) == ("tensors + process", "RSS")
    assert row["predicted"] == tensors + 600e6
    assert rec["error_pct"]["rss"] == round(100 * (tensors + 600e6 - 700e6) / 700e6, 2)
    assert "heap holes" in row["note"] and "MALLOC_MMAP_THRESHOLD_=65536" in row["note"]


def test_cpu_rss_with_glibc_defaults_is_the_planners_figure(model_dir):
    """Measured under glibc's defaults the heap holes are resident: the figure the fits-check uses."""
    from memfit.estimate import estimate
    from memfit.plan.search import ram_need
    from memfit.spec.hardware import parse_hardware
    from memfit.spec.model import resolve_model
    from memfit.spec.strategy import Strategy

    rec = _record(model_dir, malloc_mmap_threshold=None)
    row = _rss_row(rec)
    mem = rec["predicted"]["memory"]
    assert row["component"] == "tensors + heap + process" and "note" not in row
    assert row["predicted"] == mem["gpu_bytes"]["total"] + 600e6
    hw = parse_hardware("local")
    est = estimate(resolve_model(str(model_dir)), hw,
                   Strategy(method="full", precision="fp32", seq_len=512, micro_batch_size=2))
    assert ram_need(est, hw) == pytest.approx(row["predicted"], abs=1)


def test_cpu_rss_two_ranks_per_node(model_dir):
    rec = _record(model_dir, nproc=2, rss=650_000_000)
    mem = rec["predicted"]["memory"]
    tensors = mem["gpu_bytes"]["total"] - mem["gpu_overhead_bytes"]["allocator_fragmentation"]
    row = _rss_row(rec)
    assert (row["component"], row["metric"]) == ("2 × tensors + processes", "RSS, sum of 2 ranks")
    assert row["predicted"] == 2 * tensors + 2 * (600e6 + 120e6)
    assert row["measured"] == 1_300_000_000


def test_gpu_pool_rss_is_cpu_bytes():
    predicted = {"hardware": {"gpu": "A100-80GB", "gpus_per_node": 8},
                 "memory": {"gpu_bytes": {"total": 50e9}, "cpu_bytes": {"total": 40e9}}, "time": {}}
    row = _rss_row(compare(predicted, {"peak_allocated_bytes": 1, "peak_rss_bytes": 20e9}))
    assert (row["component"], row["metric"], row["predicted"]) == ("process", "RSS", 40e9)


def test_heap_holes_follow_the_recorded_threshold():
    assert not heap_holes_resident({})  # memfit measure's own setting (records before the field)
    assert not heap_holes_resident({"malloc_mmap_threshold": 65536})
    assert heap_holes_resident({"malloc_mmap_threshold": None})
    assert heap_holes_resident({"malloc_mmap_threshold": 32 << 20})
    rank = {"rank": 0, "device": "cpu", "peak_allocated_bytes": 1, "components": {}, "malloc_mmap_threshold": 65536}
    assert merge_ranks([rank])["malloc_mmap_threshold"] == 65536
    assert "malloc_mmap_threshold" not in merge_ranks([{k: v for k, v in rank.items()
                                                        if k != "malloc_mmap_threshold"}])


def test_cpu_rss_table_row(model_dir):
    from memfit.cli.measure_view import show_record
    from memfit.cli.output import console, human_bytes

    rec = _record(model_dir)
    row = _rss_row(rec)
    with console.capture() as cap:
        show_record(rec)
    line = next(ln for ln in cap.get().splitlines() if "tensors + process" in ln)
    assert human_bytes(row["predicted"]) in line and "700.00 MB" in line and f"{row['error_pct']:+.1f} %" in line
    assert "heap holes" in cap.get()


def test_cpu_allocated_peak_leaves_out_the_heap_holes(model_dir):
    """The tensor peak is compared with the device lines without glibc's heap holes (freed memory)."""
    from memfit.measure.calibrate import TARGETS

    rec = _record(model_dir)
    mem = rec["predicted"]["memory"]
    (total,) = [r for r in rec["rows"] if (r["component"], r["metric"]) == ("total", "allocated")]
    assert total["predicted"] == mem["gpu_bytes"]["total"] - mem["gpu_overhead_bytes"]["allocator_fragmentation"]
    assert total["predicted"] == pytest.approx(mem["gpu_allocated_bytes"], abs=1)
    assert TARGETS["memory"][0](rec["predicted"]) == total["predicted"]  # calibrate fits the same figure
    (overhead,) = [r for r in rec["rows"] if r["component"] == "overhead"]
    g = mem["gpu_bytes"]  # the overhead line (heap only, on the CPU) goes; step temporaries stay in overhead
    assert g["overhead"] == mem["gpu_overhead_bytes"]["allocator_fragmentation"]
    assert overhead["predicted"] == g["comm_buffers"] + g["step_temporaries"] > 0
