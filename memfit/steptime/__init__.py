"""The GPU step-time model, from parts: GEMMs by shape (gemm), attention kernels by sequence length
(attention), memory-bound work by bytes and transfer size (GpuRates.bandwidth), the host's dispatch (host),
per catalog GPU kind (devices, rates); ``micro`` puts one micro-batch together. What a layer's work is
(bytes, ops) is counted once for every device in ``work``; the CPU's own mechanisms stay with its
calibrated model (memfit.estimate.speeds, faults)."""
