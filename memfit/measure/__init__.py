"""Measurement: memory probes, a fresh-process runner, measured-vs-predicted comparison, calibration of
the estimator's free constants, and ``train --fallback``.

This package imports torch lazily: ``compare`` and ``calibrate`` are plain Python and can be used by the
planning side; ``probe``, ``callback``, ``worker`` and ``fallback`` need torch.
"""
