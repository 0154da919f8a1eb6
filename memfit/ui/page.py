"""The Gradio page of ``memfit ui``. The only module that imports gradio (inside its functions, so
``import memfit.ui.page`` costs nothing); every number comes from memfit.ui.handlers."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any, Optional

from memfit.ui import handlers

TITLE = "memfit — will it fit, and what is fastest?"
CSS = "#memfit-message p {color: #b00020; font-weight: 600}"


def _theme(gr: Any) -> Any:
    """Gradio's default look with the system's fonts (the page fetches nothing from the internet)."""
    return gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                             font_mono=["ui-monospace", "monospace"])


def _model_inputs(gr: Any) -> list:
    from memfit.spec.model import list_presets

    source = gr.Radio(["preset", "folder", "config.json"], value="preset", label="model from",
                      elem_id="memfit-source")
    preset = gr.Dropdown(list_presets(), value="llama-2-7b", label="preset (type to search)", filterable=True,
                         elem_id="memfit-preset")
    folder = gr.Textbox(label="local model folder (its config.json)", visible=False, elem_id="memfit-folder")
    text = gr.Textbox(label="paste config.json", lines=5, visible=False, elem_id="memfit-config-text")
    upload = gr.File(label="or upload config.json", file_types=[".json"], type="filepath", visible=False,
                     elem_id="memfit-config-file")

    def show(which: str) -> list:
        return [gr.update(visible=which == "preset"), gr.update(visible=which == "folder"),
                gr.update(visible=which == "config.json"), gr.update(visible=which == "config.json")]

    source.change(show, source, [preset, folder, text, upload], queue=False)
    return [source, preset, folder, text, upload]


def _pool_inputs(gr: Any) -> list:
    from memfit.methods import NAMES, PLANNED
    from memfit.spec.hardware import catalog_names

    gpu = gr.Dropdown(catalog_names(), value="RTX4090-24GB", label="GPU kind", filterable=True,
                      elem_id="memfit-gpu")
    with gr.Row():
        count = gr.Number(1, label="GPUs per node", precision=0, minimum=0, elem_id="memfit-count")
        nodes = gr.Number(1, label="nodes", precision=0, minimum=0, elem_id="memfit-nodes")
    with gr.Row():
        custom = gr.Number(0, label="custom GB per GPU (0: the catalog's)", elem_id="memfit-custom-gb")
        ram = gr.Number(0, label="CPU RAM per node, GB (0: default)", elem_id="memfit-cpu-ram")
    with gr.Row():
        seq = gr.Number(512, label="sequence length", precision=0, minimum=0, elem_id="memfit-seq-len")
        micro = gr.Number(1, label="micro-batch", precision=0, minimum=0, elem_id="memfit-micro-batch")
        accum = gr.Number(1, label="grad. accumulation", precision=0, minimum=0, elem_id="memfit-grad-accum")
    methods = gr.CheckboxGroup(list(NAMES), value=list(PLANNED), label="methods to consider",
                               elem_id="memfit-methods")
    margin = gr.Number(0.05, label="margin (fraction of each GPU kept free)", elem_id="memfit-margin")
    return [gpu, count, nodes, custom, ram, seq, micro, accum, methods, margin, *_lever_inputs(gr)]


def _lever_inputs(gr: Any) -> list:
    """The long-context levers (memfit plan's --sequence-parallel, --context-parallel, --activation-offload,
    --tiled-mlp); left at the planner's choice, the planner tries them where nothing fits without them. Liger Kernel
    (--liger) is the user's to turn on."""
    from memfit.ui.form import CHOICE, OFFLOADS, TILED

    with gr.Accordion("long-context levers", open=False, elem_id="memfit-levers"):
        with gr.Row():
            sp = gr.Number(0, label="sequence parallel (Ulysses) GPUs (0: planner's choice, 1: off)", precision=0,
                           minimum=0, elem_id="memfit-sequence-parallel")
            cp = gr.Number(0, label="context parallel GPUs (0: planner's choice, 1: off)", precision=0, minimum=0,
                           elem_id="memfit-context-parallel")
        with gr.Row():
            offload = gr.Dropdown(list(OFFLOADS), value=CHOICE, label="activation offload",
                                  elem_id="memfit-activation-offload")
            tiled = gr.Dropdown(list(TILED), value=CHOICE, label="tiled MLP", elem_id="memfit-tiled-mlp")
            liger = gr.Dropdown(["off", "on"], value="off", label="Liger Kernel (GPUs; its fused loss)",
                                elem_id="memfit-liger")
    return [sp, cp, offload, tiled, liger]


def _plan_outputs(gr: Any) -> list:
    message = gr.Markdown(elem_id="memfit-message")
    headline = gr.Markdown(elem_id="memfit-headline", visible=False)
    text = gr.Markdown(elem_id="memfit-recommendation")
    from memfit.ui.charts import COLORS, LEGEND

    bars = gr.BarPlot(x="plan", y="GB", color="component", tooltip=["plan", "component", "GB", "note"],
                      color_map=COLORS, colors_in_legend=LEGEND,
                      title="Memory per GPU (GB): recommended ★ and runner-ups, up to the card's capacity",
                      height=400, elem_id="memfit-bars")
    scatter = gr.ScatterPlot(x="GB/GPU", y="s/step", color="verdict", tooltip="all", height=360,
                             color_map={"fits": "#2a9d4b", "does not fit": "#d9534f"},
                             title="Every combination priced: step time vs memory per GPU",
                             elem_id="memfit-scatter")
    table = gr.Dataframe(label="fastest that fit", interactive=False, elem_id="memfit-runner-ups")
    files = gr.File(label="downloads: run.yaml + the engine's files (as plan --emit writes them), plan.json",
                    file_count="multiple", interactive=False, elem_id="memfit-downloads")
    command = gr.Code(label="the same plan on the command line", language="shell", interactive=False,
                      elem_id="memfit-command")
    return [message, headline, text, bars, scatter, table, command], files


def _pool_tables(gr: Any, inputs: list, workdir: Path) -> None:
    with gr.Tab("Model × context (memfit matrix)"):
        go = gr.Button("Plan the matrix for this pool", elem_id="memfit-matrix-go")
        msg = gr.Markdown()
        table = gr.Dataframe(interactive=False, elem_id="memfit-matrix")
        go.click(handlers.matrix_page, inputs, [msg, table])
    with gr.Tab("GPU count and cost (plan --gpu)"):
        with gr.Row():
            most = gr.Number(8, label="up to GPUs", precision=0)
            price = gr.Number(0, label="price per GPU-hour (0: none)")
            tokens = gr.Number(0, label="tokens to train on (0: none)", precision=0)
        go = gr.Button("Search the GPU count", elem_id="memfit-count-go")
        msg = gr.Markdown()
        table = gr.Dataframe(interactive=False, elem_id="memfit-count-table")
        go.click(functools.partial(handlers.count_page, workdir), [most, price, tokens] + inputs, [msg, table])


def _plan_tab(gr: Any, workdir: Path) -> tuple:
    with gr.Row():
        with gr.Column(scale=1, min_width=320):
            inputs = _model_inputs(gr) + _pool_inputs(gr)
            go = gr.Button("Plan", variant="primary", elem_id="memfit-plan")
        with gr.Column(scale=2):
            outputs, files = _plan_outputs(gr)
            _pool_tables(gr, inputs, workdir)

    asked = gr.State(None)  # this browser's last question: leaving a box unchanged asks nothing

    def answer(last: Any, *values: Any) -> tuple:
        key = repr(values)
        if key == last:
            return (gr.skip(),) * (len(outputs) + 1)
        return (*handlers.plan_page(workdir, *values, files=False).as_tuple(), key)

    def downloads(*values: Any) -> Any:
        return handlers.files_page(workdir, *values) or None

    # typed boxes answer when the edit is done (Enter or leaving the box), not at every keystroke
    typed = [c for c in inputs if isinstance(c, (gr.Number, gr.Textbox))]
    triggers = [go.click] + [c.submit for c in typed] + [c.blur for c in typed] \
        + [c.change for c in inputs if c not in typed and not isinstance(c, gr.Radio)]
    gr.on(triggers, answer, [asked] + inputs, outputs + [asked], trigger_mode="always_last",
          concurrency_limit=1).then(downloads, inputs, files)
    return [asked] + inputs, outputs + [asked], answer, downloads, files


def _runs_tab(gr: Any, runs_dir: str) -> None:
    with gr.Row():
        folder = gr.Textbox(runs_dir, label="runs folder", elem_id="memfit-runs-folder", scale=3)
        go = gr.Button("List runs", elem_id="memfit-runs-go", scale=1)
    msg = gr.Markdown(elem_id="memfit-runs-message")
    table = gr.Dataframe(interactive=False, elem_id="memfit-runs")
    pick = gr.Dropdown([], label="run", elem_id="memfit-run-pick", allow_custom_value=True)
    note = gr.Markdown(elem_id="memfit-report-note")
    frame = gr.HTML(elem_id="memfit-report")

    def listed(path: str) -> tuple:
        message, rows, choices = handlers.runs_page(path)
        return message, rows, gr.update(choices=choices, value=choices[0] if choices else None)

    go.click(listed, folder, [msg, table, pick])
    pick.change(handlers.report_page, pick, [note, frame])


def build(runs_dir: Optional[str] = "runs", workdir: Optional[Path] = None) -> Any:
    """The page (a gr.Blocks); ``workdir`` holds the files offered for download. ``runs_dir=None`` leaves
    out the Runs tab (it reads run folders on the server: leave it out on a public host)."""
    import gradio as gr

    workdir = Path(workdir or tempfile.mkdtemp(prefix="memfit-ui-"))
    with gr.Blocks(title="memfit") as page:
        gr.Markdown(f"## {TITLE}\nThe planner of `memfit plan`, on a page: every number is the command's.")
        with gr.Tab("Plan"):
            inputs, outputs, answer, downloads, files = _plan_tab(gr, workdir)
        if runs_dir is not None:
            with gr.Tab("Runs and reports"):
                _runs_tab(gr, runs_dir)
        page.load(answer, inputs, outputs).then(downloads, inputs[1:], files)
    return page


def start(host: str = "127.0.0.1", port: Optional[int] = None, runs_dir: str = "runs",
          open_browser: bool = False) -> tuple[Any, str]:
    """Start the page in the background; (the page, its local URL). ``page.block_thread()`` waits."""
    import os

    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    import gradio as gr

    page = build(runs_dir)
    page.queue(default_concurrency_limit=2)
    _, url, _ = page.launch(server_name=host, server_port=port, inbrowser=open_browser, share=False,
                            quiet=True, prevent_thread_lock=True, theme=_theme(gr), css=CSS, footer_links=[],
                            show_error=False)
    return page, url
