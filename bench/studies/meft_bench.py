"""MEFT benchmark: prints (a) traffic per step vs a DeepSpeed-offloaded dense parallel adapter at the
seed's LLaMA-7B setting, (b) CPU retrieval time Key-Experts vs brute-force top-K, (c) CPU step time of
a tiny model with MEFT vs LoRA (peft).

    PYTHONPATH=. .venv/bin/python bench/studies/meft_bench.py            # all three (~1-2 minutes on 2 cores)
    PYTHONPATH=. .venv/bin/python bench/studies/meft_bench.py --only a   # one part; --json for machine-readable output
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from memfit.meft import MeftConfig, add_meft, adapters, build_meft_optimizer, traffic
from memfit.meft.router import brute_force_topk, key_experts_topk

MB = 1e6


# ---- (a) traffic --------------------------------------------------------------------------------
def meft_layer_bytes(n: int, d: int, u: int, k: int, probes: int, act_bytes: int = 2) -> int:
    """One layer, one step: hidden down, key+value rows up, slot map up, expert ids down, row ids up,
    key+value gradients down (bf16 activations and buffers)."""
    down = n * d * act_bytes + n * probes * 8 + 2 * u * d * act_bytes
    up = 2 * u * d * act_bytes + n * k * 4 + (u * 8 if probes else 0)
    return down + up


def dense_offload_layer_bytes(r: int, d: int, bytes_per_value: int = 2) -> int:
    """ZeRO-Offload of a dense parallel adapter: fp16 gradients down and fp16 updated parameters up,
    i.e. 2 x M values per step for M = 2 r d parameters."""
    return 2 * (2 * r * d) * bytes_per_value


def part_a(measure: bool = True) -> dict:
    d, layers, r, b, s, k = 4096, 32, 6144, 2, 256, 64
    n = b * s
    cfg = MeftConfig(neurons=r, top_k=k, experts="auto", n_probe=8, init_keys_from_ffn=False,
                     buffer_dtype="bfloat16")
    dense = dense_offload_layer_bytes(r, d) * layers
    rows = []
    for u in (512, 1024, cfg.buffer_rows, 2048, 3072):
        meft = meft_layer_bytes(n, d, u, k, cfg.probes) * layers
        rows.append({"union_rows": u, "meft_MB": meft / MB, "dense_offload_MB": dense / MB,
                     "ratio": dense / meft})
    out = {"setting": f"LLaMA-7B shapes d={d}, {layers} layers, r={r}, batch {b} x seq {s}, top_k={k}, "
                      f"experts={cfg.num_experts}, n_probe={cfg.probes}, bf16 transfers",
           "default_buffer_rows": cfg.buffer_rows, "table": rows}
    if measure:  # run one real layer at these shapes and let the copy functions count
        torch.manual_seed(0)
        model = add_meft(torch.nn.Sequential(torch.nn.Linear(d, d, bias=False)),
                         MeftConfig(**{**cfg.to_dict(), "target": r"^0$"}))
        a = adapters(model)["0"]
        a.store.values.normal_(0, 0.01)
        x = torch.randn(b, s, d, dtype=torch.bfloat16, requires_grad=True)
        model.to(torch.bfloat16)
        model(x).float().square().mean().backward()
        t = traffic(model, "current")
        formula = meft_layer_bytes(n, d, a.last_stats.union, k, cfg.probes)
        out["measured_one_layer"] = {"union_rows": a.last_stats.union, "h2d": t["h2d"], "d2h": t["d2h"],
                                     "counted_total": t["h2d"] + t["d2h"], "formula_total": formula,
                                     "ratio_32_layers": dense / (32 * (t["h2d"] + t["d2h"]))}
    return out


# ---- (b) retrieval ------------------------------------------------------------------------------
def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def part_b(repeats: int = 5) -> dict:
    d, r, n, k = 4096, 16384, 512, 64
    cfg = MeftConfig(neurons=r, top_k=k, experts="auto", n_probe=8)
    torch.manual_seed(0)
    keys = torch.randn(r, d) / d ** 0.5
    x = torch.randn(n, d)
    router = torch.stack([keys[e * cfg.expert_size:(e + 1) * cfg.expert_size].mean(0)
                          for e in range(cfg.num_experts)])

    def ke():
        probed = (x @ router.T).topk(cfg.probes, dim=1).indices  # the router (on the device in training)
        return key_experts_topk(x, keys, probed, cfg.expert_size, k)

    def interleaved(clock) -> tuple[list, list]:
        brute_t, ke_t = [], []
        brute_force_topk(x, keys, k), ke()
        for _ in range(repeats):
            t0 = clock()
            brute_force_topk(x, keys, k)
            t1 = clock()
            ke()
            brute_t.append(t1 - t0)
            ke_t.append(clock() - t1)
        return brute_t, ke_t

    # wall time with all threads, interleaved, best of ``repeats`` (the least disturbed runs) ...
    brute_t, ke_t = interleaved(time.perf_counter)
    brute_s, ke_s = min(brute_t), min(ke_t)
    # ... and the CPU time of one thread, which other processes on a shared machine disturb less
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        brute_c, ke_c = interleaved(time.thread_time)
    finally:
        torch.set_num_threads(threads)
    return {"setting": f"d={d}, r={r}, {n} tokens, top_k={k}, experts={cfg.num_experts}, n_probe={cfg.probes}, "
                       f"{torch.get_num_threads()} threads",
            "brute_force_ms": brute_s * 1e3, "key_experts_ms": ke_s * 1e3, "speedup": brute_s / ke_s,
            "median_speedup": statistics.median(brute_t) / statistics.median(ke_t),
            "one_thread_cpu_brute_ms": min(brute_c) * 1e3, "one_thread_cpu_key_experts_ms": min(ke_c) * 1e3,
            "one_thread_cpu_speedup": min(brute_c) / min(ke_c),
            "keys_scored_brute": brute_force_topk(x[:1], keys, k).keys_scored * n,
            "keys_scored_key_experts": ke().keys_scored}


# ---- (c) step time ------------------------------------------------------------------------------
def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=1024))


def part_c(steps: int = 5) -> dict:
    from peft import LoraConfig, get_peft_model

    from memfit.meft import meft_state

    ids = torch.randint(0, 1024, (2, 128), generator=torch.Generator().manual_seed(0))

    def timed(model, opt) -> tuple[float, float]:
        """(wall seconds with all threads, CPU seconds of one thread): medians over ``steps``."""
        def one():
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        wall = _median_time(one, steps)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            one()
            cpu = []
            for _ in range(steps):
                t0 = time.thread_time()
                one()
                cpu.append(time.thread_time() - t0)
        finally:
            torch.set_num_threads(threads)
        return wall, statistics.median(cpu)

    lora = get_peft_model(_tiny_llama(), LoraConfig(r=16, lora_alpha=32, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    lora.train()
    lora_params = [p for p in lora.parameters() if p.requires_grad]
    lora_t = timed(lora, torch.optim.AdamW(lora_params, lr=1e-4))
    meft_cfg = MeftConfig(neurons=2048, top_k=32, experts="auto", n_probe=8)
    meft = add_meft(_tiny_llama(), meft_cfg)
    meft_t = timed(meft, build_meft_optimizer(meft, lr=1e-4))
    plain = _tiny_llama()
    for p in plain.parameters():
        p.requires_grad_(False)
    emb = plain.get_input_embeddings().weight.requires_grad_(True)
    base_t = timed(plain, torch.optim.SGD([emb], lr=0.0))
    name = f"MEFT r={meft_cfg.neurons} K={meft_cfg.top_k} E={meft_cfg.num_experts} P={meft_cfg.probes}"
    return {"setting": "Llama d=256, 4 layers, batch 2 x seq 128, fp32, CPU",
            "rows": [
                {"name": "LoRA r=16 (all projections)", "trainable": sum(p.numel() for p in lora_params),
                 "wall_ms": lora_t[0] * 1e3, "cpu_1thread_ms": lora_t[1] * 1e3},
                {"name": name, "trainable": meft_state(meft)["trainable_parameters"],
                 "wall_ms": meft_t[0] * 1e3, "cpu_1thread_ms": meft_t[1] * 1e3},
                {"name": "frozen base (forward+backward only)", "trainable": 0,
                 "wall_ms": base_t[0] * 1e3, "cpu_1thread_ms": base_t[1] * 1e3}],
            "meft_per_step_traffic": traffic(meft)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["a", "b", "c"], action="append")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    parts = args.only or ["a", "b", "c"]
    results = {}
    if "a" in parts:
        results["a_traffic"] = part_a()
    if "b" in parts:
        results["b_retrieval"] = part_b()
    if "c" in parts:
        results["c_step_time"] = part_c()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    if "a_traffic" in results:
        a = results["a_traffic"]
        print(f"(a) traffic per step, {a['setting']}")
        print(f"    {'union rows/layer':>16} {'MEFT MB':>10} {'dense offload MB':>17} {'ratio':>7}")
        for row in a["table"]:
            mark = "  <- default buffer (r/4)" if row["union_rows"] == a["default_buffer_rows"] else ""
            print(f"    {row['union_rows']:>16} {row['meft_MB']:>10.1f} {row['dense_offload_MB']:>17.1f} "
                  f"{row['ratio']:>6.2f}x{mark}")
        m = a.get("measured_one_layer")
        if m:
            print(f"    measured on one real layer (random data fills the buffer: union {m['union_rows']}): "
                  f"h2d {m['h2d'] / MB:.2f} MB + d2h {m['d2h'] / MB:.2f} MB = {m['counted_total'] / MB:.2f} MB "
                  f"(formula {m['formula_total'] / MB:.2f} MB) -> x32 layers: {m['ratio_32_layers']:.2f}x less")
    if "b_retrieval" in results:
        b = results["b_retrieval"]
        print(f"(b) CPU retrieval, {b['setting']}")
        print(f"    brute-force top-K {b['brute_force_ms']:.1f} ms ({b['keys_scored_brute']:,} keys scored), "
              f"Key-Experts {b['key_experts_ms']:.1f} ms ({b['keys_scored_key_experts']:,} keys scored): "
              f"{b['speedup']:.1f}x faster (wall, best of runs; median ratio {b['median_speedup']:.1f}x)")
        print(f"    one thread, CPU time: brute-force {b['one_thread_cpu_brute_ms']:.1f} ms, Key-Experts "
              f"{b['one_thread_cpu_key_experts_ms']:.1f} ms: {b['one_thread_cpu_speedup']:.1f}x faster")
    if "c_step_time" in results:
        c = results["c_step_time"]
        print(f"(c) step time, {c['setting']}")
        print(f"    {'':<36} {'trainable':>10} {'wall ms':>9} {'1-thread CPU ms':>16}")
        for row in c["rows"]:
            print(f"    {row['name']:<36} {row['trainable']:>10,} {row['wall_ms']:>9.1f} "
                  f"{row['cpu_1thread_ms']:>16.1f}")
        t = c["meft_per_step_traffic"]
        print(f"    MEFT bytes per step: h2d {t['h2d'] / MB:.2f} MB, d2h {t['d2h'] / MB:.2f} MB")


if __name__ == "__main__":
    main()
