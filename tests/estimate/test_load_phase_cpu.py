"""The loading phase on this CPU (issue 39 item 5): a fresh process's RSS once memfit train's build_model has
loaded the model, against the estimate's load-phase figure (its process RAM: node_ram over the node's
processes). The baseline constants (process_baseline_load_cpu, process_peft_import_cpu) were measured on the demo
model, so those two rows are in-sample; the 24M-parameter model checks the weights' term (safetensors in the
loaded dtype stay memory-mapped, not resident), a rule written after measuring it: a development figure."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from memfit.estimate import estimate  # noqa: E402
from memfit.spec.hardware import parse_hardware  # noqa: E402
from memfit.spec.model import resolve_model  # noqa: E402
from memfit.spec.strategy import Strategy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, sys
from pathlib import Path
from memfit.spec.run import run_from_dict
from memfit.train.demo import demo_run_dict
from memfit.train.model import build_model
d = Path(sys.argv[1])
rd = demo_run_dict(d, d / "data.jsonl", d / "out")
rd["strategy"]["method"] = sys.argv[2]
build_model(run_from_dict(rd))
print(json.dumps({f: int(l.split()[1]) * 1024 for l in open("/proc/self/status")
                  for f in ("VmRSS",) if l.startswith(f + ":")}))
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from memfit.train.demo import TinyModelConfig, build_tiny_model

    root = tmp_path_factory.mktemp("load")
    build_tiny_model(root / "demo")
    build_tiny_model(root / "24m", TinyModelConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                                   num_attention_heads=8, num_key_value_heads=4))
    return root


def _measured(model_dir: Path, method: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, str(model_dir), method], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["VmRSS"])


def _predicted(model_dir: Path, method: str) -> float:
    hw = parse_hardware("local")
    est = estimate(resolve_model(str(model_dir)), hw, Strategy(method=method, precision="fp32", seq_len=128,
                                                               micro_batch_size=8, lora_dropout=0.0))
    device, host = est.phases["load"]
    return device + host / hw.gpus_per_node


@pytest.mark.parametrize("name,method", [("demo", "full"), ("demo", "lora"), ("24m", "full")])
def test_the_loaded_process_rss_is_within_5_percent(models, name, method):
    measured, predicted = _measured(models / name, method), _predicted(models / name, method)
    assert predicted == pytest.approx(measured, rel=0.05), (measured, predicted)
