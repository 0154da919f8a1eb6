"""Measurement: memory probes, a fresh-process runner, measured-vs-predicted comparison, calibration of
the estimator's free constants, the engines' per-rank matrix (``engine_matrix``, ``rank_state``).

This package imports torch lazily: ``compare`` and ``calibrate`` are plain Python; ``probe``,
``callback``, ``worker`` and ``engine_matrix`` need torch.
"""
