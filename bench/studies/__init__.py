"""One-off studies on this machine (time, memory, published runs beyond the bars, MEFT): their figures are
quoted in docs/, none is shipped. They may import the pipeline (``from bench import time_grid``); the pipeline
never imports them. Run from the repository root: ``PYTHONPATH=. .venv/bin/python bench/studies/NAME.py``.
"""
