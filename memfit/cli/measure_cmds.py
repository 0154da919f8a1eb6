"""CLI commands for the measure side: ``measure`` and ``calibrate`` (registered by memfit.cli.app).

Thin: build the RunSpecs, call memfit.measure, format the comparison. torch is imported only inside the
measured subprocesses (memfit.measure.worker); this module and what it calls in-process stay plain Python.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

from memfit.errors import ConfigError

OUT = "Output"
R = "Measurement"


def _hardware(gpus: Optional[str], trace_only: bool) -> str:
    """measure runs on this machine: --gpus local (or auto); another pool only for --trace-only."""
    if gpus is None:
        return "local"
    text = gpus.strip()
    if not text:
        raise ConfigError("--gpus is empty; memfit measure runs on this machine: give --gpus local "
                          "(or leave it out)")
    if text.lower() in ("local", "auto") or trace_only:
        from memfit.spec.hardware import parse_hardware

        parse_hardware(text)  # a malformed pool is one line here, not later
        return text
    raise ConfigError(f"--gpus {gpus}: memfit measure runs here, on this machine, so it cannot measure "
                      "another pool; use --gpus local, or `memfit estimate --gpus ...` to predict that pool")


def _runs(run_file: Optional[Path], model: Optional[str], overrides: list[str], sweeps: list[str],
          keys: dict[str, Any], hardware: str = "local", cpu_ram: Optional[str] = None) -> list[Any]:
    """One RunSpec per sweep combination, from a run file or from the estimate-style flags."""
    from memfit.measure.runner import sweep_overrides
    from memfit.spec.run import load_run, run_from_dict

    combos = sweep_overrides(sweeps)
    if run_file is not None:
        if model is not None or keys:
            raise ConfigError("give either a run file or --model with strategy flags, not both "
                              "(use --set KEY=VALUE to change a run file)")
        return [load_run(run_file, overrides + combo) for combo in combos]
    if model is None:
        raise ConfigError("missing RUN_FILE or --model: `memfit measure run.yaml` or "
                          "`memfit measure --model DIR --method lora --seq-len 256`")
    if "precision" not in keys:
        keys["precision"] = _local_precision()
    raw = {"model": model, "hardware": hardware, "cpu_ram": cpu_ram, "strategy": keys,
           "output_dir": "runs/measure"}
    return [run_from_dict(raw, overrides + combo, source="memfit measure") for combo in combos]


def _local_precision() -> str:
    """What this machine trains in by default (the planner's rule: fp32 on the CPU)."""
    from memfit.plan.rules import default_precision
    from memfit.spec.hardware import parse_hardware

    return default_precision(parse_hardware("local"))


def _label(run: Any, combo_index: int) -> str:
    s = run.strategy
    return (f"{combo_index:02d}-{s.method}-{s.engine}-{'gc' if s.gradient_checkpointing else 'nogc'}-"
            f"{s.attention}-s{s.seq_len}-b{s.micro_batch_size}")


def measure_cmd(
    run_file: Optional[Path] = typer.Argument(None, help="Run file (YAML); or give --model and strategy flags."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Local model folder (with weights) or Hub id "
                                         "owner/name[@revision]."),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="'local' (measure runs on this machine; "
                                       "another pool only with --trace-only)."),
    cpu_ram: Optional[str] = typer.Option(None, "--cpu-ram", help="CPU RAM of this node for the prediction, "
                                          "e.g. 64GB (default: detected)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per sequence."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Micro-batch per process."),
    grad_accum: Optional[int] = typer.Option(None, "--grad-accum", help="Gradient accumulation steps."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help="Override a key, e.g. --set lora.r=32."),
    sweeps: Optional[List[str]] = typer.Option(None, "--sweep", help="KEY=V1,V2 (repeatable; cartesian "
                                               "product), e.g. --sweep gradient_checkpointing=true,false",
                                               rich_help_panel=R),
    steps: int = typer.Option(3, "--steps", help="Measured steps (after warm-up).", rich_help_panel=R),
    warmup: int = typer.Option(1, "--warmup", help="Warm-up steps, not measured.", rich_help_panel=R),
    timeout: float = typer.Option(1800, "--timeout", help="Seconds allowed per configuration.",
                                  rich_help_panel=R),
    out: Optional[Path] = typer.Option(None, "--out", help="Save each measurement as JSON here "
                                       "(input for `memfit calibrate --runs`).", rich_help_panel=OUT),
    traced: bool = typer.Option(False, "--traced", help="Also trace the step under FakeTensorMode (no "
                                "compute) and compare that estimate with the same measured peak.",
                                rich_help_panel=R),
    trace_only: bool = typer.Option(False, "--trace-only", help="Only the traced estimate (seconds, works for "
                                    "presets and big models): traced vs predicted, no training.",
                                    rich_help_panel=R),
    profile: Optional[Path] = typer.Option(None, "--profile", help="Predict with calibrated constants."),
    json_: bool = typer.Option(False, "--json", help="Print JSON only.", rich_help_panel=OUT),
    **strategy_flags: Any,
) -> None:
    """Run a few real steps in a fresh process per configuration: measured vs predicted memory and time."""
    from memfit.cli.extras import require, require_for_runs
    from memfit.cli.output import console, err_console, print_json
    from memfit.measure.runner import measure, save_record

    require("measure", "train")
    keys = _strategy_keys(strategy_flags)
    for name, value in (("seq_len", seq_len), ("micro_batch_size", batch_size), ("grad_accum", grad_accum)):
        if value is not None:
            keys[name] = value
    runs = _runs(run_file, model, list(overrides or []), list(sweeps or []), keys,
                 _hardware(gpus, trace_only), cpu_ram)
    if not trace_only:
        require_for_runs("measure", runs)
    prof = None
    if profile is not None:
        from memfit.estimate.constants import Profile

        prof = Profile.load(profile)
    records = []
    status = err_console if json_ else console
    if trace_only:
        _trace_only(runs, prof, json_, status)
        return
    for i, run in enumerate(runs):
        with status.status(f"measuring {i + 1}/{len(runs)}: {run.strategy.label()} seq {run.strategy.seq_len} "
                           f"micro-batch {run.strategy.micro_batch_size} ({warmup} warm-up + {steps} steps)"):
            rec = measure(run, warmup=warmup, steps=steps, profile=prof, timeout=timeout, traced=traced)
        if out is not None:
            rec["saved_to"] = str(save_record(rec, out, _label(run, i)))
        records.append(rec)
        if not json_:
            from memfit.cli.measure_view import show_record

            show_record(rec)
    if json_:
        print_json(records[0] if len(records) == 1 else records)
    elif len(records) > 1:
        from memfit.cli.measure_view import show_sweep

        show_sweep(records)


def _trace_only(runs: list[Any], prof: Any, json_: bool, status: Any) -> None:
    from memfit.cli.output import print_json
    from memfit.measure.compare import error_pct, predicted_memory
    from memfit.measure.runner import predict, run_traced_process

    out = []
    for i, run in enumerate(runs):
        with status.status(f"tracing {i + 1}/{len(runs)}: {run.strategy.label()} seq {run.strategy.seq_len} "
                           f"micro-batch {run.strategy.micro_batch_size}"):
            trace = run_traced_process(run)
        predicted = predict(run, prof)
        total = predicted_memory(predicted or {}).get("total")
        out.append({"label": run.strategy.label(), "seq_len": run.strategy.seq_len,
                    "micro_batch_size": run.strategy.micro_batch_size, "predicted": predicted, "traced": trace,
                    "error_pct": {"total_vs_traced": error_pct(total, trace["peak_bytes"])}})
    if json_:
        print_json(out[0] if len(out) == 1 else out)
    else:
        from memfit.cli.measure_view import show_traces

        show_traces(out)


def _strategy_keys(flags: dict[str, Any]) -> dict[str, Any]:
    if not flags:
        return {}
    from memfit.cli.plan_cmds import _fixed_keys

    return _fixed_keys(**flags)


def calibrate_cmd(
    runs: Optional[Path] = typer.Option(None, "--runs", help="Folder of measurements (from `memfit measure --out`)."),
    hardware: bool = typer.Option(False, "--hardware", help="Time this machine's GEMMs, attention, bandwidth, "
                                  "optimizer, copies and collectives (~20 s) into the cached hardware profile "
                                  "the time model uses for --gpus local."),
    force: bool = typer.Option(False, "--force", help="With --hardware: measure again even if cached."),
    out: Path = typer.Option(Path("calibrated.json"), "--out", help="Profile file to write."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="Start from this profile (default: built-in)."),
    memory_constants: Optional[str] = typer.Option(None, "--memory-constants", help="Comma-separated "
                                                   "constants fitted to the allocated peak instead of the "
                                                   "default memory fits (logits_bytes_* to the measured logits, "
                                                   "then activation_scale, checkpoint_extra_layers to the "
                                                   "allocated peak)."),
    time_constants: Optional[str] = typer.Option(None, "--time-constants", help="Comma-separated constants "
                                                 "fitted to step time (default: gemm_max_fraction, utilization_fp32, "
                                                 "utilization_cpu; 'none' to skip)."),
    json_: bool = typer.Option(False, "--json", help="Print JSON only."),
) -> None:
    """Measure this machine (--hardware), or fit the estimator's free constants to saved measurements
    (--runs) and write a profile for --profile."""
    from memfit.errors import ConfigError

    if hardware:
        from memfit.cli.hardware_cmds import calibrate_hardware_cmd

        calibrate_hardware_cmd(force, json_)
        if runs is None:
            return
    if runs is None:
        raise ConfigError("calibrate: give --hardware (time this machine) or --runs DIR (fit the constants "
                          "to measurements from `memfit measure --out DIR`)")
    from memfit.cli.output import print_json
    from memfit.estimate.constants import Profile
    from memfit.measure.calibrate import (DEFAULT_PLAN, calibrate, load_records, run_estimate_fn, save_profile,
                                          total_errors)
    from memfit.measure.compare import summarize

    def names(text: str) -> list[str]:
        return [] if text.strip().lower() == "none" else [t.strip() for t in text.split(",") if t.strip()]

    plan = [(t, list(f)) for t, f in DEFAULT_PLAN]
    if memory_constants is not None:
        plan = [("memory", names(memory_constants))] + [p for p in plan if p[0] == "time"]
    if time_constants is not None:
        plan = [p for p in plan if p[0] != "time"] + [("time", names(time_constants))]
    records = load_records(runs)
    base = Profile.load(profile) if profile is not None else Profile()
    fn = run_estimate_fn()
    fitted, reports = calibrate(records, base, fn, plan=plan)
    path = save_profile(fitted, out)
    before, after = summarize(total_errors(records, base, fn)), summarize(total_errors(records, fitted, fn))
    if json_:
        print_json({"profile": str(path), "records": len(records), "fits": reports,
                    "calibrated": fitted.calibrated, "total_error_before": before, "total_error_after": after})
    else:
        from memfit.cli.measure_view import show_calibration

        show_calibration(reports, path, len(records), before, after)


def register(app: typer.Typer) -> None:
    """Add ``measure`` and ``calibrate`` to ``app``."""
    from memfit.cli.plan_cmds import _with_strategy_flags

    app.command("measure")(_with_strategy_flags(measure_cmd))
    app.command("calibrate")(calibrate_cmd)
