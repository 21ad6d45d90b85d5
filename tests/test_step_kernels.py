"""A decode step's elementwise kernels (inference/step_kernels.py): the residual add with its RMSNorm against the
sum and decoder.RMSNorm, SwiGLU against F.silu(gate) * up; run by Triton's interpreter on the CPU where triton
is installed (tests/test_gpu.py runs them on a GPU and in the engine)."""
import pytest
import torch
import torch.nn.functional as F


def check_kernels_interpreted() -> None:
    """Run under TRITON_INTERPRET=1, in fp16 (the interpreter's bf16 is broken): rows of widths a power of two
    and not, one row and several; the sum exactly x + delta's, the norm within a rounding of decoder.RMSNorm's;
    SwiGLU exactly the eager ops'."""
    from shardlm.inference import step_kernels
    from shardlm.model.decoder import RMSNorm
    g = torch.Generator().manual_seed(0)
    for n, width in ((1, 256), (5, 200), (3, 1030)):
        norm = RMSNorm(width, 1e-5)
        norm.weight.data = torch.randn(width, generator=g).half()
        x, delta = (torch.randn(n, 1, width, generator=g).half() * 4 for _ in range(2))
        total, h = torch.ops.shardlm.add_rms_norm(x, delta, norm.weight, norm.eps)
        assert torch.equal(total, x + delta)
        with torch.no_grad():
            torch.testing.assert_close(h, norm(x + delta), atol=4e-3, rtol=2e-3)
        h = torch.randn(n, 1, 2 * width, generator=g).half() * 3
        gate, up = h.chunk(2, dim=-1)
        assert torch.equal(torch.ops.shardlm.silu_mul(h), F.silu(gate) * up)
    assert not step_kernels.norm_ok(norm, x)  # the interpreter's tensors are on the CPU


def check_decode_layer_interpreted() -> None:
    """Run under TRITON_INTERPRET=1, in fp16, the kernels let run on the CPU: a decode step through
    slots.decode_layer (the fused attention step, add_norm, SwiGLU) against the same step through decoder_layer's
    unfused path, for Llama with GQA, GPT-2 (LayerNorm, no RoPE), a sliding window and MoE, at one row and at
    three with an idle one: the same logits and caches within fp16's roundings of the fused RoPE."""
    from test_generation import tiny

    from shardlm.inference import decode_attention, slots, step_kernels
    from shardlm.inference.slots import StaticKVCache, decoder_layer, forward_tokens
    decode_attention.triton_ok = step_kernels.triton_ok = lambda t: True
    taken, real = [], slots.decode_layer
    slots.decode_layer = lambda *a: taken.append(1) or real(*a)
    g = torch.Generator().manual_seed(0)
    max_len = 64
    for changes in (dict(num_kv_heads=2), dict(arch="gpt2"), dict(sliding_window=6), dict(num_experts=4, top_k=2)):
        model = tiny(**changes).half()
        for name, p in model.named_parameters():  # each norm its own weights (initialised to ones, all alike)
            if "norm" in name:
                p.data.uniform_(0.5, 1.5, generator=g)
        rope = None if changes.get("arch") == "gpt2" else model.rope(0, max_len, "cpu", torch.half)
        for positions in ([[9]], [[5], [20], [max_len - 1]]):  # the last: an idle row, at the scratch position
            n = len(positions)
            caches = [StaticKVCache(model, n, max_len, "cpu", torch.half) for _ in range(2)]
            for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
                b.copy_(a.copy_(torch.randn(a.shape, generator=g).half()))
            ids, at = torch.randint(0, 200, (n, 1), generator=g), torch.tensor(positions)
            taken.clear()
            with torch.no_grad():
                got = forward_tokens(model, caches[0], rope, ids, at, keys=32)
                want = forward_tokens(model, caches[1], rope, ids, at, keys=32, layer=lambda *a: decoder_layer(*a))
            assert taken, changes
            torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
            for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
                torch.testing.assert_close(a[..., :max_len - 1, :], b[..., :max_len - 1, :], atol=0.01, rtol=0.01)


def check_compiled_step_logs_little() -> None:
    """Run under TRITON_INTERPRET=1, the kernels let run on the CPU: Inductor's log of an opaque op that a graph
    calls first prints the op's arguments (torch 2.11 prints them whether or not the log is on), and an argument
    behind a chain of opaque ops prints the chain, doubled at each add_norm. int4's decode step first calls the
    int8 head's product at its end: printed behind every layer's kernels, a 32-layer model's compile took
    minutes. Compiled with the log on, the head's printout is no longer than the first layer's ops', and the
    logits are the eager step's."""
    import logging

    from test_generation import tiny

    from shardlm.inference import decode_attention, int4, int8, slots, step_kernels
    from shardlm.inference.quantize import quantize
    from shardlm.inference.slots import StaticKVCache, forward_tokens
    decode_attention.triton_ok = step_kernels.triton_ok = int4.triton_ok = int8.triton_ok = lambda t: True
    taken, real = [], slots.decode_layer
    slots.decode_layer = lambda *a: taken.append(1) or real(*a)
    model = tiny(num_layers=6).half()
    quantize(model, "int4")
    rope = model.rope(0, 64, "cpu", torch.half)
    cache = StaticKVCache(model, 1, 64, "cpu", torch.half)
    ids, at = torch.tensor([[7]]), torch.tensor([[9]])
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.extend(
        [len(record.getMessage())] if record.getMessage().startswith("Creating implicit fallback") else [])
    logging.getLogger("torch._inductor.graph").addHandler(handler)
    torch._logging.set_logs(inductor=logging.INFO)
    torch._inductor.config.force_disable_caches = True  # a cached graph is not lowered again, nor logged
    with torch.no_grad():
        got = torch.compile(lambda: forward_tokens(model, cache, rope, ids, at, keys=32))()
        want = forward_tokens(model, cache, rope, ids, at, keys=32)
    assert taken
    *first_layer, head = logged  # each op's first call: the first layer's ops, then the head's product
    assert head <= max(first_layer), logged
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)


@pytest.mark.timeout(240)
def test_compiled_step_logs_little_in_tritons_interpreter():
    from helpers import run_in_tritons_interpreter
    run_in_tritons_interpreter("test_step_kernels", "check_compiled_step_logs_little")


@pytest.mark.timeout(240)
def test_decode_layer_in_tritons_interpreter():
    from helpers import run_in_tritons_interpreter
    run_in_tritons_interpreter("test_step_kernels", "check_decode_layer_interpreted")


@pytest.mark.timeout(240)
def test_step_kernels_in_tritons_interpreter():
    from helpers import run_in_tritons_interpreter
    run_in_tritons_interpreter("test_step_kernels", "check_kernels_interpreted")


def test_on_the_cpu_the_step_is_the_models_ops():
    """On the CPU add_norm is the sum and the norm and mlp the block's MLP, bit for bit."""
    from shardlm.config import load_config
    from shardlm.inference import step_kernels
    from shardlm.model.decoder import MLP, RMSNorm
    x, delta = torch.randn(2, 1, 64, dtype=torch.bfloat16), torch.randn(2, 1, 64, dtype=torch.bfloat16)
    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    norm.weight.data.normal_()
    mlp = MLP(load_config("tiny").model).to(torch.bfloat16)
    for p in mlp.parameters():
        p.data.normal_()
    with torch.no_grad():
        total, h = step_kernels.add_norm(norm, x, delta)
        assert torch.equal(total, x + delta) and torch.equal(h, norm(x + delta))
        same, h = step_kernels.add_norm(norm, x, None)
        assert same is x and torch.equal(h, norm(x))
        h = torch.randn(2, 1, mlp.up.in_features, dtype=torch.bfloat16)
        assert torch.equal(step_kernels.mlp(mlp, h), mlp(h))
