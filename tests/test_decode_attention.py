"""A decode step's attention with its RoPE and cache writes in one kernel (decode_attention.attention_step):
run by Triton's interpreter on the CPU where triton is installed (tests/test_gpu.py runs it on a GPU and in the
engine), against the unfused step: the rotations in torch, the cache writes by indexing, the flash-decoding
kernel."""
import contextlib
import warnings

import pytest
import torch


def unfused(qkv, angles, k_cache, v_cache, positions, bounds, heads, keys):
    """What slots.decoder_layer does without the fused kernel, the rotations in fp32 as the compiled step."""
    from shardlm.inference.decode_attention import decode_attention
    from shardlm.model.rope import rotate_half
    n, d = qkv.shape[0], k_cache.shape[-1]
    kv = k_cache.shape[1]
    q, k, v = qkv.view(n, 1, heads + 2 * kv, d).transpose(1, 2).split([heads, kv, kv], dim=1)
    if angles is not None:
        cos, sin = (a.float() for a in angles)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(qkv.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(qkv.dtype)
    rows = torch.arange(n)
    k_cache[rows[:, None], :, positions] = k.transpose(1, 2)
    v_cache[rows[:, None], :, positions] = v.transpose(1, 2)
    return decode_attention(q, k_cache[:, :, :keys], v_cache[:, :, :keys], None, bounds)


@contextlib.contextmanager
def stores_seen_after_the_launch():
    """Triton's interpreter with every store of a launch held back until its programs have all run: a GPU's
    programs run at once, and one need not see another's cache write (nor a thread its program's other
    threads'), where the interpreter runs them one by one, each seeing all earlier stores. False where this
    triton's interpreter lacks the hooks (none held back)."""
    from triton.runtime import interpreter
    builder, grid = getattr(interpreter, "InterpreterBuilder", None), getattr(interpreter, "GridExecutor", None)
    if not (hasattr(builder, "create_masked_store") and hasattr(grid, "_restore_args_dev")):
        yield False
        return
    held = []

    def store(self, ptrs, value, mask, *rest):
        held.append((ptrs.data.copy(), value.data.copy(), mask.data.copy()))

    def restore(self, *args, **kwargs):  # after the grid, before the results go back to the arguments
        for ptrs, value, mask in held:
            interpreter._interpreter.store(ptrs, value, mask)
        held.clear()
        return restore_args(self, *args, **kwargs)

    store_masked, restore_args = builder.create_masked_store, grid._restore_args_dev
    builder.create_masked_store, grid._restore_args_dev = store, restore
    try:
        yield True
    finally:
        builder.create_masked_store, grid._restore_args_dev = store_masked, restore_args


def check_step_interpreted() -> None:
    """Run under TRITON_INTERPRET=1, in fp16 (the interpreter's bf16 is broken): rows at the first position,
    the last, either side of a split's edge, mid-way, and an idle slot (at the scratch position, which sees
    nothing); with and without RoPE, GQA and a sliding window; the same outputs and the same caches. The
    launch's stores are seen only after it (stores_seen_after_the_launch): every program must take the new
    key and value from its registers, wherever in its split they fall, not from the cache it writes."""
    with stores_seen_after_the_launch() as held:
        _check_step(held)


def _check_step(held: bool) -> None:
    from shardlm.inference.decode_attention import SPLIT, attention_step
    from shardlm.inference.slots import visible_bounds
    g = torch.Generator().manual_seed(0)
    d, keys = 32, 3 * SPLIT
    scratch = keys + 5
    positions = torch.tensor([[0], [keys - 1], [SPLIT - 1], [SPLIT], [100], [scratch]])
    n = positions.shape[0]
    for heads, kv, window, rope in ((4, 4, 0, True), (4, 2, 0, True), (4, 1, 37, True), (2, 2, 0, False)):
        qkv = torch.randn(n, 1, (heads + 2 * kv) * d, generator=g).half()
        caches = [torch.randn(n, kv, scratch + 1, d, generator=g).half() for _ in range(2)]
        angles = None
        if rope:
            turns = positions[:, :, None, None].float() * torch.rand(d // 2, generator=g).repeat(2)
            angles = (turns.cos().half(), turns.sin().half())
        bounds = visible_bounds(positions, keys, window, scratch)
        want_k, want_v = (c.clone() for c in caches)
        want = unfused(qkv, angles, want_k, want_v, positions, bounds, heads, keys)
        got = attention_step(qkv, angles, *caches, positions, heads, keys, window, scratch)
        assert got.shape == (n, 1, heads * d) and got.dtype == torch.float16
        active = positions[:, 0] != scratch  # the idle row's scratch write is never read: either may skip it
        torch.testing.assert_close(caches[0][active], want_k[active], atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(caches[1][active], want_v[active], atol=0, rtol=0)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
        assert (got[~active] == 0).all()
    print("stores held back" if held else "stores not held back: this interpreter lacks the hooks")


@pytest.mark.timeout(240)
def test_attention_step_in_tritons_interpreter():
    from helpers import run_in_tritons_interpreter
    out = run_in_tritons_interpreter("test_decode_attention", "check_step_interpreted")
    if "lacks the hooks" in out:
        warnings.warn("triton's interpreter ran the fused step's stores as they came: a program reading a key "
                      "another program writes goes unchecked")


def test_decode_step_takes_the_fused_kernel_only_on_a_gpu():
    """On the CPU the decode step keeps its unfused path (tests/test_gpu.py checks a GPU's choice)."""
    from shardlm.inference.decode_attention import step_kernel_ok
    x, cache = torch.zeros(2, 1, 64, dtype=torch.bfloat16), torch.zeros(2, 2, 16, 32, dtype=torch.bfloat16)
    assert not step_kernel_ok(x, cache)


def split_kernel_signature() -> dict:
    """decode_attention._split_kernel's runtime arguments and their types, for Triton's compiler."""
    sig = dict.fromkeys(["q_ptr", "k_ptr", "v_ptr"], "*bf16")
    sig.update(lo_ptr="*i32", hi_ptr="*i32", acc_ptr="*fp32", max_ptr="*fp32", sum_ptr="*fp32")
    sig.update(dict.fromkeys(["sq_n", "sq_h", "sk_n", "sk_h", "sk_t", "sv_n", "sv_h", "sv_t"], "i32"))
    sig.update(scale="fp32", cos_ptr="*bf16", sin_ptr="*bf16", pos_ptr="*i64", sc_n="i32", n_keys="i32",
               window="i32", idle="i32")
    return sig


@pytest.mark.timeout(240)
def test_the_kernels_compile_for_hopper_in_every_mode():
    """Compiled on the CPU by Triton for sm_90 (what the interpreter never does: it ran a kernel whose argument
    a local name shadowed, which Triton's compiler refuses)."""
    pytest.importorskip("triton.backends.nvidia")
    from test_quant_asm import compiles_for

    from shardlm.inference import decode_attention as da
    sig = split_kernel_signature()
    for fused in (False, True):
        for rope in (False, True):
            modes = dict(HEADS=8, GROUP=2, D=64, SPLIT=da.SPLIT, BLOCK=da.BLOCK, FUSED=fused, ROPE=rope)
            assert compiles_for(da._split_kernel, {**sig, **dict.fromkeys(modes, "constexpr")}, modes, 90)
    modes = dict(SPLITS=8, BLOCK=16, D=64)
    assert compiles_for(da._combine_kernel, {"acc_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32",
                                             "y_ptr": "*bf16", **dict.fromkeys(modes, "constexpr")}, modes, 90)
