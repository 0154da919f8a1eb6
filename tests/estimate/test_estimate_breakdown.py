"""Hand-computed breakdowns for a tiny Llama config (every figure worked out in the comments)."""

import pytest

from memfit.estimate import Profile, estimate, meft_traffic_bytes
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import model_from_config
from memfit.spec.strategy import Strategy

# h=64, heads=4 (head_dim 16), kv_heads=2 (kv_dim 32), f=128, L=2, V=100, untied -> P = 86,848
TINY = model_from_config({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 2,
                          "vocab_size": 100}, name="tiny")
GPU1 = parse_hardware("A100-80GB")
PROFILE = Profile(cuda_context_bytes=1e6, fragmentation=0.1, optimizer_step_temp_bytes=0.0,
                  adamw_foreach_temp_copies=0.0, allocator_cached_layers=0.0, allocator_cached_loss=0.0)
BASE = dict(method="full", seq_len=8, micro_batch_size=1, precision="bf16-mixed", attention="sdpa")


def run(**kw):
    return estimate(TINY, GPU1, Strategy(**{**BASE, **kw}), profile=PROFILE)


def test_full_bf16_sdpa():
    est = run(zero_stage=1)  # DeepSpeed on one GPU: the ZeRO paper's 2 + 2 + 12
    g = est.gpu
    assert TINY.parameters == 86_848
    assert g["weights"] == 2 * 86_848 and g["gradients"] == 2 * 86_848 and g["optimizer"] == 12 * 86_848
    # DeepSpeed runs the module in bf16 (no autocast): e = r = 2. Per token per layer: 2 RMSNorms with
    # trained weights, fp32 input copy + bf16 normalised value (4 + 2)*64 = 384 each; their outputs,
    # shared by q/k/v and by gate/up, 2*64 each -> 1024; SDPA: 2 B x (q 64 + k 32 + v 32 + output 64)
    # + fp32 log-sum-exp 4 x 4 heads = 400; SwiGLU gate, act, up, product 2 x 4*128 = 1024 -> 2448;
    # x 8 tokens x 2 layers = 39,168. Tail: final norm 6*64 + head input 2*64 = 512 x 8 = 4,096.
    # The peak is the optimizer step (below), which holds no backward working memory -> 43,264
    assert g["activations"] == 43_264
    assert g["logits"] == 8 * 100 * 12  # fp32 log-softmax 4 + two fp32 grads 8 per logit
    # ZeRO-1: 2 reduce buckets of min(h², P) = 4096 elements x 2 B
    assert g["comm_buffers"] == 2 * 2 * 4096 and g["gathered_params"] == 0
    # live only in the optimizer step: the all-gather bucket min(2e8, P) x 2 B + DeepSpeed's fp32 copy of
    # the 16-bit gradient partition 4 B x P (one GPU)
    assert g["step_temporaries"] == 2 * 86_848 + 4 * 86_848
    # what is live at once: A (loss) = saved 39,168 + tail 4,096 + logits 9,600 = 52,864; last layer's
    # backward 39,168 + (residual gradient 2*64 + MLP gradients 2 x 2*128) x 8 = 5,120 + its and the
    # head's grads; C (step) = gradients 173,696 + step temporaries 521,088 = 694,784 is the peak
    lines = 2 * 86_848 + 43_264 + 9_600 + 6 * 86_848
    assert g["peak_concurrency"] == 694_784 - lines
    formula = 2 * 86_848 + 12 * 86_848 + 16_384 + 694_784
    assert g["overhead"] == pytest.approx(1e6 + 0.1 * formula)
    assert g["total"] == pytest.approx(formula * 1.1 + 1e6)


def test_ddp_autocast_states():
    g = run().gpu  # one GPU, no DDP wrapper: fp32 weights + autocast bf16 copies, fp32 grads, Adam 8 B
    assert (g["weights"], g["gradients"], g["optimizer"]) == (6 * 86_848, 4 * 86_848, 8 * 86_848)
    assert g["comm_buffers"] == 0


def test_eager_adds_scores_and_expanded_kv():
    # DDP under autocast: e = 2, fp32 residual r = 4. Per token per layer: 2 RMSNorms (4 + 4)*64 = 1024,
    # their outputs cast to bf16 by each linear that saves them: q, k, v 3 x 2*64 + gate, up 2 x 2*64 = 640;
    # eager: q and k, v expanded to 4 heads 2 x 3*64 = 384 + o_proj's contiguous input 2*64 = 128;
    # SwiGLU 2 x 4*128 = 1024 -> 3200; scores 4 heads x 8 x 8 x (fp32 softmax 4 + bf16 copy 2) = 1536
    # per layer: (8*3200 + 1536) x 2 = 54,272; tail (4 + 4)*64 + 2*64 = 640 x 8 = 5,120; backward:
    # residual gradient 4*64 + max(MLP 2 x 2*128, eager's 4 x 8 x 8 x (8 - 2) - the MLP side, < 0)
    # = 768 x 8 = 6,144 -> 65,536
    assert run(attention="eager").gpu["activations"] == 65_536


def test_checkpointing():
    # autocast: layer inputs in fp32 2 layers x 4 B x 8 x 64 = 4096; one layer's working set: per token
    # norms 1664 (as above) + SDPA 2 x (64 + 32 + 32 + 64) + 16 = 400 + SwiGLU 1024 = 3088, less the
    # first norm's input (the layer input itself, 4*64): 8 x 2832 = 22,656; tail 5,120. The peak is the
    # step (fp32 gradients 4P), so no backward working memory is held in this line
    assert run(gradient_checkpointing=True).gpu["activations"] == 4096 + 22_656 + 5120


def test_lora_counts_and_intermediates():
    est = run(method="lora", lora_r=4, lora_targets=("q_proj", "v_proj"), lora_dropout=0.05)
    # trainable 2 layers x 4 x ((64+64) + (64+32)) = 1792
    assert est.trainable_parameters == 1792
    g = est.gpu
    # frozen bf16 + fp32 adapter with its autocast bf16 copy (PEFT keeps adapters fp32)
    assert g["weights"] == 2 * 86_848 + 6 * 1792
    assert g["gradients"] == 4 * 1792 and g["optimizer"] == 8 * 1792
    # per adapted linear and token: rank intermediate 2*4 + dropped input copy and mask (2+1)*64 = 200;
    # 2 linears x 8 tokens x 2 layers = 6400; less layer 0's two 1-byte masks (their input needs no
    # gradient, so dropout saves none): 8 x 2 x 64 -> 5376
    assert g["lora_intermediates"] == 6400 - 1024
    # no dropout, autocast: the rank intermediate 2*4 + autocast's bf16 copy of PEFT's fp32 cast of the
    # input 2*64 per linear (traced: the fp32 adapters make PEFT cast, autocast casts back for the matmul)
    assert run(method="lora", lora_r=4, lora_targets=("q_proj", "v_proj"),
               lora_dropout=0.0).gpu["lora_intermediates"] == (8 + 128) * 2 * 8 * 2
    # pure bf16: lora_A saves PEFT's fp32 cast of its input, 4*64, and its rank output is fp32, 4*4
    assert run(method="lora", lora_r=4, lora_targets=("q_proj", "v_proj"), precision="bf16",
               lora_dropout=0.0).gpu["lora_intermediates"] == (16 + 256) * 2 * 8 * 2
    # with dropout on the CPU pseudo-device the mask is a noise tensor of the dropout's dtype (fp32 after
    # PEFT's cast): per linear 4*4 + (4 + 4)*64 = 528, less layer 0's masks 4*64 per linear
    cpu = estimate(TINY, parse_hardware("CPU", cpu_ram="64GB"),
                   Strategy(**{**BASE, "method": "lora", "lora_r": 4, "lora_targets": ("q_proj", "v_proj"),
                               "precision": "bf16", "lora_dropout": 0.1}), profile=PROFILE)
    assert cpu.gpu["lora_intermediates"] == 528 * 2 * 8 * 2 - 256 * 2 * 8
    # under DeepSpeed the adapters are bf16 like the rest: no cast copy
    assert run(method="lora", lora_r=4, lora_targets=("q_proj", "v_proj"), zero_stage=2,
               lora_dropout=0.0).gpu["lora_intermediates"] == 8 * 2 * 8 * 2


def test_fp32_everything_fp32():
    est = run(precision="fp32")
    g = est.gpu
    assert (g["weights"], g["gradients"], g["optimizer"]) == (4 * 86_848, 4 * 86_848, 8 * 86_848)
    # per token per layer: norms (4 + 4)*64 x 2 + shared outputs 4*64 x 2 = 1536; SDPA 4 x (64 + 32 + 32
    # + 64) + 16 = 784; SwiGLU 4 x 4*128 = 2048 -> 4368; x 16 = 69,888; tail 8 x (512 + 256) = 6,144
    # (the peak is the step: no backward working memory in the line)
    assert g["activations"] == 69_888 + 6144
    assert g["logits"] == 8 * 100 * 12


def test_peak_concurrency_with_checkpointing():
    # DDP frees .grad each step, fp32, checkpointing, no optimizer temporaries (PROFILE):
    # grads 4P = 347,392 (built up during backward); inputs 2 layers x 4 B x 8 x 64 = 4096;
    # recomputed layer 8 x (4368 - its input 256) = 32,896; tail 6,144; one layer's backward 8 x
    # (residual gradient 4*64 + MLP gradients 2 x 4*128) = 10,240 (in the line only when the peak holds
    # it); logits 9,600
    g = run(precision="fp32", gradient_checkpointing=True).gpu
    assert g["activations"] == 4096 + 32_896 + 6144
    # A (loss) = 4096 + 6144 + 9,600 = 19,840; B1 (last layer recomputes) = 32,896 + 10,240 + 4096
    # + its and the head's grads 4 x (36,992 + 6,400) = 173,568 -> 220,800; B2 (first layer) = 32,896
    # + 10,240 + its input 2048 + all grads but its own and the embedding's 4 x (86,848 - 36,992 - 6,400)
    # = 173,824 -> 219,008; C (step) = all grads 347,392 (no optimizer temporaries here) <- the peak
    lines = 347_392 + 43_136 + 9_600
    assert g["peak_concurrency"] == 347_392 - lines
    static = g["weights"] + g["optimizer"]
    assert g["total"] - g["overhead"] == pytest.approx(static + 347_392)
    # with AdamW's CPU temporaries (2.5 B/param) the step is higher still
    cpu = estimate(TINY, parse_hardware("CPU", cpu_ram="64GB"),
                   Strategy(**{**BASE, "precision": "fp32", "gradient_checkpointing": True}))
    assert cpu.gpu["total"] - cpu.gpu["overhead"] == pytest.approx(static + 347_392 + 2.5 * 86_848)


def test_qlora_weights():
    est = run(method="qlora", lora_r=4, lora_targets=("q_proj",), double_quant=False)
    linear = 2 * (4096 + 2048 + 2048 + 4096 + 3 * 8192)  # 73,728 quantised values
    other = 86_848 - linear  # embeddings, head, norms: fp32 after prepare_model_for_kbit_training
    dequant = 64 * 128 * 2  # the largest linear dequantised to 16-bit while it runs
    adapter = 2 * 4 * (64 + 64)
    assert est.gpu["weights"] == pytest.approx(linear * (0.5 + 0.0625) + other * 4 + dequant + adapter * 6)


def test_offload_moves_optimizer_to_cpu():
    hw = parse_hardware("2xA100-80GB", cpu_ram="64GB")
    est = estimate(TINY, hw, Strategy(**{**BASE, "zero_stage": 2, "offload": "optimizer"}), profile=PROFILE)
    assert est.gpu["optimizer"] == 0 and est.gpu["gradients"] == 0
    c = est.cpu
    # each of the 2 processes holds half the 12 B/param state and a fp32 gradient partition
    assert c["offloaded_optimizer"] == pytest.approx(2 * 12 * 86_848 / 2)
    assert c["offloaded_gradients"] == pytest.approx(2 * 4 * 86_848 / 2)


def test_meft_traffic_by_hand():
    st = Strategy(**{**BASE, "method": "meft", "meft_neurons": 16, "meft_top_k": 2, "seq_len": 4})
    prof = Profile(meft_buffer_fraction=0.25)
    t = meft_traffic_bytes(TINY, st, prof)
    # memfit.meft: buffer rows = max(K, ceil(16/4)) = 4; rows used = min(4, K*b*s = 8) = 4; experts
    # auto = ceil(sqrt(16)) = 4, so a router. Per layer H2D: key + value rows in the buffer dtype (the
    # activations', bf16) 2*64*4*2 = 1024 + buffer positions b*s*K int32 4*2*4 = 32 + row ids 4 x 8 = 32
    assert t["h2d"] == 2 * (1024 + 32 + 32)
    # D2H per layer: hidden states 4*64*2 = 512 + probed expert ids 4 tokens x n_probe 8 x 8 B = 256
    # + slice gradients 1024
    assert t["d2h"] == 2 * (512 + 256 + 1024)
    est = estimate(TINY, GPU1, st, profile=prof)
    # W_K, W_V x neurons x h x (param + grad + 2 Adam moments) fp32 + per neuron a touched flag and two
    # int64 step counters + 4 staging tables of 4 rows x h x 2 B, per layer
    host = 2 * (2 * 16 * 64 * 16 + 16 * 17 + 4 * 4 * 64 * 2)
    assert est.cpu["meft_store"] == host
    assert est.cpu["pinned_buffers"] == 0  # MEFT's pinned staging is that explicit line
    assert est.to_dict()["traffic"]["h2d"] == 2176
    # device: one buffer pair per layer 2 x (4 rows x 64 x 2 tables x 2 B) = 2048; saved per token and
    # layer: x 2*64 + activations 4 rows x 2 B + gates 4 x 4 B + the router's fp32 copy of x 4*64 = 408
    # x 4 tokens x 2 layers = 3264
    assert est.gpu["meft_buffers"] == 2048 + 3264
    # the CPU as the device: the store lives in the RAM the allocator measures, so it joins the device line
    cpu = estimate(TINY, parse_hardware("CPU", cpu_ram="64GB"), st, profile=prof)
    assert cpu.cpu["meft_store"] == 0
    assert cpu.gpu["meft_buffers"] == 2048 + 3264 + host
    # checkpointing: each layer's forward runs twice (both pass over the PCIe), and backward reloads the
    # first forward's rows (the recomputation refilled the buffers): H2D 2 x 1088 + 1024 per layer
    gc = meft_traffic_bytes(TINY, st.model_copy(update={"gradient_checkpointing": True}), prof)
    assert gc["h2d"] == 2 * (2 * 1088 + 1024) and gc["d2h"] == 2 * (2 * (512 + 256) + 1024)
    # experts auto = ceil(sqrt(16)) = 4: router 64 x 4 per layer, trained on the GPU
    assert est.gpu["gradients"] == 4 * 2 * 64 * 4  # fp32 grads under autocast
    assert est.trainable_parameters == 2 * 64 * 4 + 2 * 2 * 16 * 64
    # adapter FLOPs: every token meets the 4 buffered rows of both matrices, x3 with backward, 2 layers,
    # plus the router trained like any parameter (6 FLOPs per parameter and token); 4 tokens
    assert est.time["adapter_flops"] == 4 * (12 * 64 * 4 * 2 + 6 * 2 * 64 * 4)
