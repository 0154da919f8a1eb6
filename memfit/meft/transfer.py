"""Host<->device copies of one MEFT layer, and the byte counters they feed.

Every copy between the CPU store side and the model's device goes through ``Transfer``, which counts
the bytes where the copy is made (``Traffic``). On CUDA the copies run on a separate stream from
pinned staging buffers with ``non_blocking=True`` and are ordered with events, so they overlap with
the FFN's compute; on CPU the same calls copy synchronously (the "device buffers" are then plain CPU
tensors, but the copies and their accounting still happen, so the byte counts are the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class Traffic:
    """Byte counters shared by all layers of a model.

    ``current``: bytes moved since the last optimizer step (or ``reset``): the forward and backward of
    every micro-batch of the step in progress. ``last``: the bytes of the last completed optimizer
    step (``close_step`` moves ``current`` there). ``total``: since the adapter was added.
    """

    current: dict = field(default_factory=lambda: {"h2d": 0, "d2h": 0, "keys_scored": 0, "dropped": 0})
    last: Optional[dict] = None
    total: dict = field(default_factory=lambda: {"h2d": 0, "d2h": 0})
    steps: int = 0

    def add(self, direction: str, nbytes: int) -> None:
        self.current[direction] += nbytes
        self.total[direction] += nbytes

    def note(self, key: str, value: int) -> None:
        self.current[key] += value

    def close_step(self) -> None:
        self.last = dict(self.current)
        self.steps += 1
        self.reset()

    def reset(self) -> None:
        self.current = {"h2d": 0, "d2h": 0, "keys_scored": 0, "dropped": 0}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Transfer:
    """Fixed device buffers for one layer's active rows, pinned staging, and the counted copies."""

    def __init__(self, rows: int, hidden: int, device: torch.device, dtype: torch.dtype,
                 traffic: Traffic, pin: bool):
        self.rows, self.hidden, self.device, self.dtype = rows, hidden, device, dtype
        self.traffic = traffic
        self.cuda = device.type == "cuda"
        self.pin = pin and self.cuda
        # the fixed device buffers: buffer_rows x hidden for keys and for values
        self.buf_keys = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.buf_values = torch.zeros(rows, hidden, dtype=dtype, device=device)
        # host staging in the buffer dtype (pinned on CUDA) for slices and for their gradients
        self.stage_keys = torch.zeros(rows, hidden, dtype=dtype, pin_memory=self.pin)
        self.stage_values = torch.zeros(rows, hidden, dtype=dtype, pin_memory=self.pin)
        self.stage_gkeys = torch.zeros(rows, hidden, dtype=dtype, pin_memory=self.pin)
        self.stage_gvalues = torch.zeros(rows, hidden, dtype=dtype, pin_memory=self.pin)
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._h2d_done: Optional[torch.cuda.Event] = None  # staging may be rewritten after this
        self._pending: Optional[tuple] = None  # (event, rows, u, store) of gradients in flight
        self.generation = 0  # bumped each time the buffers are refilled

    def device_bytes(self) -> int:
        return nbytes(self.buf_keys) + nbytes(self.buf_values)

    def host_bytes(self) -> int:
        return 4 * nbytes(self.stage_keys)

    # ---- device -> host --------------------------------------------------------------------------
    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Optional["torch.cuda.Event"]]:
        """Start copying a device tensor to the CPU; returns the host tensor and an event to wait on."""
        t = t.detach()
        self.traffic.add("d2h", nbytes(t))
        if not self.cuda:
            return t.clone() if t.device.type == "cpu" else t.to("cpu"), None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return host, done

    @staticmethod
    def wait_host(event: Optional["torch.cuda.Event"]) -> None:
        if event is not None:
            event.synchronize()

    # ---- host -> device --------------------------------------------------------------------------
    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Copy a small host tensor (indices) to the device on the copy stream."""
        self.traffic.add("h2d", nbytes(t))
        if not self.cuda:
            return t.clone()
        src = t.pin_memory() if self.pin else t
        with torch.cuda.stream(self.stream):
            out = src.to(self.device, non_blocking=True)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        out.record_stream(torch.cuda.current_stream(self.device))
        return out

    def load_rows(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor) -> int:
        """Gather ``rows`` of the CPU tables into staging, then into the fixed device buffers."""
        u = rows.numel()
        if self._h2d_done is not None:
            self._h2d_done.synchronize()  # the previous async copy out of staging has finished
        self.stage_keys[:u].copy_(keys.index_select(0, rows))
        self.stage_values[:u].copy_(values.index_select(0, rows))
        self.traffic.add("h2d", 2 * u * self.hidden * self.buf_keys.element_size())
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))  # earlier reads of the buffers
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                self.buf_keys[:u].copy_(self.stage_keys[:u], non_blocking=True)
                self.buf_values[:u].copy_(self.stage_values[:u], non_blocking=True)
                self._h2d_done = torch.cuda.Event()
                self._h2d_done.record(self.stream)
            torch.cuda.current_stream(self.device).wait_event(self._h2d_done)
        else:
            self.buf_keys[:u].copy_(self.stage_keys[:u])
            self.buf_values[:u].copy_(self.stage_values[:u])
        self.generation += 1
        return self.generation

    # ---- gradients: device -> host, scattered into the CPU store ----------------------------------
    def push_grads(self, store, rows: torch.Tensor, gkeys: torch.Tensor, gvalues: torch.Tensor) -> None:
        """Copy slice gradients to the CPU and index_add them into ``store`` (deferred on CUDA)."""
        self.flush()
        u = rows.numel()
        self.traffic.add("d2h", nbytes(gkeys) + nbytes(gvalues))
        if not self.cuda:
            store.accumulate(rows, gkeys, gvalues)
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            self.stage_gkeys[:u].copy_(gkeys, non_blocking=True)
            self.stage_gvalues[:u].copy_(gvalues, non_blocking=True)
            gkeys.record_stream(self.stream)
            gvalues.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        # the CPU scatter waits until the next use of this layer's staging or the optimizer step,
        # so the copy overlaps with the backward of the layers below
        self._pending = (done, rows, u, store)

    def flush(self) -> None:
        """Finish a deferred gradient copy and scatter it into the CPU gradients."""
        if self._pending is None:
            return
        done, rows, u, store = self._pending
        self._pending = None
        done.synchronize()
        store.accumulate(rows, self.stage_gkeys[:u], self.stage_gvalues[:u])
