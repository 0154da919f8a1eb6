"""The traced step (FakeTensorMode) predicts the real step's allocator-level peak of the same loop."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memfit.measure.probe import TensorMemoryProbe  # noqa: E402
from memfit.measure.trace import LiveStorageTracker, config_path, traced_step  # noqa: E402
from memfit.spec.strategy import Strategy  # noqa: E402


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory, llama_config):
    d = tmp_path_factory.mktemp("trace")
    llama_config(vocab_size=512, intermediate_size=172, max_position_embeddings=512,
                 tie_word_embeddings=False).save_pretrained(d)
    return d


def real_step_peak(folder, s: Strategy) -> int:
    """The same loop as traced_step, on real tensors, measured by the profiler probe."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(folder)
    cfg._attn_implementation = s.attention
    net = AutoModelForCausalLM.from_config(cfg)
    if s.gradient_checkpointing:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if s.method == "lora":
        net = get_peft_model(net, LoraConfig(r=s.lora_r, lora_alpha=s.lora_alpha, lora_dropout=0.0,
                                             target_modules=list(s.lora_targets), task_type="CAUSAL_LM"))
        if s.gradient_checkpointing:
            net.enable_input_require_grads()
    net.train()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (s.micro_batch_size, s.seq_len))

    def step():
        net(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with TensorMemoryProbe("cpu", categories=False, baseline=lambda: [
            *net.parameters(), *net.buffers(), ids,
            *[v for st in opt.state.values() for v in st.values()]]) as probe:
        step()
    return probe.result().peak_allocated_bytes


@pytest.mark.parametrize("kw", [
    dict(method="full", attention="sdpa", gradient_checkpointing=False),
    dict(method="lora", attention="eager", gradient_checkpointing=True),
    dict(method="full", attention="sdpa", gradient_checkpointing=True),  # no s×s mask may appear
])
def test_traced_peak_matches_the_real_step(tiny_config, kw):
    torch.set_num_threads(1)
    s = Strategy(precision="fp32", seq_len=128, micro_batch_size=2, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                 lora_targets=("q_proj", "v_proj", "down_proj"), **kw)
    traced = traced_step(str(tiny_config), s)
    real = real_step_peak(tiny_config, s)
    assert abs(traced["peak_bytes"] - real) <= 0.01 * real, (traced["peak_bytes"], real)
    assert traced["model_states_bytes"] < traced["peak_bytes"]


def test_lora_bf16_mixed_traces_the_base_in_bf16_like_the_trainer(tiny_config):
    """memfit's trainer loads LoRA's frozen base in bf16 under bf16-mixed: the trace does the same, so its
    model states are exactly 2 bytes per base parameter smaller than under fp32 (adapters, Adam stay fp32)."""
    torch.set_num_threads(1)
    kw = dict(method="lora", seq_len=32, micro_batch_size=1, lora_r=4, lora_alpha=8, lora_dropout=0.0,
              lora_targets=("q_proj", "v_proj"))
    fp32 = traced_step(str(tiny_config), Strategy(precision="fp32", **kw))
    mixed = traced_step(str(tiny_config), Strategy(precision="bf16-mixed", **kw))
    layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 172 + 2 * 64  # q, o, k, v, MLP, two norms
    base_params = 2 * 512 * 64 + 2 * layer + 64  # embeddings, lm_head, 2 layers, final norm
    assert fp32["model_states_bytes"] - mixed["model_states_bytes"] == 2 * base_params


def test_tracker_counts_storages_once_and_frees():
    tr = LiveStorageTracker()
    a = torch.empty(1000, dtype=torch.uint8)
    tr.track(a)
    tr.track(a[10:])  # a view: same storage
    b = torch.empty(500, dtype=torch.uint8)
    tr.track(b)
    assert tr.current == 1500 and tr.peak == 1500
    del b
    assert tr.current == 1000 and tr.peak == 1500


def test_unsupported_method_and_unknown_model():
    from memfit.errors import IncompatibleError, MemfitError

    with pytest.raises(IncompatibleError, match="qlora is not traced"):
        traced_step("llama-2-7b", Strategy(method="qlora"))
    with pytest.raises(MemfitError, match="neither a folder"):
        config_path("no-such-model")
    assert config_path("llama-2-7b").name == "llama-2-7b.json"
