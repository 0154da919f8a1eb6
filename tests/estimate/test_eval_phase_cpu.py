"""The evaluation phase measured on the CPU (#39 item 5): a no_grad forward with the loss (what Trainer.evaluate runs
with prediction_loss_only) on the demo model, its allocator-level peak beyond the live weights (the profiler's raw
allocation events, as memfit measure reads them) against the estimate's evaluation phase less its static lines
(memfit.estimate.phases.forward_set): within 5 %."""

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    from memfit.train.demo import ensure_demo_assets

    return ensure_demo_assets(tmp_path_factory.mktemp("demo"))[0]


def _measured(run, b, s) -> int:
    from torch.profiler import ProfilerActivity, profile

    from memfit.measure.alloc_events import raw_event_peak
    from memfit.train.model import build_model

    torch.manual_seed(0)
    model, _, _ = build_model(run, tokenizer=False)
    model.eval()  # as Trainer.evaluate: dropout off
    ids = torch.randint(0, 400, (b, s))
    with torch.no_grad():
        model(input_ids=ids, labels=ids)  # warm
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model(input_ids=ids, labels=ids).loss.item()
    return raw_event_peak(prof.profiler.kineto_results, "cpu")


@pytest.mark.parametrize("method, b, s, attention", [("full", 8, 128, "sdpa"), ("lora", 8, 128, "sdpa"),
                                                     ("full", 4, 256, "eager")])
def test_eval_forward_peak_within_5_percent(demo_model, method, b, s, attention):
    from memfit.resolve import predict
    from memfit.spec.run import run_from_dict

    run = run_from_dict({"model": str(demo_model), "hardware": "local", "strategy": {
        "method": method, "precision": "fp32", "seq_len": s, "micro_batch_size": b, "attention": attention}})
    est = predict(run)
    predicted = est.phases["eval"][0] - est.gpu["weights"] - est.gpu["optimizer"]
    measured = _measured(run, b, s)
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)
