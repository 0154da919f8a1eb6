"""The CPU probe's allocator peak from the profiler's raw allocation events, with the frees it cannot see.

torch's profiler records a CPU allocation or free only on a thread it profiles: the CPU allocator's reporter
asks ``memoryProfilingEnabled()`` on the thread that frees (c10/core/CPUAllocator.cpp
``ProfiledCPUMemoryReporter::Delete``), and a free on another thread leaves no event — the block would count
as live to the end of the window. gloo runs collectives on its own worker threads, and two corrections follow:

1. **An address handed out again was freed before.** When an allocation reuses the address of a block the
   replay still holds, that block's free was unseen; it ends there (an address cannot be live twice).
2. **gloo's reduce-scatter copy ends with its call.** ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``
   (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp) clones its input (``buffers.push_back(inputTensors[i]
   .clone())``), all-reduces the clone and copies this rank's chunk out in the returned work's ``wait()``; the
   clone is released with the work by whichever thread drops it last — gloo's worker, unseen, in about half
   the steps, so one rank's peak could hold a whole unit's gradient the other's did not (FSDP2 full
   fine-tuning with checkpointing: 5.2 MB between the ranks, issue 22). FSDP1's ``_reduce_grad`` and FSDP2's
   ``foreach_reduce`` call ``reduce_scatter_single`` synchronously (``async_op=False``: it waits before it
   returns), so a clone made inside a ``c10d::`` collective and never seen freed ends when the call that
   made it returns: the nearest enclosing event that is not a built-in method (the Python frame that waited,
   or the FSDP hook's record_function when the profile has no Python stacks). NCCL makes no such copy.
"""

from __future__ import annotations

from typing import Any

import torch


def allocations(results: Any, device: str) -> list[tuple[int, int, int, tuple]]:
    """(time, address, bytes — negative for a free —, the enclosing events' names) of every allocation event
    on ``device``, with a free added at the caller's end for each gloo collective clone (rule 2 of the module
    docstring); ordered in time, a free before an allocation at the same instant."""
    from torch._C._profiler import _EventType

    dev = torch.device(device)
    events: list[tuple[int, int, int, tuple]] = []
    clones: list[tuple[int, int, int, int, tuple]] = []  # (time, address, bytes, caller's end, names)
    stack = [(ev, ()) for ev in results.experimental_event_tree()]
    while stack:
        ev, ancestors = stack.pop()
        if ev.tag == _EventType.Allocation:
            fields = ev.typed[1]
            if fields.device.type == dev.type:
                names = tuple(a.name for a in ancestors)
                events.append((ev.start_time_ns, fields.ptr, fields.alloc_size, names))
                if fields.alloc_size > 0:
                    end = _collective_caller_end(ancestors)
                    if end is not None:
                        clones.append((ev.start_time_ns, fields.ptr, fields.alloc_size, end, names))
            continue
        stack.extend((child, ancestors + (ev,)) for child in ev.children)
    events.sort(key=lambda e: e[0])
    for t, ptr, size, end, names in clones:
        freed = next((e for e in events if e[0] > t and e[1] == ptr), None)
        if freed is None or freed[2] > 0 and freed[0] > end:  # never freed, or its address reused unseen
            events.append((end, ptr, -size, names))
    events.sort(key=lambda e: (e[0], e[2] > 0))
    return events


def _collective_caller_end(ancestors: tuple) -> int | None:
    """The end time of the call that waited for the gloo collective this clone was made in, or None when the
    allocation is no ``aten::clone`` inside a ``c10d::`` op."""
    names = [a.name for a in ancestors]
    if "aten::clone" not in names:
        return None
    op = next((i for i in range(len(names) - 1, -1, -1) if names[i].startswith("c10d::")), None)
    if op is None or op >= names.index("aten::clone"):
        return None
    for caller in reversed(ancestors[:op]):
        if not caller.name.startswith("<built-in"):
            return caller.end_time_ns
    return ancestors[op].end_time_ns


def raw_event_peak(results: Any, device: str) -> int:
    """Highest running sum of the blocks live inside the window (bytes allocated minus freed), each block's
    life ended by its recorded free, by the reuse of its address, or by its collective call's return."""
    live: dict[int, int] = {}
    run = peak = 0
    for _, ptr, size, _ in allocations(results, device):
        if size > 0:  # (a free's event carries the negative size; empty tensors allocate nothing)
            run += size - live.get(ptr, 0)  # rule 1: the address was freed unseen before it came back
            live[ptr] = size
            peak = max(peak, run)
        elif size < 0 and ptr in live:
            run -= live.pop(ptr)
    return peak
