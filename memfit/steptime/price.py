"""The one code path that prices a micro-batch's work (memfit.steptime.ops) on a device: a catalog GPU
(memfit.steptime.micro.CatalogGpu) or measured speeds (memfit.steptime.measured.MeasuredDevice). Each op goes
to the device's price for its kind; the parts add up as a step's table names them. The device's seconds and
the host's overlap where the device runs kernels while the host dispatches (the micro-batch then costs the
longer of the two), and add where one processor does both (a CPU); what the host waits on the device for
(ZeRO-3's fetches, a method's synchronisations) adds in either case.
"""

from __future__ import annotations

from typing import Union


from memfit.steptime.measured import MeasuredDevice
from memfit.steptime.micro import CatalogGpu
from memfit.steptime.speeds import Speeds
from memfit.steptime.ops import (Attention, Bytes, Dequant, Dispatch, Dropout, EngineHooks, Exchange, Gemm, HostCopy,
                                 Kernels, Linear, MicroBatch, Router, Sync, Tensors, Work)
from memfit.steptime.work import _PER_MODEL
from memfit.steptime.constants import TimeProfile

Device = Union[CatalogGpu, MeasuredDevice]  # what prices work: each has a price per kind of op

_DEVICES: dict = {}
_PRICED: dict = {}


def device_for(sp: Speeds, profile: TimeProfile) -> Device:
    """The device that prices work at speeds ``sp`` (memfit.steptime.speeds.Speeds): its catalog GPU's rates,
    else the measured speeds (one object per speeds and Profile, so what it priced is reused)."""
    key = (id(sp), id(profile))
    hit = _DEVICES.get(key)
    if hit is None or hit[0] is not sp or hit[1] is not profile:
        if len(_DEVICES) > 256:
            _DEVICES.clear()
        hit = _DEVICES[key] = (sp, profile, CatalogGpu(sp.gpu, profile, sp) if sp.gpu is not None
                               else MeasuredDevice(sp))
    return hit[2]


def price(work: Work, device: Device) -> MicroBatch:
    """``work`` on ``device``: seconds by part and FLOPs by kind (cached per work, shape and device)."""
    key = (work.key, work.batch, work.seq, device) if work.key else None
    hit = _PRICED.get(key) if key else None
    if hit is None:
        hit = _price(work, device)
        if key:
            if len(_PRICED) > 8192:
                _PRICED.clear()
            _PRICED[key] = hit
    return hit


def _price(work: Work, dev: Device) -> MicroBatch:
    T, b, s = work.tokens, float(work.batch), float(work.seq)
    matmul = attn = mem = dequant = host = serial = exchange = copies = 0.0
    dense = adapter = attn_flops = 0.0
    for op in work.ops:
        kind = type(op)
        if kind is Linear:
            matmul += dev.linear(op, T)
            if op.dense:
                dense += op.flops(T)
            else:
                adapter += op.flops(T)
        elif kind is Gemm:
            matmul += dev.gemm(op)
            adapter += op.flops(T)
        elif kind is Router:
            matmul += dev.router(op, T)
            adapter += op.flops(T)
        elif kind is Kernels:
            matmul += dev.kernels(op.count)
        elif kind is Attention:
            attn += dev.attention(op, b, s)
            attn_flops += op.flops(b, s)
        elif kind is Bytes:
            mem += dev.bytes(op, T)
        elif kind is Dropout:
            mem += dev.dropout(op, T)
        elif kind is Tensors:
            mem += dev.tensors(op, b, s)
        elif kind is Dequant:
            on_device, on_host = dev.dequant(op)
            dequant, host = dequant + on_device, host + on_host
        elif kind is Dispatch:
            host += dev.dispatch(op)
        elif kind is EngineHooks:
            on_host, waited = dev.engine_hooks(op)
            host, serial = host + on_host, serial + waited
        elif kind is Sync:
            serial += dev.sync(op.ops)
        elif kind is Exchange:
            exchange += dev.exchange(op, T)
        elif kind is HostCopy:
            copies += dev.host_copy(op, T)
        else:
            raise TypeError(f"no price for {kind.__name__}")
    device = matmul + attn + mem + dequant
    # the sequence group's collectives and the activations' copies wait on the compute stream
    seconds = (max(device, host) if dev.overlap else device + host) + serial + exchange + copies
    return MicroBatch(seconds, device if dev.timeline else 0.0, matmul, attn, mem, dequant, host + serial, exchange,
                      copies, dense, attn_flops, adapter)


def clear_caches() -> None:
    """Forget every cached op list and price (tests that swap a method's hook in place call it)."""
    _PER_MODEL.clear()
    _PRICED.clear()
    _DEVICES.clear()
