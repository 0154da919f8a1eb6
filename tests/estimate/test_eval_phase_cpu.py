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


@pytest.mark.parametrize("keep", [False, True])
def test_trainer_evaluate_with_and_without_kept_logits_within_5_percent(demo_model, tmp_path, keep):
    """transformers' Trainer.evaluate on 16 sequences at 4 per batch: loss only (no compute_metrics, memfit train's
    way), or with compute_metrics, every batch's logits concatenated onto the kept ones (EvalLoopContainer)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from memfit.measure.alloc_events import raw_event_peak
    from memfit.resolve import predict
    from memfit.spec.run import run_from_dict

    b, s, n = 4, 128, 16
    model = AutoModelForCausalLM.from_pretrained(str(demo_model), dtype=torch.float32)
    torch.manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 400, (s,)), "labels": torch.randint(0, 400, (s,))} for _ in range(n)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=b, use_cpu=True, report_to="none",
                             disable_tqdm=True, remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, eval_dataset=rows,
                      data_collator=lambda batch: {k: torch.stack([r[k] for r in batch]) for k in batch[0]},
                      compute_metrics=(lambda p: {"n": float(len(p.predictions))}) if keep else None)
    trainer.evaluate()  # warm
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.evaluate()
    measured = raw_event_peak(prof.profiler.kineto_results, "cpu")
    run = run_from_dict({"model": str(demo_model), "hardware": "local", "eval": {"loss_only": not keep, "examples": n},
                         "strategy": {"method": "full", "precision": "fp32", "seq_len": s, "micro_batch_size": b}})
    est = predict(run)
    predicted = est.phases["eval"][0] - est.gpu["weights"] - est.gpu["optimizer"]
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)
