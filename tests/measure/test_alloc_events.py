"""The CPU probe's raw-event replay restores the frees the profiler cannot see (memfit.measure.alloc_events):
an address handed out again was freed before, and gloo's reduce-scatter clone ends with the call that waited."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from torch._C._profiler import _EventType  # noqa: E402

from memfit.measure.alloc_events import raw_event_peak  # noqa: E402

CPU = torch.device("cpu")


def _alloc(t, ptr, size):
    return SimpleNamespace(tag=_EventType.Allocation, typed=(None, SimpleNamespace(device=CPU, ptr=ptr,
                                                                                   alloc_size=size)),
                           start_time_ns=t, end_time_ns=t, children=[], name="[memory]")


def _op(name, t0, t1, *children):
    return SimpleNamespace(tag=_EventType.TorchOp, name=name, start_time_ns=t0, end_time_ns=t1,
                           children=list(children), typed=None)


def _results(*roots):
    return SimpleNamespace(experimental_event_tree=lambda: list(roots))


def test_seen_frees_replay_as_a_running_sum():
    # 100 + 50 live, 100 freed, 30 more: peak 150
    ev = _results(_alloc(1, 0xA, 100), _alloc(2, 0xB, 50), _alloc(3, 0xA, -100), _alloc(4, 0xC, 30))
    assert raw_event_peak(ev, "cpu") == 150


def test_an_address_handed_out_again_was_freed_unseen():
    # 0xA (100 B) freed on another thread (no event), then 0xA handed out again for 80 B beside 0xB (50 B):
    # live 80 + 50 = 130, not 100 + 50 + 80 = 230
    ev = _results(_alloc(1, 0xA, 100), _alloc(2, 0xB, 50), _alloc(3, 0xA, 80))
    assert raw_event_peak(ev, "cpu") == 150


def test_gloo_reduce_scatter_clone_ends_with_the_call_that_waited():
    """FSDP's post-backward hook (a record_function, 10-20 ns) calls reduce_scatter_single: gloo clones the
    1,000 B input inside c10d::_reduce_scatter_base_ and frees the clone on its worker thread (no event).
    Afterwards the layer's recomputation allocates 400 B at another address beside a 300 B gradient."""
    hook = _op("FullyShardedDataParallel._post_backward_hook", 10, 20,
               _op("<built-in method reduce_scatter_single of PyCapsule>", 11, 12,
                   _op("c10d::_reduce_scatter_base_", 11, 12,
                       _op("aten::clone", 11, 12, _op("aten::empty_strided", 11, 12, _alloc(11, 0xC, 1000))))))
    ev = _results(_alloc(5, 0xD, 300), hook, _alloc(30, 0xE, 400))
    # the clone counts while the hook runs (300 + 1000), not beside the recomputation (300 + 400)
    assert raw_event_peak(ev, "cpu") == 1300
    later = _results(_alloc(5, 0xD, 300), hook, _alloc(30, 0xE, 1200))
    assert raw_event_peak(later, "cpu") == 1500  # without the rule: 300 + 1000 + 1200 = 2500


def test_a_clone_outside_a_collective_is_left_alone():
    ev = _results(_op("aten::clone", 1, 2, _alloc(1, 0xA, 100)), _alloc(5, 0xB, 50))
    assert raw_event_peak(ev, "cpu") == 150  # never freed in the window: live to its end
