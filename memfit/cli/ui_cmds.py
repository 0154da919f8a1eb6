"""CLI command ``ui``: the planner as a local web page (registered by memfit.cli.app). Thin: checks the
``[ui]`` extra, starts memfit.ui.page, prints where it is, waits for Ctrl+C."""

from __future__ import annotations

from typing import Optional

import typer


def ui_command(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (127.0.0.1: this machine "
                             "only; 0.0.0.0: every interface)."),
    port: int = typer.Option(7860, "--port", help="Port to listen on."),
    runs: str = typer.Option("runs", "--runs", help="Folder whose run folders the Runs tab lists."),
    open_browser: bool = typer.Option(False, "--open", help="Open the page in the default browser."),
) -> None:
    """Open memfit's planner as a web page: inputs, recommendation, charts, downloads, run reports."""
    from memfit.cli.extras import installed
    from memfit.errors import MemfitError

    if not (installed("gradio") and installed("pandas")):
        raise MemfitError("memfit ui needs the ui extra: pip install 'memfit[ui]'")
    if not 0 < port < 65536:
        raise MemfitError(f"--port {port}: give a port from 1 to 65535")
    from memfit.ui.page import start

    try:
        page, url = start(host, port, runs, open_browser)
    except OSError as err:
        raise MemfitError(f"memfit ui cannot listen on {host}:{port} ({err}); pick another --port") from None
    print(f"memfit ui: {url}  (Ctrl+C to stop)", flush=True)
    page.block_thread()


def register(app: typer.Typer, name: Optional[str] = "ui") -> None:
    """Add ``ui`` to ``app``."""
    app.command(name)(ui_command)
