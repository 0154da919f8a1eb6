"""method=peft's step time: the PEFT layer's own work, each rule by hand against PEFT's forward (peft 0.21.2),
on Llama-3.2-3B on one L40S (PEFT's MetaMathQA setting, pure bf16: fp32 adapters, no autocast)."""

import pytest

from memfit.estimate import DEFAULT_PROFILE, estimate
from memfit.methods.base import NO_WORK, LayerWork
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.strategy import Strategy

pytest.importorskip("peft")
T = 4 * 210  # tokens of the micro-batch


@pytest.fixture
def setting():
    return resolve_model("llama-3.2-3b"), parse_hardware("1xL40S-48GB")


def _strategy(cfg: dict, seq_len: int = 210) -> Strategy:
    return Strategy(method="peft", peft_config=cfg, precision="bf16", micro_batch_size=4, seq_len=seq_len)


def _rates(hw):
    from memfit.steptime.speeds import speeds_for

    return speeds_for(hw, "bf16", "sdpa", DEFAULT_PROFILE).gpu


def _layer_work_and_matmul_added(monkeypatch, setting, cfg: dict) -> tuple[LayerWork, float]:
    """(the method's extra_layer_work, the matmul seconds it adds to the step)."""
    import memfit.methods.peft as peft_method
    from memfit.steptime.price import clear_caches

    model, hw = setting
    st = _strategy(cfg)
    layer_work = peft_method.METHOD.extra_layer_work(model, st, frozenset())
    clear_caches()
    with_work = estimate(model, hw, st).time["matmul_seconds"]
    monkeypatch.setattr(peft_method.Peft, "extra_layer_work", lambda self, m, s, a: NO_WORK)
    clear_caches()
    without = estimate(model, hw, st).time["matmul_seconds"]
    clear_caches()
    return layer_work, with_work - without


def test_prompt_tuning_time_processes_the_virtual_tokens(setting):
    """PEFT's prompt tuning concatenates num_virtual_tokens embeddings in front of every sequence
    (peft_model.py PeftModelForCausalLM.forward): the step's kernels see seq_len + those, the tokens counted
    are seq_len. 200 virtual tokens at 568 take the compute of 1 at 767 (both 768 positions); tokens/s
    then differ by 568 / 767 (less the optimizer's few microseconds for 199 more trained embeddings)."""
    model, hw = setting

    def timed(virtual: int, seq: int) -> dict:
        pt = {"peft_type": "PROMPT_TUNING", "num_virtual_tokens": virtual, "task_type": "CAUSAL_LM"}
        return estimate(model, hw, _strategy(pt, seq)).time

    long_prompt, short_prompt = timed(200, 568), timed(1, 767)
    assert long_prompt["compute_seconds"] == pytest.approx(short_prompt["compute_seconds"], rel=1e-12)
    assert long_prompt["tokens_per_second"] / short_prompt["tokens_per_second"] == pytest.approx(568 / 767, rel=1e-3)


def test_delta_weight_methods_time_their_second_linear(monkeypatch, setting):
    """LoKr (as LoHa) applies its delta weight with a second F.linear(x, delta_w) beside the base layer
    (peft/tuners/lokr/layer.py:336-343), in fp32 (the input cast to the adapters): per layer one GEMM of
    q_proj's shape and one of v_proj's each forward and two each backward, priced as the base linears are
    (memfit.steptime.gemm) at the GPU's plain fp32 rate; and the delta weight, written in the forward, its
    gradient written and read back: 12 B per weight value."""
    from memfit.steptime.gemm import linear_seconds

    lokr = {"peft_type": "LOKR", "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    layer_work, added = _layer_work_and_matmul_added(monkeypatch, setting, lokr)
    assert layer_work.delta_linears == ((3072.0, 3072.0, 1.0, True, True), (3072.0, 1024.0, 1.0, True, True))
    assert layer_work.weight_bytes == 12.0 * (3072 * 3072 + 3072 * 1024)
    g = _rates(setting[1])
    extra = sum(28 * sum(linear_seconds(T, k, n, g, True, 4.0, True)) for k, n in ((3072, 3072), (3072, 1024)))
    assert added == pytest.approx(extra, rel=1e-9)
    assert extra > 0.02  # fp32 GEMMs of 840 tokens: tens of milliseconds per step, not a rounding error


def test_boft_times_its_rotation(monkeypatch, setting):
    """BOFT (peft/tuners/boft/layer.py Linear.forward:594-650, one butterfly factor) builds an in x in rotation
    each forward — bmm(block_diag, P.T), bmm(P, .), @ eye: three in x in x in GEMMs in the input's dtype, and
    three in backward (each product with a trained operand) — then x @ rotation, a linear of in x in whose
    weight trains. Without PEFT's fbd_cuda extension torch.block_diag builds the block diagonal: a zero fill and
    one copy kernel per 4 x 4 block (3072 / 4 = 768) in forward, one stack in backward, each a kernel's fixed
    time. q_proj and v_proj of Llama-3.2-3B both take in = 3072."""
    from memfit.steptime.gemm import gemm_seconds, linear_seconds

    boft = {"peft_type": "BOFT", "boft_block_size": 4, "boft_n_butterfly_factor": 1,
            "target_modules": ["q_proj", "v_proj"]}
    layer_work, added = _layer_work_and_matmul_added(monkeypatch, setting, boft)
    assert layer_work.weight_gemms == ((3072.0, 3072.0, 3072.0, 3.0, 3.0, 1.0),) * 2
    assert layer_work.delta_linears == ((3072.0, 3072.0, 1.0, False, True),) * 2
    g = _rates(setting[1])
    assert layer_work.kernels == (2 * (768 + 1.0), 2 * 1.0)
    per_linear = 6 * gemm_seconds(3072, 3072, 3072, g, 2.0) + sum(linear_seconds(T, 3072, 3072, g, True, 2.0))
    per_linear += (768 + 1 + 1) * DEFAULT_PROFILE.gemm_kernel_seconds
    assert added == pytest.approx(28 * 2 * per_linear, rel=1e-9)


def test_randlora_times_its_full_rank_bases(monkeypatch, setting):
    """RandLoRA (peft/tuners/randlora/layer.py forward:327-344, get_scaled_bases:262-308) adds
    F.linear(F.linear(x, first), second) of rank r x ceil(min(in, out) / r) in fp32, its random bases frozen
    and only the one on the smaller side scaled by the trained lambda / gamma. r = 32 on q_proj (3072 -> 3072:
    rank 3072, the first basis trains) and v_proj (3072 -> 1024: rank 1024, the second trains)."""
    from memfit.steptime.gemm import linear_seconds

    cfg = {"peft_type": "RANDLORA", "r": 32, "target_modules": ["q_proj", "v_proj"]}
    layer_work, added = _layer_work_and_matmul_added(monkeypatch, setting, cfg)
    linears = layer_work.delta_linears
    assert sorted(linears) == sorted([(3072.0, 3072.0, 1.0, True, True), (3072.0, 3072.0, 1.0, True, False),
                                      (3072.0, 1024.0, 1.0, True, False), (1024.0, 1024.0, 1.0, True, True)])
    g = _rates(setting[1])
    extra = sum(28 * sum(linear_seconds(T, k, n, g, trains, 4.0, True)) for k, n, _, _, trains in linears)
    assert added == pytest.approx(extra, rel=1e-9)


def test_osf_times_its_rank_2r_update(setting):
    """OSF (peft/tuners/osf/layer.py forward:316-350) adds F.linear(F.linear(x, B), A), A and B the trained
    low-rank factors concatenated with their frozen initial copies: rank 2r. The MetaMathQA config keeps
    2944 of q_proj's 3072 directions (896 of k_proj's 1024) frozen, so r = 128 and each wrapped linear gets two
    fp32 linears of rank 256 whose weights train."""
    import memfit.methods.peft as peft_method

    cfg = {"peft_type": "OSF", "target_modules": ["q_proj", "k_proj"], "rank_pattern": {"q_proj": 2944, "k_proj": 896}}
    linears = peft_method.METHOD.extra_layer_work(setting[0], _strategy(cfg), frozenset()).delta_linears
    shapes = sorted((round(k), round(n)) for k, n, share, f32, trains in linears if share == 1.0 and f32 and trains)
    assert len(linears) == 4 and shapes == sorted([(3072, 256), (256, 3072), (3072, 256), (256, 1024)])


def test_every_wrapped_linear_does_loras_elementwise_and_host_work(setting):
    """Whatever the layer type, a wrapped linear casts its input to the fp32 adapter, applies its dropout and
    adds (or multiplies) its result into the base's output: LoRA's work beyond its GEMMs, per token, and 6 host
    ops (memfit.methods.peft.work.GENERIC_OPS). IA3 on k, v (1024 out) and down_proj (8192 in) of Llama-3.2-3B,
    no dropout, pure bf16 (2-byte values, the fp32 cast)."""
    import memfit.methods.peft as peft_method
    from memfit.steptime.work import lora_elementwise_bytes, method_work

    model = setting[0]
    cfg = {"peft_type": "IA3", "target_modules": ["k_proj", "v_proj", "down_proj"],
           "feedforward_modules": ["down_proj"]}
    st = _strategy(cfg)
    work = peft_method.METHOD.extra_layer_work(model, st, frozenset())
    assert sorted(work.lora_like) == [(3072.0, 1024.0, 1.0), (3072.0, 1024.0, 1.0), (8192.0, 3072.0, 1.0)]
    # 6 host ops each, and IA3's own count against LoRA's (bench/peft_host_ops.py: 2.29 fewer: no A, B)
    assert work.ops == pytest.approx(3 * (6.0 - 2.29)) and work.dropout is False
    by_hand = 2 * lora_elementwise_bytes(3072, 1024, 2.0, False, True, False) \
        + lora_elementwise_bytes(8192, 3072, 2.0, False, True, False)
    # per token: forward 5e n + (e + 4) k, backward 2e n + 3e k + (e + 4) k:
    # k_proj's 2 x 1024 x 7 + 2 x 6 x 3072 + 6 x 3072
    assert lora_elementwise_bytes(3072, 1024, 2.0, False, True, False) == 14 * 1024 + 12 * 3072 + 6 * 3072
    assert method_work(model, st, frozenset(), False)[1] == pytest.approx(by_hand, rel=1e-12)


def _work(setting, cfg: dict) -> dict:
    import memfit.methods.peft as peft_method

    return peft_method.METHOD.extra_layer_work(setting[0], _strategy(cfg), frozenset())


def test_weight_rebuilding_methods_by_hand(setting):
    """FourierFT and WaveFT rebuild a weight-sized delta every forward (148 and 128 B per value, forward +
    backward) and sync the host (1 and 8 per module); MiSS 'bat' runs the base product in fp32 with a weight
    gradient, its r x r block products over the weight and 92 B per value; on q_proj (3072 x 3072) and v_proj
    (3072 x 1024) of Llama-3.2-3B."""
    from memfit.methods.peft.work import kernels_per_op

    qv = 3072 * 3072 + 3072 * 1024
    four = _work(setting, {"peft_type": "FOURIERFT", "target_modules": ["q_proj", "v_proj"], "n_frequency": 1000})
    assert four.weight_bytes == 148.0 * qv and four.sync_ops == pytest.approx(2.0 / kernels_per_op())
    wave = _work(setting, {"peft_type": "WAVEFT", "target_modules": ["q_proj", "v_proj"], "n_frequency": 5000})
    assert wave.weight_bytes == 128.0 * qv and wave.sync_ops == pytest.approx(16.0 / kernels_per_op())
    bat = _work(setting, {"peft_type": "MISS", "target_modules": ["q_proj", "v_proj"], "r": 64, "init_weights": "bat"})
    assert sorted((k, n, f32, trains) for k, n, share, f32, trains in bat.delta_linears) == \
        [(3072.0, 1024.0, True, True), (3072.0, 3072.0, True, True)]
    assert sorted(g[:5] for g in bat.weight_gemms) == [(1024.0, 3072.0, 64.0, 1.0, 1.0),
                                                          (3072.0, 3072.0, 64.0, 1.0, 1.0)]
    assert bat.weight_bytes == 92.0 * qv
    plain = _work(setting, {"peft_type": "MISS", "target_modules": ["q_proj", "v_proj"], "r": 64})
    assert sorted(x[:2] for x in plain.delta_linears) == [(64.0, 1024.0), (64.0, 3072.0)]  # (T x r) @ (r x n)
    assert plain.token_forward_bytes == 2 * 4.0 * 3072 and plain.weight_bytes == 0


def test_token_side_methods_by_hand(setting):
    """C3A: three complex GEMMs of 8 T k n / b FLOPs as a fp32 k -> 4 n / b linear, its FFTs' bytes per token;
    OFT (r 32 blocks of 96 on 3072 inputs): the rotation's batched b^3 products (3 + 6) and x @ R as a
    k -> b linear; PSOFT: x @ A @ R @ B in fp32 (A and B frozen), a solve's host sync unless Cayley-Neumann;
    Lily: fp32 k -> r -> n with the experts' combine per forward + backward."""
    c3a = _work(setting, {"peft_type": "C3A", "target_modules": ["q_proj"], "block_size": 64})
    assert c3a.delta_linears == ((3072.0, 4.0 * 3072 / 64, 1.0, True, True),)
    assert (c3a.token_forward_bytes, c3a.token_backward_bytes) == (86.0 * 3072, 150.0 * 3072)
    oft = _work(setting, {"peft_type": "OFT", "target_modules": ["q_proj"], "r": 32, "oft_block_size": 0})
    assert oft.delta_linears == ((3072.0, 96.0, 1.0, True, True),)
    assert oft.weight_gemms == ((3072.0, 96.0, 96.0, 3.0, 6.0, 1.0),) and oft.weight_bytes == 76 * 4 * 3072 * 96
    psoft = _work(setting, {"peft_type": "PSOFT", "target_modules": ["q_proj"], "r": 256})
    assert [x[:2] + x[3:] for x in psoft.delta_linears] == [(3072.0, 256.0, True, False), (256.0, 256.0, True, True),
                                                                (256.0, 3072.0, True, False)]
    assert psoft.sync_ops > 0
    fast = _work(setting, {"peft_type": "PSOFT", "target_modules": ["q_proj"], "r": 256, "use_cayley_neumann": True})
    assert fast.sync_ops == 0
    lily = _work(setting, {"peft_type": "LILY", "target_modules": ["q_proj"], "r": 896, "num_B": 2, "stride_A": 14})
    assert lily.weight_bytes == (36 * 2 + 16) * 896 * 3072 + 16 * 896 * 3072


def test_adapter_own_work_by_hand(setting):
    """AdaLoRA computes at init_r (the allocator masks E, it never shrinks A and B); VB-LoRA syncs once per
    module and forward (logits .isinf().any() in an if); adaption prompt, per adapted layer: q_proj again,
    the unused v_proj (half a linear: its forward only), o_proj, the scores and output against the prompt
    (a q_dim -> 2 adapter_len linear), the prompt's k and v projections, all in the compute dtype."""
    model = setting[0]
    ada = _work(setting, {"peft_type": "ADALORA", "target_modules": ["q_proj"], "init_r": 64, "target_r": 32,
                          "total_step": 1000})
    assert ada.delta_linears == ((3072.0, 64.0, 1.0, True, True), (64.0, 3072.0, 1.0, True, True))
    vb = _work(setting, {"peft_type": "VBLORA", "target_modules": ["q_proj", "v_proj"], "r": 4, "num_vectors": 256,
                         "vector_length": 256, "topk": 2})
    from memfit.methods.peft.work import kernels_per_op

    assert vb.sync_ops == pytest.approx(2.0 / kernels_per_op())
    ap = _work(setting, {"peft_type": "ADAPTION_PROMPT", "adapter_len": 100, "adapter_layers": 14,
                         "target_modules": "self_attn"})
    h, kv = 3072.0, 1024.0
    assert [x[:2] for x in ap.delta_linears] == [(h, h), (h, kv / 2), (h, h), (h, 200.0)]
    assert all(share == 0.5 and not f32 for _, _, share, f32, _ in ap.delta_linears)  # 14 of 28 layers
    assert ap.weight_gemms == ((100.0, kv, h, 2.0, 2.0, 0.5),)
    assert ap.token_forward_bytes == pytest.approx(0.5 * (34 * h + 28 * 24 * 100))
    assert model.heads == 24


def test_loha_gralora_randlora_boft_by_hand(setting):
    """LoHa: the Hadamard delta's n x r x k products (2 forward, 6 backward) and 88 B per weight value;
    GraLoRA: LoRA's two fp32 linears and its reshape / cast / scale bytes; RandLoRA: 36 B per scaled-basis value
    (rank 3072 x 3072 on q_proj); BOFT: boft_P (in x in fp32, left on the CPU) converted and uploaded every
    forward, 8 B per value, and two host syncs (the upload, linalg.solve's check)."""
    from memfit.methods.peft.work import kernels_per_op

    loha = _work(setting, {"peft_type": "LOHA", "target_modules": ["q_proj"], "r": 32})
    assert loha.weight_gemms == ((3072.0, 3072.0, 32.0, 2.0, 6.0, 1.0),) and loha.weight_bytes == 88.0 * 3072 ** 2
    gra = _work(setting, {"peft_type": "GRALORA", "target_modules": ["v_proj"], "r": 32})
    assert [x[:2] for x in gra.delta_linears] == [(3072.0, 32.0), (32.0, 1024.0)]
    assert (gra.token_forward_bytes, gra.token_backward_bytes) == (14.0 * 1024, 6.0 * 1024 + 8.0 * 3072)
    rand = _work(setting, {"peft_type": "RANDLORA", "target_modules": ["q_proj"], "r": 32})
    assert rand.weight_bytes == 36.0 * 3072 * 3072
    boft = _work(setting, {"peft_type": "BOFT", "target_modules": ["q_proj", "v_proj"], "boft_block_size": 4})
    assert boft.upload_bytes == 2 * 8.0 * 3072 ** 2 and boft.sync_ops == pytest.approx(4.0 / kernels_per_op())


def test_boft_upload_is_priced_on_the_host_link(setting):
    """The upload runs serially at the pool's host-to-device rate: the step grows by layers x bytes / h2d."""
    from memfit.steptime.speeds import speeds_for

    model, hw = setting
    st = _strategy({"peft_type": "BOFT", "target_modules": ["q_proj"], "boft_block_size": 4})
    t = estimate(model, hw, st).time
    assert t["upload_seconds"] == pytest.approx(28 * 8.0 * 3072 ** 2
                                                / speeds_for(hw, "bf16", "sdpa", DEFAULT_PROFILE).h2d)
    assert t["offload_seconds"] == 0.0


def test_loras_form_at_the_configs_rank(setting):
    """VeRA, PVeRA, UniLoRA and DeLoRA run F.linear(F.linear(x, A), B) at the config's rank in fp32: VeRA's and
    PVeRA's shared projections are frozen (no weight gradient; PVeRA's B takes the r / 2 mean half), UniLoRA's
    and DeLoRA's A and B train."""
    vera = _work(setting, {"peft_type": "VERA", "target_modules": ["v_proj"], "r": 256})
    assert vera.delta_linears == ((3072.0, 256.0, 1.0, True, False), (256.0, 1024.0, 1.0, True, False))
    pvera = _work(setting, {"peft_type": "PVERA", "target_modules": ["v_proj"], "r": 256})
    assert pvera.delta_linears == ((3072.0, 256.0, 1.0, True, False), (128.0, 1024.0, 1.0, True, False))
    delora = _work(setting, {"peft_type": "DELORA", "target_modules": ["v_proj"], "r": 32})
    assert delora.delta_linears == ((3072.0, 32.0, 1.0, True, True), (32.0, 1024.0, 1.0, True, True))
