"""torch's CPU flash attention computes whole 512-key blocks: the share of the s² causal scores it does, and the
calibrated curve read per computed score; two-process slowdowns merged by their mean."""

from dataclasses import replace

import pytest

from memfit.estimate import estimate
from memfit.steptime.speeds import Speeds
from memfit.steptime.cpu import cpu_flash_work
from memfit.spec import hwprofile
from memfit.spec.strategy import Strategy
from test_time_attention_dims import _model, _speeds
from test_time_model import cpu_pool, rates


def test_work_share_by_hand():
    # up to 512 tokens one key block holds every key: the whole square
    assert cpu_flash_work(128) == cpu_flash_work(256) == cpu_flash_work(512) == 1.0
    # 768: query blocks of 256 (from 768); rows 0-511 stop after key block 0 (512 keys), rows 512-767 do 768
    assert cpu_flash_work(768) == pytest.approx((512 * 512 + 256 * 768) / 768 ** 2)  # 0.778
    assert cpu_flash_work(1024) == pytest.approx((512 * 512 + 512 * 1024) / 1024 ** 2)  # 0.75
    # 2048: 8 query blocks of 256 stop after 1, 1, 2, 2, 3, 3, 4, 4 key blocks of 512
    assert cpu_flash_work(2048) == pytest.approx(256 * 512 * (1 + 1 + 2 + 2 + 3 + 3 + 4 + 4) / 2048 ** 2)  # 0.625


def _cpu(curve) -> Speeds:
    return replace(_speeds(half=False), attention=curve, cpu_flash=True)


def test_curve_read_per_computed_score():
    # the same speed per computed score at 256 and 1024 reads 1/0.75 higher by the s² count at 1024
    r = 3.4e10
    sp = _cpu(((256.0, r), (1024.0, r / 0.75)))
    assert sp.attention_rate(512) == pytest.approx(r)  # 512 computes the whole square, as 256 does
    assert sp.attention_rate(768) == pytest.approx(r / cpu_flash_work(768))
    assert sp.attention_rate(2048) == pytest.approx(r / 0.625)  # past the last point: its per-score speed
    # without the block layout (eager, GPUs) the s² curve is log-interpolated as measured
    assert replace(sp, cpu_flash=False).attention_rate(512) == pytest.approx(r / 0.75 ** 0.5)


def test_short_sequences_read_their_own_point():
    # below 192 tokens the kernel's 32-row query blocks ran ~15 % slower per score: the 128 point alone
    sp = _cpu(((128.0, 2.9e10), (256.0, 3.4e10), (1024.0, 3.4e10 / 0.75)))
    assert sp.attention_rate(160) == pytest.approx(2.9e10)
    assert sp.attention_rate(192) == pytest.approx(3.4e10) == sp.attention_rate(384)
    # a profile measured without the 128 point: the nearest of the others, as before
    assert _cpu(((256.0, 3.4e10), (1024.0, 3.4e10 / 0.75))).attention_rate(128) == pytest.approx(3.4e10)


def test_estimate_at_512_tokens_is_the_whole_square():
    att = {k: {"eager": {"fp32": {"256": 1e9}}, "sdpa": {"fp32": {"256": 3e10, "1024": 4e10}},
               "shape": [1, 4, [256, 1024], 32]} for k in ("1", "2")}
    st = Strategy(method="full", seq_len=512, micro_batch_size=1, precision="fp32", attention="sdpa")
    t = estimate(_model(4), cpu_pool(1, attention=att), st).time["attention_seconds"]
    flops = 12 * 512 * 512 * 128 * 2  # 12·b·s²·(heads·d)·layers
    assert t == pytest.approx(flops / 3e10)  # 4e10 x 0.75 per computed score at 1024 = 3e10, flat


def test_concurrency_merged_by_its_mean():
    merged = None
    for i, slow in enumerate((1.0, 1.0, 1.9)):  # one calibration of three caught the host's one-core episode
        coll = {"2": {"backend": "gloo", "bus_bytes_per_s": 1e9 * (1 + i), "latency_s": 1e-4,
                      "concurrency": {"gemm": slow, "ops": slow}}}
        merged = hwprofile.with_history(rates(collectives=coll, measured_unix=1e9 + 60 * i), merged)
    c = merged.collectives["2"]
    assert c["concurrency"] == {"gemm": pytest.approx(1.3), "ops": pytest.approx(1.3)}  # the mean
    assert c["bus_bytes_per_s"] == 2e9  # every other figure: the median
