"""memfit train sets the allocator's mode the strategy chose (strategy.allocator), on CUDA only."""

import os

from memfit.spec.strategy import Strategy
from memfit.train.allocator import ENV, apply_allocator, merged_conf


def test_expandable_segments_set_on_cuda_only(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    st = Strategy(method="lora", allocator="expandable_segments")
    assert apply_allocator(st, cuda=False) is None and ENV not in os.environ  # the CPU: nothing set
    assert apply_allocator(Strategy(method="lora"), cuda=True) is None and ENV not in os.environ  # default mode
    note = apply_allocator(st, cuda=True)
    assert os.environ[ENV] == "expandable_segments:True" and "strategy.allocator=expandable_segments" in note


def test_the_users_own_settings_are_kept():
    assert merged_conf("max_split_size_mb:128") == "max_split_size_mb:128,expandable_segments:True"
    assert merged_conf("expandable_segments:False, garbage_collection_threshold:0.6") == \
        "garbage_collection_threshold:0.6,expandable_segments:True"
