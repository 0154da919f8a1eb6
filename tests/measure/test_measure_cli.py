"""memfit measure / calibrate end to end on a micro model: fresh processes, JSON contract, a profile."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memfit.measure.worker import synthetic_text_records  # noqa: E402


def memfit(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "memfit", *args], capture_output=True, text=True,
                          timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"memfit {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("measure")
    texts = [r["text"] for r in synthetic_text_records(60, 64, seed=3)]
    model = tiny_model_dir("measure", texts, hidden_size=48, vocab_size=400, max_position_embeddings=256)
    return model, root


def test_measure_sweep_json_and_calibrate(micro_model):
    model, root = micro_model
    runs = root / "runs"
    proc = memfit("measure", "--model", str(model), "--method", "lora", "--precision", "fp32",
                  "--seq-len", "128", "--batch-size", "2", "--steps", "1", "--sweep",
                  "gradient_checkpointing=false,true", "--out", str(runs), "--json")
    records = json.loads(proc.stdout)
    assert len(records) == 2
    for rec in records:
        m = rec["measured"]
        assert set(rec) >= {"predicted", "measured", "error_pct"}
        assert m["peak_allocated_bytes"] > 0 and m["peak_rss_bytes"] > m["peak_allocated_bytes"]
        assert sum(m["components"].values()) == m["peak_allocated_bytes"]  # breakdown sums to the total
        assert m["components"]["parameters"] > 0 and m["step_seconds"] > 0
        assert len(m["ranks"]) == 1 and m["ranks"][0]["rank"] == 0
        assert m["peak_reserved_bytes"] is None  # CPU: no caching allocator
        if rec["predicted"] is not None:
            # allocated: the device lines without glibc's heap holes (allocator_fragmentation on the CPU)
            total = rec["predicted"]["memory"]["gpu_allocated_bytes"]
            want = round(100 * (total - m["peak_allocated_bytes"]) / m["peak_allocated_bytes"], 2)
            assert rec["error_pct"]["total"] == want
            # CPU pseudo-device: RSS holds this process's tensors + its baseline (no heap holes: the
            # measured process unmaps freed blocks over 64 KiB)
            assert m["malloc_mmap_threshold"] == 65536
            mem = rec["predicted"]["memory"]
            (rss,) = [r for r in rec["rows"] if r["metric"] == "RSS"]
            assert rss["component"] == "tensors + process"
            assert rss["predicted"] == pytest.approx(mem["gpu_allocated_bytes"] + mem["cpu_bytes"]["total"], abs=1)
            assert rss["measured"] == m["peak_rss_bytes"]
    no_gc, gc = records
    assert gc["run"]["strategy"]["gradient_checkpointing"] is True
    assert gc["measured"]["components"]["activations"] < no_gc["measured"]["components"]["activations"]
    assert len(list(runs.glob("*.json"))) == 2

    out = root / "calibrated.json"
    cal = json.loads(memfit("calibrate", "--runs", str(runs), "--out", str(out),
                            "--memory-constants", "activation_scale", "--time-constants", "none",
                            "--json").stdout)
    fit = cal["fits"][0]
    assert fit["target"] == "memory" and "activation_scale" in cal["calibrated"]
    assert fit["rms_error_pct_after"] <= fit["rms_error_pct_before"]
    from memfit.estimate.constants import Profile

    assert Profile.load(out).activation_scale == pytest.approx(fit["fitted"]["activation_scale"])


@pytest.mark.parametrize("args, message", [
    ((), "missing RUN_FILE or --model"),
    (("--model", "m", "--sweep", "seq_len"), "expected KEY=V1,V2"),
    (("no-such-run.yaml",), "not found"),
])
def test_measure_errors_are_one_line(args, message):
    proc = memfit("measure", *args, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_calibrate_missing_folder(tmp_path):
    proc = memfit("calibrate", "--runs", str(tmp_path / "nope"), check=False)
    assert proc.returncode == 2 and "no such folder" in proc.stderr
