"""memfit: make LLM fine-tuning fit the hardware you have, and prove it with measurements.

Importing this package (and the planning side: ``memfit.spec``, ``memfit.estimate``, ``memfit.plan``)
never imports torch.
"""

__version__ = "0.1.0"
