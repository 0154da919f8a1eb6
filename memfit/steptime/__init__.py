"""The step-time model, from parts. ``step`` puts one optimizer step together; a micro-batch is priced by
``micro`` on a catalog GPU (``gemm``, ``attention``, ``host``, at its kind's ``rates`` from ``devices``) or by
``measured`` at the speeds ``memfit calibrate --hardware`` measured (``speeds``); ``comm`` holds the engines'
collectives, ``loop`` the optimizer phase and the HF Trainer's own loop. What a layer's work is (bytes, ops)
is counted once for every device in ``work``; the CPU's own mechanisms (first-touch page faults, glibc's
thresholds, the CPU flash kernel's blocks) live in ``cpu`` and ``engine_host``, off every GPU estimate's
path. ``accuracy`` reads the held-out error on published GPU runs."""

# the parts of a step the CLI's and the page's step line name, in order (keys of the estimate's ``time``)
STEP_PARTS = ("compute_seconds", "optimizer_seconds", "trainer_seconds", "comm_exposed_seconds", "offload_seconds",
              "upload_seconds", "cpu_optimizer_seconds", "meft_seconds", "engine_seconds")
