"""The train summary on the CPU compares like with like (#39): the process's peak RSS beside the process's RAM as
the planner predicts it (its device lines + its share of the node's process lines), with the error."""

from rich.console import Console

from memfit.cli.train_view import predicted_process_ram, summary_table


def test_cpu_summary_shows_the_process_ram_prediction_and_its_error():
    pred = {"hardware": {"gpus_per_node": 2},
            "memory": {"gpu_bytes": {"total": 120e6}, "cpu_bytes": {"total": 1.4e9}},
            "time": {"step_seconds": 0.1}}
    assert predicted_process_ram(pred) == 120e6 + 0.7e9
    result = {"method": "lora", "steps": 3, "peak_mem_kind": "peak_rss", "peak_mem_bytes": 800e6,
              "step_time_s": 0.1, "predicted": pred}
    con = Console(width=200, record=True)
    con.print(summary_table(result))
    text = con.export_text()
    assert "820.00 MB (process RAM)" in text and "+2%" in text and "n/a" not in text
    assert predicted_process_ram({"memory": {}}) is None
