"""Sharded and multi-process training: DeepSpeed ZeRO / FSDP configuration, launch, pre-flight checks."""
