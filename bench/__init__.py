"""The bench pipeline: the scripts that write the figures memfit ships and the files that check them.

Its modules score memfit's estimate against published GPU runs and memfit's own GPU checks, fit the Profile
constants those runs decide, label each error bar by provenance and write the shipped JSON
(``memfit/estimate/published_accuracy.json``, ``memfit/steptime/published_time_accuracy.json``,
``memfit/methods/peft/host_ops.json``) and the figure blocks of README.md and docs/. They import each other as
``from bench import gpu_published`` and are run from the repository root, ``PYTHONPATH=. .venv/bin/python
bench/NAME.py``; tests import them the same way. One-off studies live in ``bench.studies``, apart from the
pipeline (bench/README.md).
"""
