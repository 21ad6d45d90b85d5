"""Module-level functions that the spawned test workers import by name."""
import os
import signal
import time

import torch
import torch.distributed as dist


def all_reduce_rank(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def visible_gpus(rank, world):
    return torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES")


def hang_on_rank_one(rank, world):
    if rank == 1:
        time.sleep(3600)
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here for a peer that never comes
    return t.item()


def raise_on_rank_zero(rank, world):
    if rank == 0:
        raise RuntimeError("boom on rank 0")
    return rank


def mesh_groups(rank, world, dp, tp, pp):
    from shardlm.mesh import build_mesh
    m = build_mesh(pp=pp, dp=dp, tp=tp)
    members = {}
    for axis in ("dp", "tp", "pp"):
        t = torch.tensor([float(rank)])
        group = getattr(m, f"{axis}_group")
        if group is not None:  # an axis of size 1 has no group and needs no communication
            dist.all_reduce(t, group=group)
        members[axis] = t.item()
    return (m.dp_rank, m.tp_rank, m.pp_rank), members


def mesh_views(rank, world, dp, cp, tp, ep):
    """Each named group's members (their ranks' sum) and this rank's coordinates in both views."""
    from shardlm.mesh import build_mesh
    m = build_mesh(dp=dp, cp=cp, tp=tp, ep=ep)
    sums = {}
    for name in ("dp+cp", "ep", "edp", "tp"):
        t = torch.tensor([float(rank)])
        if m.group(name) is not None:
            dist.all_reduce(t, group=m.group(name))
        sums[name] = t.item()
    return {a: m.coord(a) for a in ("dp", "cp", "tp", "edp", "ep")}, sums


def tensor_parallel_mlp(rank, world, seed, distributed=True):
    """Embedding -> column -> row MLP with the vocabulary and features split over `world` ranks (or, with
    distributed=False, the degree-1 layers on the full weights); returns the output and the local grads."""
    from shardlm.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    g = torch.Generator().manual_seed(seed)
    w1, b1, w2, b2 = torch.randn(16, 8, generator=g), torch.randn(16, generator=g), torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    emb = torch.randn(12, 8, generator=g)
    ids = torch.randint(0, 12, (3, 5), generator=g)
    group = dist.group.WORLD if distributed else None
    e = VocabParallelEmbedding(12, 8, group, sequence_parallel=False)
    col = ColumnParallelLinear(8, (16,), True, group, sequence_parallel=False, init_std=0.02)
    row = RowParallelLinear(16, 8, True, group, sequence_parallel=False, init_std=0.02)
    n = 16 // world
    with torch.no_grad():
        e.weight.copy_(emb.chunk(world)[rank])
        col.weight.copy_(w1[rank * n:(rank + 1) * n])
        col.bias.copy_(b1[rank * n:(rank + 1) * n])
        row.weight.copy_(w2[:, rank * n:(rank + 1) * n])
        row.bias.copy_(b2)
    x = e(ids)
    x.retain_grad()
    y = row(torch.relu(col(x)))
    y.square().sum().backward()
    return y.detach(), x.grad, col.weight.grad, row.weight.grad, e.weight.grad


def _block_gradients(rank, world, sp: bool, batch: int, compile_block, lora: bool = False) -> list[dict]:
    """One tensor-parallel llama block (with LoRA adapters on every linear, drawn at random, where `lora`),
    eager then compiled by `compile_block(model, block)`: the input gradient and the gradients of the block's
    trained weights of each, by name."""
    from shardlm.config import LoRAConfig, ModelConfig
    from shardlm.model import Decoder
    from shardlm.parallel.lora import apply_lora
    from shardlm.parallel.tensor import sum_partial_gradients, tensor_parallel
    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=4,
                      ffn_hidden_size=64, max_seq_len=16)
    seq = cfg.max_seq_len // world if sp else cfg.max_seq_len
    grads = []
    for compiled in (False, True):
        with torch.device("meta"):
            model = Decoder(cfg)
        tensor_parallel(model, dist.group.WORLD, sp)
        if lora:
            apply_lora(model, LoRAConfig(rank=4, alpha=8, targets="all-linear"))
        model.to_empty(device="cpu")
        model.init_weights(0)
        if lora:  # B starts at zero: the adapters' own gradients would not tell
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if ".lora." in name:
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.2)
        sum_partial_gradients(model, dist.group.WORLD)
        block = model.blocks()[0]
        if compiled:
            compile_block(model, block)
        g = torch.Generator().manual_seed(1 + rank)
        x = torch.randn(batch, seq, cfg.hidden_size, generator=g, requires_grad=True)
        dy = torch.randn(batch, seq, cfg.hidden_size, generator=g)
        (block(x, model.rope(0, cfg.max_seq_len, x.device, x.dtype), None, None) * dy).sum().backward()
        grads.append({"input": x.grad, **{n: p.grad for n, p in block.named_parameters() if p.requires_grad}})
    return grads


def compiled_block_gradients(rank, world, sp: bool, lora: bool = False):
    """Eager and compiled by AOTAutograd with the eager backend (what decides the gradients, without
    inductor's compile time): `_block_gradients`."""
    return _block_gradients(rank, world, sp, 2, lambda model, block: block.compile(backend="aot_eager"), lora)


def _compile_everything_here():
    """Inductor's and AOTAutograd's caches off: a graph fused in an earlier process would come back from the
    cache already fused, whatever this process's code does."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False


def _cpu_async_tp(calls: dict):
    """Let async TP run on the CPU: torch's reference versions of the fused ops (functional collectives, then
    the matmul), counted in `calls`, and the pass let run on a build without NCCL. Returns torch's
    symmetric-memory test mode, to run under: it opens the pass's gate for the groups given symmetric
    memory (its live registry), as on GPUs."""
    import torch.distributed._symmetric_memory as symm_mem
    _compile_everything_here()

    def counted(name, reference):
        def op(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return reference(*args, **kwargs)
        return op
    torch.library.impl("symm_mem::fused_all_gather_matmul", "CPU",
                       counted("fused_all_gather_matmul", symm_mem._fused_all_gather_matmul_fallback))
    torch.library.impl("symm_mem::fused_matmul_reduce_scatter", "CPU",
                       counted("fused_matmul_reduce_scatter", symm_mem._fused_matmul_reduce_scatter_fallback))
    dist.is_nccl_available = lambda: True  # the pass's gate on the build; this process only
    return symm_mem._test_mode(symm_mem._group_name_to_store)


def async_tp_block_gradients(rank, world):
    """A tp + sp block, eager and compiled by inductor with async tensor parallelism (`_block_gradients`), and
    how often the compiled one ran each fused collective-matmul, on the CPU (`_cpu_async_tp`): what is
    checked is that shardlm's collectives take the form the pass fuses, and that the fused block computes
    the same. Batch 1: views unless fusable."""
    from shardlm.parallel.async_tp import async_tensor_parallel
    calls = {"fused_all_gather_matmul": 0, "fused_matmul_reduce_scatter": 0}
    with _cpu_async_tp(calls):
        grads = _block_gradients(rank, world, True, 1, lambda model, block: block.compile(
            options=async_tensor_parallel(model, dist.group.WORLD)))
    return grads, calls


def train_with_async_tp(rank, world, overrides: dict):
    """`train_and_capture` with parallel.tp_async, and how many collective-matmul pairs inductor fused while
    compiling (`_compile_everything_here`). On the CPU through `_cpu_async_tp`, with the GPUs' checks
    answered yes; on GPUs past the refusal of the fused kernels (async_tp.NOT_VALIDATED)."""
    import torch._inductor.fx_passes.micro_pipeline_tp as pass_module
    import shardlm.parallel.parallelize as parallelize
    _compile_everything_here()
    fused = [0]
    for name in ("_insert_fused_all_gather_matmul", "_insert_fused_matmul_reduce_scatter"):
        def insert(*args, _insert=getattr(pass_module, name), **kwargs):
            fused[0] += 1
            return _insert(*args, **kwargs)
        setattr(pass_module, name, insert)
    if overrides.get("train.device") == "cuda":  # all but the kernels' validation, which is what is tested
        from shardlm.parallel.async_tp import NOT_VALIDATED, unavailable

        def past_validation(tp, device):
            why = unavailable(tp, device)
            return None if why == NOT_VALIDATED else why
        parallelize.async_tp_unavailable = past_validation
        return train_and_capture(rank, world, overrides), fused[0]
    parallelize.async_tp_unavailable = lambda tp, device: None
    with _cpu_async_tp({}):
        return train_and_capture(rank, world, overrides), fused[0]


# ---- data-parallel family -------------------------------------------------------------------------

def tiny_trainer(world: int, overrides: dict, **kwargs):
    """A quiet `tiny` trainer on `world` data-parallel ranks (no TensorBoard, no log lines); `overrides` win."""
    from shardlm.config import load_config
    from shardlm.trainer import Trainer
    cfg = load_config("tiny", {"parallel.dp": str(world), "train.tensorboard": "false", **overrides})
    return Trainer(cfg, log=lambda *a: None, **kwargs)


def train_and_capture(rank, world, overrides: dict, out_dir=None, resume=None):
    """Train `tiny` with `overrides`; return the losses, the gathered master weights, and this rank's
    owned gradient (last step) and optimizer-state slices."""
    trainer = tiny_trainer(world, {"train.log_every": "1", **overrides}, out_dir=out_dir, resume=resume)
    cfg, engine = trainer.cfg, trainer.engine
    captured = {}
    real_step = engine.optimizer_step

    def step(lr, n):
        if n == cfg.train.steps:  # gradients are all in and reduced: what a rank holds at its peak
            captured["grad"] = engine.owned_shards("grad")
            captured["bytes"] = engine.memory()
        real_step(lr, n)
    engine.optimizer_step = step
    records = trainer.run()
    key = "exp_avg" if cfg.train.optimizer == "adamw" else "momentum_buffer"
    masters, _ = trainer.parallel.gather_full_state()  # full tensors by name, on the main rank
    return {"losses": [r["loss"] for r in records], "grad_norms": [r["grad_norm"] for r in records],
            "eval_losses": [r["eval_loss"] for r in records if "eval_loss" in r],
            "masters": {k: v.float().cpu() for k, v in masters.items()} if masters is not None else None,
            "grad": captured.get("grad", {}), "state": engine.owned_shards(key),
            "bytes": captured["bytes"], "numel": sum(e.flat.numel for e in engine.group_engines()),
            "moe": [{k: v for k, v in r.items() if k.startswith("moe/")} for r in records],
            "router_bias": trainer.moe.state()}


def lines_of_a_resume(rank, world, overrides: dict, resume):
    """What a trainer resuming `resume` on `world` data-parallel ranks says on this rank before it runs."""
    from shardlm.config import load_config
    from shardlm.trainer import Trainer
    said = []
    cfg = load_config("tiny", {"parallel.dp": str(world), "train.tensorboard": "false", **overrides})
    trainer = Trainer(cfg, resume=resume, log=said.append)
    trainer.close()
    return said


def zero3_residency(rank, world):
    """Each ZeRO-3 unit's kind, and whether its full weights occupy memory at rest, after forward, and after
    backward."""
    trainer = tiny_trainer(world, {"parallel.zero_stage": "3", "train.micro_batch_size": "2",
                                   "parallel.persist_threshold": "100"})
    eng = trainer.engine
    held = lambda: [u.resident for u in eng.unit_states()]  # noqa: E731
    kinds = [u.kind for u in eng.unit_states()]
    rest = held()
    x, y = (t.to(trainer.device) for t in trainer.data.micro_batch_at(0, 0))
    loss = trainer.model(x, y)
    after_forward = held()
    eng.prepare_backward(True)
    loss.backward()
    eng.finish_backward(True)
    return kinds, rest, after_forward, held()


def fp16_overflow_on_rank_one(rank, world, overrides: dict):
    """Rank 1's loss overflows; every rank must skip the step and keep its weights."""
    trainer = tiny_trainer(world, {"train.precision": "fp16", "train.micro_batch_size": "2", **overrides})
    before, _ = trainer.engine.gather_full_state()
    before = {k: v.clone() for k, v in before.items()} if before is not None else None
    real_forward = trainer.forward_backward.forward
    trainer.forward_backward.forward = lambda x, y: real_forward(x, y) * (float("inf") if rank == 1 else 1.0)
    trainer.train_step()
    after, _ = trainer.engine.gather_full_state()
    unchanged = None if before is None else all(torch.equal(before[k], after[k]) for k in before)
    return trainer.scaler.skipped_steps, trainer.scaler.scale, unchanged


def fp16_overflow_on_first_stage(rank, world, overrides: dict):
    """The first pipeline stage's gradients overflow in backward (the last stage's are finite): every rank
    must skip the step and keep its weights."""
    trainer = tiny_trainer(world, {"train.precision": "fp16", "train.micro_batch_size": "1", **overrides})
    before, _ = trainer.parallel.gather_full_state()
    before = {k: v.clone() for k, v in before.items()} if before is not None else None
    if trainer.mesh.pp_rank == 0:
        next(trainer.model.parameters()).register_hook(lambda g: g * float("inf"))
    trainer.train_step()
    after, _ = trainer.parallel.gather_full_state()
    unchanged = None if before is None else all(torch.equal(before[k], after[k]) for k in before)
    return trainer.scaler.skipped_steps, trainer.scaler.scale, unchanged


def pipeline_in_flight(rank, world, overrides: dict):
    """Over one step, the most micro-batches whose activations (the tensors autograd saved in their forward,
    weights aside) were alive at once on this rank, counted after each forward; and whether every stage
    output sent on had its data freed by the rank's next forward."""
    import weakref
    trainer = tiny_trainer(world, {"train.micro_batch_size": "1", **overrides})
    step = trainer.forward_backward
    weights = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    saved, sent, most, freed, now = [], [], [0], [True], [0]

    def pack(t):  # token ids (the step's inputs and targets, alive all step) are no activations
        if t.is_floating_point() and t.untyped_storage().data_ptr() not in weights:
            saved.append((now[0], weakref.ref(t)))
        return t
    real = step.forward

    def forward(stage, x, y, length, documents=None):
        freed[0] &= all(r() is None or r().numel() == 1 for r in sent)
        now[0] += 1
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = real(stage, x, y, length, documents)
        saved[:] = [(i, r) for i, r in saved if r() is not None]
        most[0] = max(most[0], len({i for i, _ in saved}))
        if out.dim() == 3:  # a stage's output, sent on (the last stage returns its loss)
            sent.append(weakref.ref(out))
        return out
    step.forward = forward
    trainer.train_step()
    return most[0], freed[0]


def _seeded_bf16_backward(rank, world, overrides: dict):
    """A bf16 DDP/ZeRO engine whose last micro-step's backward gives each rank r the seeded gradients
    grads_of(r), reduced by the engine (finish_backward has run). Returns (cfg, engine, [(name, param)], grads_of)."""
    trainer = tiny_trainer(world, {"train.precision": "bf16", "train.micro_batch_size": "2", **overrides})
    cfg, eng, model = trainer.cfg, trainer.engine, trainer.model
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]

    def grads_of(r):
        g = torch.Generator().manual_seed(1000 + r)
        return [torch.randn(p.shape, generator=g).mul_(1 + r).to(torch.bfloat16) for p in params]  # on the CPU
    eng.prepare_backward(True)
    sum(torch.sum(p * g.to(p.device)) for p, g in zip(params, grads_of(rank))).backward()
    eng.finish_backward(True)
    return cfg, eng, named, grads_of


def ddp_grad_sumsq(rank, world, overrides: dict):
    """(the global sum of squares DDP's optimizer clips by, from the squares the reduction took of this rank's
    slices, in bits and as a float; that of the reduced gradient this rank holds, in float64), after one
    seeded bf16 backward."""
    _, eng, _, _ = _seeded_bf16_backward(rank, world, overrides)
    assert eng.grad_sumsq() is not None, "this reduction does not take the norm's squares from its slices"
    got = eng.opt.global_sumsq(eng.owned_sumsq())
    # owned_shards("grad") is the mean over the ranks; the reduction's squares are of the sum.
    want = sum((v.double() * world).pow(2).sum().item() for _, _, v in eng.owned_shards("grad").values())
    return got.cpu().view(torch.int32).item(), got.item(), want


def reduced_bf16_gradients(rank, world, overrides: dict):
    """Each rank's bf16 gradients are a seeded random tensor; returns, for every parameter element this rank
    owns, what the reduction left there beside what an fp32 reduction of bf16 gradients must give: DDP's
    bucket holds the fp32 sum over ranks rounded once to bf16; a ZeRO rank's fp32 gradient shard holds
    its slice of the fp32 sum. owned_shards gives the mean over ranks: times the world (a power of two,
    exactly) it is the sum again."""
    cfg, eng, named, grads_of = _seeded_bf16_backward(rank, world, overrides)
    total = {n: torch.stack([gs[i].float() for gs in map(grads_of, range(world))]).sum(0)
             for i, (n, _) in enumerate(named)}
    out = []
    for name, (lo, hi, got) in eng.owned_shards("grad").items():
        t = total[name].flatten()[lo:hi]
        want = t.to(torch.bfloat16).float() if cfg.parallel.zero_stage == 0 else t
        out.append((name, got * world, want))
    return out


def chosen_reduce_algo(rank, world, overrides: dict):
    """The reduction algorithm the engine settled on (what `parallel.reduce_algo auto` resolved to)."""
    return tiny_trainer(world, {"train.micro_batch_size": "2", **overrides}).engine.algo


def engine_freed_with_its_trainer(rank, world, overrides: dict) -> bool:
    """Build a trainer, take two steps, drop it: is its engine (gradients, optimizer state) collected?"""
    import gc
    import weakref

    def build():
        trainer = tiny_trainer(world, {"train.precision": "bf16", "train.micro_batch_size": "2",
                                       "train.global_batch_size": str(2 * world), **overrides})
        for _ in range(2):
            trainer.train_step()
            trainer.step += 1
        trainer.engine.wait_for_weights()
        return weakref.ref(trainer.engine)
    engine = build()
    gc.collect()
    return engine() is None


COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
               "barrier")


def _count_collectives(calls: list, progress=lambda: None) -> None:
    """Record every torch.distributed collective this process issues from here on, into `calls`, as (its
    name, the element count of its first tensor argument, `progress()` at the call): the functions are
    replaced in torch.distributed and wherever shardlm's modules hold them by name."""
    import sys

    def counted(fn):
        def wrapper(*args, **kwargs):
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            calls.append((fn.__name__, None if first is None else first.numel(), progress()))
            return fn(*args, **kwargs)
        return wrapper
    wrapped = {}
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None:
            wrapped[fn] = wrapped.get(fn) or counted(fn)
            setattr(dist, name, wrapped[fn])
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("shardlm"):
            for attr, value in list(vars(mod).items()):
                if callable(value) and value in wrapped:
                    setattr(mod, attr, wrapped[value])


def collectives_per_micro_step(rank, world, overrides: dict) -> tuple[list[list], list]:
    """The collectives each micro-step (its forward and backward) issues, over two steps, and those of
    the last optimizer step."""
    trainer = tiny_trainer(world, overrides)
    engine, calls, per_micro = trainer.engine, [], []
    _count_collectives(calls)
    real_finish_backward = engine.finish_backward

    def finish_backward(last):
        real_finish_backward(last)
        per_micro.append(list(calls))
        calls.clear()
    engine.finish_backward = finish_backward
    for _ in range(2):
        calls.clear()
        trainer.train_step()
        trainer.step += 1
    return per_micro, list(calls)


def ddp_launches_in_backward(rank, world, overrides: dict):
    """DDP's collectives in one step, each with the number of gradients autograd had produced when it was
    issued; the engine's buckets (parameter names) and the parameters' (name, numel) in registration order."""
    trainer = tiny_trainer(world, overrides)
    arrived = [0]
    for p in trainer.model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: arrived.__setitem__(0, arrived[0] + 1))
    calls = []
    _count_collectives(calls, progress=lambda: arrived[0])
    trainer.engine.prepare_backward(True)
    x, y = trainer.data.micro_batch_at(0, 0)
    trainer.model(x, y).backward()
    trainer.engine.finish_backward(True)
    flat = trainer.engine.flat
    return calls, [[flat.names[i] for i in b.params] for b in flat.buckets], \
        [(n, p.numel()) for n, p in trainer.model.named_parameters()]


def zero3_prefetch(rank, world):
    """Whether ZeRO-3 has issued the gather of the unit that comes next while a block computes: in
    forward, the next block's (or the head's) once block i starts; in backward, block i - 1's while
    block i's gradients arrive."""
    trainer = tiny_trainer(world, {"parallel.zero_stage": "3", "model.num_layers": "4",
                                   "parallel.persist_threshold": "100", "train.micro_batch_size": "2"})
    eng, layers = trainer.engine, trainer.model.blocks()
    states = eng.unit_states()
    unit = {("block", u.block) if u.kind == "block" else (u.kind, None): i for i, u in enumerate(states)}
    following = [unit["block", i + 1] for i in range(len(layers) - 1)] + [unit["head", None]]
    forward, backward = {}, {}

    def issued(seen: dict, i: int, u: int) -> None:
        seen.setdefault(i, eng.unit_states()[u].gather_in_flight)
    for i, block in enumerate(layers):  # these run after the engine's own hooks
        block.register_forward_pre_hook(lambda mod, args, i=i: issued(forward, i, following[i]))
        if i > 0:
            block.mlp.down.weight.register_post_accumulate_grad_hook(
                lambda p, i=i: issued(backward, i, unit["block", i - 1]))
    x, y = trainer.data.micro_batch_at(0, 0)
    loss = trainer.model(x, y)
    eng.prepare_backward(True)
    loss.backward()
    eng.finish_backward(True)
    return forward, backward


def offload_placement(rank, world, overrides: dict) -> dict:
    """ZeRO-3 on the GPUs after one step: where the masters, the optimizer state, the host gradient buffer
    and the 16-bit parameter shards live, and the GPU memory this rank then holds."""
    trainer = tiny_trainer(world, {"parallel.zero_stage": "3", "train.device": "cuda", "train.precision": "bf16",
                                   "train.micro_batch_size": "2", "train.global_batch_size": str(2 * world),
                                   "parallel.persist_threshold": "0", **overrides})
    trainer.train_step()
    torch.cuda.synchronize()
    held = trainer.engine.held_tensors()

    def where(kind):
        return {(t.device.type, t.is_pinned()) for k, t in held if k == kind}
    masters = [t for k, t in held if k == "masters"]
    return {"master": where("masters"), "state": where("optimizer"), "host_grad": where("host_grads"),
            "shards": where("param_shards"), "shard_numel": sum(t.numel() for t in masters),
            "buckets": len(trainer.engine.flat.buckets), "gpu_bytes": torch.cuda.memory_allocated()}


def engine_released_on_close(rank, world, overrides: dict) -> tuple[bool, bool]:
    """A trainer that set up its own process group (as under torchrun) takes a step and closes: is its
    engine, which holds the group, collected by then, and is the group gone?"""
    import weakref
    dist.destroy_process_group()  # the harness's: the trainer makes its own from the same environment
    trainer = tiny_trainer(world, {"train.micro_batch_size": "2", "train.global_batch_size": str(2 * world),
                                   **overrides})
    assert trainer.owns_process_group
    trainer.train_step()
    engine = weakref.ref(trainer.engine)
    trainer.close()
    return engine() is None, dist.is_initialized()


def signal_mid_step_on_rank_one(rank, world, overrides: dict, out_dir, at_step: int):
    """Train `tiny` where rank 1 alone receives SIGTERM in the middle of step `at_step` (after backward,
    before the update); returns what each rank's run did."""
    trainer = tiny_trainer(world, {"train.log_every": "1", **overrides}, out_dir=out_dir)
    real_step = trainer.engine.optimizer_step

    def step(lr, n):
        if rank == 1 and n == at_step:
            os.kill(os.getpid(), signal.SIGTERM)
        real_step(lr, n)
    trainer.engine.optimizer_step = step
    records = trainer.run()
    return {"stopped_by": trainer.stopped_by, "steps": [r["step"] for r in records],
            "losses": [r["loss"] for r in records]}


# ---- tensor parallelism ---------------------------------------------------------------------------

def initial_full_state(rank, world, overrides: dict):
    """The full weights, gathered by name, of a freshly built trainer (before any step)."""
    trainer = tiny_trainer(world, {"train.micro_batch_size": "2", **overrides})
    masters, _ = trainer.parallel.gather_full_state()
    return None if masters is None else {k: v.float().cpu() for k, v in masters.items()}


def eval_and_sample(rank, world, overrides: dict, out_dir=None, resume=None):
    """The eval loss and a greedy continuation of a trainer (resumed from a checkpoint when given)."""
    from shardlm.inference import generate_text
    trainer = tiny_trainer(world, {"train.micro_batch_size": "2", **overrides}, out_dir=out_dir, resume=resume)
    text = generate_text(trainer.model, trainer.tokenizer, "def ", 12)
    return trainer.evaluate(), text


def evaluated(rank, world, overrides: dict):
    """The eval loss of a freshly built trainer."""
    return tiny_trainer(world, overrides).evaluate()


def warnings_of_a_trainer(rank, world, overrides: dict, local_world: int):
    """The warnings rank 0 gives while setting up a trainer on a node of `local_world` processes."""
    import warnings
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
    dist.destroy_process_group()  # the harness's: the trainer makes its own from the environment
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer = tiny_trainer(world, {"train.micro_batch_size": "2", **overrides})
        trainer.close()
    return [str(w.message) for w in seen]


def heartbeat_names_the_silent_rank(rank, world):
    """Every rank beats every 0.2 s; rank 1 stops after a second. What rank 0 then reports, and what it
    reported while all beat."""
    from shardlm.runtime.heartbeat import Heartbeat
    beat = Heartbeat(rank, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), interval=0.2)
    time.sleep(1.0)
    while_all = beat.report() if rank == 0 else None
    dist.barrier()
    if rank == 1:
        beat.close()
    time.sleep(1.5)
    after = beat.report() if rank == 0 else None
    dist.barrier()
    beat.close()
    return while_all, after


def heartbeat_names_where_a_stalled_rank_is(rank, world, fifo):
    """Every rank beats every 0.2 s; rank 1 then waits on a data read that does not come (a named pipe with
    no writer: a file on a hung filesystem), ranks 2 and 3 in a collective of the training step, for rank 1.
    What rank 0 reports once both places are told; then it writes the data and joins the collective."""
    from pathlib import Path

    from shardlm.data.instruct import is_instruct
    from shardlm.divergence import refuse_nan_loss
    from shardlm.runtime.heartbeat import Heartbeat
    beat = Heartbeat(rank, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), interval=0.2)
    report = None
    if rank == 1:
        assert is_instruct(Path(fifo))
    elif rank == 0:
        try:
            deadline, report = time.monotonic() + 30, ""
            while time.monotonic() < deadline and not (  # until each peer's beat tells where it has gone from here
                    "is_instruct" in report and "refuse_nan_loss" in report and "_worker" not in report):
                time.sleep(0.2)
                report = beat.report()
        finally:
            with open(fifo, "w") as f:
                f.write('{"prompt": "a", "completion": "b"}\n')
    refuse_nan_loss(torch.zeros(()), 0, False, None)
    beat.close()
    return report


def save_fails_on_rank_zero(rank, world, out_dir):
    """A full disk on rank 0 while it writes step 2's checkpoint: what each rank raises (none may hang)."""
    import errno

    import shardlm.checkpoint_write as ckpt

    def full_disk(file, mode="r", *args, **kwargs):  # the files a save writes, opened in checkpoint_write.py
        if rank == 0 and "step_00000002" in str(file) and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return open(file, mode, *args, **kwargs)
    ckpt.open = full_disk
    trainer = tiny_trainer(world, {"train.steps": "2", "train.micro_batch_size": "2"}, out_dir=out_dir)
    try:
        trainer.run()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return type(e).__name__, str(e)
    return None


def lora_zero3_frozen(rank, world, overrides: dict):
    """A LoRA ZeRO-3 run's frozen base at rest after a step: (elements in this rank's frozen shards, elements of
    the frozen weights over the persist threshold, bytes of theirs resident now)."""
    trainer = tiny_trainer(world, {"parallel.zero_stage": "3", "lora.rank": "4", "parallel.persist_threshold": "100",
                                   **overrides})
    trainer.train_step()  # forward, backward and the update: every gather released after
    shards = sum(t.numel() for kind, t in trainer.engine.held_tensors() if kind == "frozen_shards")
    big = [p for p in trainer.model.parameters() if not p.requires_grad and p.numel() > 100]
    return shards, sum(p.numel() for p in big), sum(p.untyped_storage().size() for p in big)


def ring_attention_bf16(rank, world):
    """Ring attention over bf16 q, k, v (8 query heads, 2 key/value heads, 64 tokens, causal) split over the
    `world` ranks: this rank's slice of the output and of each input's gradient, and SDPA's over the whole
    sequence in bf16 and in fp32 (each rank computes those itself)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from shardlm.parallel.context import ContextParallel
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 64, 16, generator=g) for h in (8, 2, 2))
    dy = torch.randn(2, 8, 64, 16, generator=g)

    def sdpa(dtype):
        x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        y = F.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=True)
        y.backward(dy.to(dtype))
        return [part(t.float()) for t in (y.detach(), *(t.grad for t in x))]
    context = ContextParallel(dist.group.WORLD, rank, world, "p2p", zigzag=True)

    def part(t):  # this rank's zig-zag chunks of the sequence (dimension 2)
        return t.index_select(2, context.indices(rank, t.shape[2]))
    x = [part(t.to(torch.bfloat16)).requires_grad_() for t in (q, k, v)]
    y = context.ring_attention(*x, None)
    y.backward(part(dy.to(torch.bfloat16)))
    assert y.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in x)
    return [t.float() for t in (y.detach(), *(t.grad for t in x))], sdpa(torch.bfloat16), sdpa(torch.float32)


def tiny_llama_batch(case: str):
    """The tiny Llama (seed 3) of `case` and one batch of 2 x 32 (ids, targets): causal, window (a sliding
    window shorter than the sequence), packed (examples closed by an end-of-text token, kept apart), gqa
    (8 query heads, 2 key/value heads), mha (4 and 4) or heads2 (2 heads, which cp 4 does not divide)."""
    from shardlm.config import load_config
    from shardlm.model import build_model
    shapes = {"window": {"model.sliding_window": "8"},  # 8 query heads over 2 key/value heads: at cp 4 each
              "gqa": {"model.num_heads": "8", "model.num_kv_heads": "2"},  # is repeated twice, not four times
              "mha": {"model.num_heads": "4", "model.num_kv_heads": "4"},
              "heads2": {"model.num_heads": "2", "model.num_kv_heads": "1"}}
    cfg = load_config("tiny", shapes.get(case, {}))
    model = build_model(cfg.model, seed=3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, cfg.model.vocab_size, (2, 32), generator=g)
    targets = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=g)
    if case == "packed":
        model.doc_eos = 0
        ids[0, [5, 13, 22]] = 0  # examples that straddle the ranks' slices
        ids[1, [15]] = 0
    return model, ids, targets


def context_parallel_step(rank, world, case: str, comm: str = "a2a", query_rows: int = 0):
    """The tiny Llama's loss and gradients for one batch, each of the `world` ranks holding its slice of every
    sequence (parallel/context.py, by `comm`: a2a, Ulysses, or p2p, ring attention; world 1: the whole model
    on one process; `query_rows`: ring attention's queries a pass, where not its default): the mean loss over the
    ranks and the gradients summed over them. `case`: causal, window
    (a sliding window shorter than the sequence), packed (examples closed by an end-of-text token, kept
    apart), gqa (8 query heads, 2 key/value heads) or heads2 (2 heads, which cp 4 does not divide)."""
    import torch.distributed as dist
    from shardlm.parallel.context import context_parallel
    model, ids, targets = tiny_llama_batch(case)
    if query_rows:  # the plain-op block kernel, a few queries a pass
        from shardlm.parallel import ring_attention
        ring_attention.QUERY_ROWS = query_rows
    if world > 1:
        context_parallel(model, dist.group.WORLD, comm)
        for block in model.parts().layers if query_rows else ():
            block.attn.core.kernel = "math"
        ids, targets = model.sequence.local(ids), model.sequence.local(targets)  # ring attention's: zig-zag
    return summed_loss_and_grads(model, ids, targets, world)


def summed_loss_and_grads(model, ids, targets, world: int):
    """Forward and backward of this rank's slice: the mean loss over the ranks and the gradients summed."""
    import torch.distributed as dist
    loss = model(ids, targets)
    (loss / world).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if world > 1:
        for grad in grads.values():
            dist.all_reduce(grad)
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        loss /= world
    return loss.item(), grads


def train_into(rank, world, out_dir):
    """A `tiny` run into `out_dir`: what each rank raises while another process owns the directory."""
    try:
        tiny_trainer(world, {"train.steps": "1", "train.micro_batch_size": "2"}, out_dir=out_dir)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return type(e).__name__, str(e)
    return None


def cli_at_rank(rank, world, argv):
    """`shardlm ...argv` on every rank of an initialised group (what torchrun runs), its exit status."""
    from shardlm.cli import main
    return main([str(a) for a in argv])


def cli_with_rank_one_given(rank, world, argv, extra):
    """`shardlm ...argv` on every rank, `extra` appended on rank 1 alone: its exit status and what it printed."""
    import contextlib
    import io
    from shardlm.cli import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main([str(a) for a in [*argv, *(extra if rank == 1 else [])]])
    return status, err.getvalue()


def dtypes_at_tp(rank, world, model_dir, dtype):
    """The dtypes of a tensor-parallel model's parameters as load_pretrained makes it in `dtype`."""
    from shardlm.inference import load_pretrained
    from shardlm.mesh import build_mesh
    model, _, _ = load_pretrained(model_dir, dtype=dtype, tp_group=build_mesh(tp=world).group("tp"))
    return sorted({str(p.dtype) for p in model.parameters()})


def notes_of_a_tp_load(rank, world, run):
    """What load_pretrained of run directory `run` says on stderr on this rank of `world` tensor-parallel ranks."""
    import contextlib
    import io

    from shardlm.inference import load_pretrained
    from shardlm.mesh import build_mesh
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        load_pretrained(run, tp_group=build_mesh(tp=world).group("tp"))
    return said.getvalue()


def loss_at_tp(rank, world, model_dir, text, seq_len):
    """The perplexity task of `shardlm eval` on a tensor-parallel model of `world` ranks."""
    from shardlm.inference import evaluate_ids, load_pretrained
    from shardlm.mesh import build_mesh
    model, tok, _ = load_pretrained(model_dir, tp_group=build_mesh(tp=world).group("tp"))
    return evaluate_ids(model, tok.encode(text), seq_len)["loss"]


def subgroup_reduction(rank, world, overrides: dict):
    """A second parameter group, as experts will be: dp 4 read as (edp 2, ep 2), block 0's MLP placed on
    edp, each of its gradients first summed over the rank's ep pair (what the experts' all-to-all gives:
    each copy holds its pair's tokens), counted once over ep, reduced over edp with dp's divisor. On one
    process (world 1) the same model and batch with one group. Returns the losses, the gradient norms and
    the gathered masters."""
    from shardlm.config import load_config
    from shardlm.mesh import build_mesh
    from shardlm.model import Decoder
    from shardlm.optim import lr_at
    from shardlm.parallel import build_engine
    from shardlm.parallel.forward_backward import ForwardBackward
    from shardlm.parallel.placement import DataPlacement, place
    from shardlm.precision import NoLossScaler
    cfg = load_config("tiny", {"parallel.dp": str(world), **overrides})
    mesh = build_mesh(dp=world, ep=2 if world > 1 else 1)
    model = Decoder(cfg.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            model.init_parameter(name, p, seed=0)
    if world > 1:
        mlp = model.layers["0"].mlp
        for module in mlp.modules():
            place(module, DataPlacement(reduce="edp", copies=("ep",)))
        for p in mlp.parameters():
            p.register_hook(lambda g: _summed(g, mesh.group("ep")))
    scaler = NoLossScaler()
    engine = build_engine(model, cfg, mesh, scaler)
    step_fn = ForwardBackward(model, engine, scaler)
    gen = torch.Generator().manual_seed(1)
    per_rank, seq, losses, norms = 2, 16, [], []
    for step in range(1, 4):
        batch = torch.randint(0, cfg.model.vocab_size, (2 * 4, seq + 1), generator=gen)  # 4 ranks' 2 rows
        mine = batch if world == 1 else batch[rank * per_rank:(rank + 1) * per_rank]
        micro = [(r[None, :-1], r[None, 1:]) for r in mine]
        loss = step_fn(micro, len(micro), torch.device("cpu"))
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        engine.optimizer_step(lr_at(step - 1, cfg.train), step)
        losses.append(float(loss))
        norms.append(engine.step_stats(step)[0])
    masters, _ = engine.gather_full_state()
    return {"losses": losses, "grad_norms": norms, "masters": {k: v.float().clone() for k, v in masters.items()}}


def _summed(grad, group):
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def save_memory(rank, world, overrides: dict, out_dir):
    """Train one step, then save it again and measure what the save alone adds to this process's resident
    memory (its high-water mark reset first: /proc/self/clear_refs); returns (that, the bytes of the
    optimizer state this rank holds, the save's seconds)."""
    import re
    import time
    import ctypes
    from pathlib import Path
    # Blocks of 128 KiB and more mapped fresh and unmapped when freed (glibc's M_MMAP_THRESHOLD, fixed): else
    # a save's buffers could reuse pages that training freed but kept, and never raise the mark.
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)
    trainer = tiny_trainer(world, {"train.steps": "1", **overrides}, out_dir=out_dir)
    trainer.run()
    held = trainer.engine.memory()["optimizer"]
    status = Path("/proc/self/status")
    kib = lambda field: int(re.search(rf"{field}:\s+(\d+) kB", status.read_text()).group(1)) * 1024  # noqa: E731
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before, start = kib("VmRSS"), time.perf_counter()
    trainer.save()
    return kib("VmHWM") - before, held, time.perf_counter() - start


def async_save_polled_while_stepping(rank, world, overrides: dict, out_dir):
    """An asynchronous save polled after each step by code that steps the trainer itself (as bench/checkpoint.py
    does), rank 0's writes slowed so that the ranks' writer threads finish at different steps: returns the
    steps taken until the save committed (the same on every rank) and the checkpoints then on disk."""
    from pathlib import Path
    from shardlm import run_checkpoint
    if rank == 0:
        write = run_checkpoint.write_shards

        def slow(*args, **kwargs):
            time.sleep(1.0)
            return write(*args, **kwargs)
        run_checkpoint.write_shards = slow
    trainer = tiny_trainer(world, {"train.checkpoint_async": "true", **overrides}, out_dir=out_dir)
    trainer.train_step()
    trainer.step += 1
    trainer.save(wait=False)
    steps = 0
    while trainer.saver.pending is not None and steps < 200:
        trainer.train_step()
        trainer.step += 1
        steps += 1
        trainer.saver.poll()
    trainer.close()
    return steps, sorted(p.name for p in (Path(out_dir) / "checkpoints").iterdir())


def killed_after_the_first_file_of(rank, world, overrides: dict, out_dir, step: int):
    """Train `tiny`, saving as `overrides` say; at the save of `step` this process is SIGKILLed as soon as it has
    written its first file (kill -9 mid-save)."""
    from shardlm import run_checkpoint
    write = run_checkpoint.write_tensors

    def write_then_die(path, tensors, sync=True, moved=None):
        got = write(path, tensors, sync, moved)
        if f".tmp-step_{step:08d}" in str(path):
            os.kill(os.getpid(), signal.SIGKILL)
        return got
    run_checkpoint.write_tensors = write_then_die
    tiny_trainer(world, overrides, out_dir=out_dir).run()


def expert_parallel_layer(rank, world, routing: str, padded: bool = False, budget: float = 0.0):
    """Layer 0's MoE of mixtral-tiny at ep = world (each rank its block of experts, edp 1; world 1: all of
    them, the plain dispatch) on 8 tokens a rank (rank r the r-th 8 of one batch of 16; world 1: all 16),
    its rows sent in fixed-size blocks where `padded`, else by exact counts, in chunks past `budget` balanced
    loads (parallel.ep_load_budget). `routing`: "natural", or "one-rank" (every token to experts 0 and 1,
    rank 0's: the others receive nothing). Returns this rank's outputs, its experts' gradients (of every
    rank's tokens), the router's summed over ranks, and the forwards its experts ran in chunks."""
    from shardlm.config import load_config
    from shardlm.mesh import build_mesh
    from shardlm.model import Decoder
    from shardlm.parallel.expert import expert_parallel
    cfg = load_config("tiny", {"model.num_experts": "4", "model.top_k": "2"}).model
    mesh = build_mesh(dp=world, ep=world)
    with torch.device("meta"):
        model = Decoder(cfg)
    expert_parallel(model, mesh, padded, budget)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            model.init_parameter(name, p, seed=3)
    layer = model.layers["0"].mlp
    if routing == "one-rank":
        layer.route = _one_rank(layer.route)
    g = torch.Generator().manual_seed(5)
    x_all, w_all = torch.randn(16, cfg.hidden_size, generator=g), torch.randn(16, cfg.hidden_size, generator=g)
    mine = slice(0, 16) if world == 1 else slice(8 * rank, 8 * (rank + 1))
    x = x_all[mine].clone().requires_grad_()
    y = layer(x)
    (y * w_all[mine]).sum().backward()
    router = layer.router.weight.grad.clone()
    if world > 1:
        dist.all_reduce(router)
    return {"y": y.detach(), "x_grad": x.grad, "router": router,
            "up": layer.experts.up.weight.grad, "down": layer.experts.down.weight.grad,
            "chunked": getattr(layer, "chunked", 0)}


def _one_rank(route):
    """`route` with every token sent to experts 0 and 1 (rank 0's at ep 2), its logits and weights kept."""
    def forced(x):
        logits, experts, weights = route(x)
        return logits, torch.tensor([0, 1], device=x.device).expand_as(experts), weights
    return forced


def train_routed_to_one_rank(rank, world, overrides: dict):
    """train_and_capture with every MoE layer's tokens routed to experts 0 and 1 (at ep 2: rank 0 takes every
    row, twice a balanced load; rank 1 none)."""
    from shardlm.model.moe import MoE
    route = MoE.route
    MoE.route = lambda self, x: _one_rank(lambda y: route(self, y))(x)
    try:
        return train_and_capture(rank, world, overrides)
    finally:  # the reference runs in the test's process
        MoE.route = route


def files_read_at_resume(rank, world, overrides: dict, ckpt: str):
    """Resume `tiny` from `ckpt` (a sharded save): the names of the checkpoint's tensor files this rank
    opened, and its gathered masters after the load."""
    from pathlib import Path

    import shardlm.sharded_read as ckpt_module
    opened, real = set(), ckpt_module.safe_open

    def spied(path, *args, **kwargs):
        opened.add(Path(path).name)
        return real(path, *args, **kwargs)
    ckpt_module.safe_open = spied
    trainer = tiny_trainer(world, {"train.steps": "3", **overrides}, resume=ckpt)
    return sorted(opened), {k: v.clone() for k, v in trainer.engine.gather_full_state()[0].items()}


def tp_decode_on_gpus(rank, world, model_dir, prompts, new, one_shot, dtype="fp32", prefill_graphs=None,
                      fused=False):
    """Greedy tokens of `prompts` from the engine over a tensor-parallel model on this rank's GPU (compiled
    decode step, CUDA graphs; prefill passes as CUDA graphs as `prefill_graphs` says), and whether its decode
    step ran the one-shot all-reduce kernel (and, with `fused`, whether it ran the one-row product and
    all-reduce kernel too)."""
    from torch.profiler import ProfilerActivity, profile

    from shardlm.inference import Engine, Request, load_pretrained
    from shardlm.mesh import build_mesh
    model, _, _ = load_pretrained(model_dir, device="cuda", dtype=dtype, tp_group=build_mesh(tp=world).group("tp"))
    engine = Engine(model, len(prompts), compile=True, one_shot=one_shot, prefill_graphs=prefill_graphs)
    engine.run([Request(p, new) for p in prompts])  # compiles and records the graphs
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        done = engine.run([Request(p, new) for p in prompts])
        torch.cuda.synchronize()
    kernels = " ".join(e.key for e in prof.key_averages())
    ran = [[r.tokens for r in done], "one_shot" in kernels]
    return ran + ["gemv_all_reduce" in kernels] if fused else ran


def fused_all_reduce_replays(rank, world, protocol, replays):
    """64 one-row row-parallel products and their sums (llama2-7b's shapes at tp `world`, random weights) by
    GemvAllReduce's `protocol` in one CUDA graph, replayed `replays` times: each sum's largest error against
    cuBLAS's products summed by NCCL over their largest value, whether every replay gave the first's bits,
    and the kernel's fault report (None: none)."""
    from shardlm.inference.gemv_all_reduce import GemvAllReduce
    from shardlm.inference.one_shot import symmetric_buffers
    torch.cuda.set_device(rank)
    group = dist.group.WORLD
    g = torch.Generator(device="cuda").manual_seed(rank)
    h, dt = 4096, torch.bfloat16
    ws = [torch.randn(h, k // world, device="cuda", dtype=dt, generator=g) * 0.02 for k in (4096, 11008) * 32]
    xs = [torch.randn(w.shape[1], device="cuda", dtype=dt, generator=g) for w in ws[:2]]
    want = []
    for i, w in enumerate(ws):
        y = torch.nn.functional.linear(xs[i % 2], w)
        dist.all_reduce(y, group=group)
        want.append(y)
    fused = GemvAllReduce(symmetric_buffers([2 * world * h] * 2, ws[0], group), h, group, protocol=protocol)
    run = lambda: [fused(xs[i % 2], w, i % 2) for i, w in enumerate(ws)]  # noqa: E731
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    graph.replay()
    first = [o.clone() for o in outs]
    same = True
    for _ in range(replays):
        graph.replay()
        same &= all(torch.equal(o, f) for o, f in zip(outs, first))
    torch.cuda.synchronize()
    try:
        fused.check()
        fault = None
    except RuntimeError as e:
        fault = str(e)
    scale = max(y.abs().max().item() for y in want)
    err = max((o.float() - y.float()).abs().max().item() for o, y in zip(first, want)) / scale
    return err, same, fault


def slot_groups_of_eval_tasks(rank, world, model_dir, data):
    """`shardlm eval --tasks bleu --tp world` on this rank: whether each count of slots it took was agreed over
    a tensor-parallel group (slots_that_fit's `group`)."""
    import shardlm.inference as inference
    from shardlm.cli import main
    real, agreed = inference.slots_that_fit, []

    def spied(*args, **kwargs):
        agreed.append(kwargs.get("group") is not None)
        return real(*args, **kwargs)
    inference.slots_that_fit = spied  # this worker's own module: forked for this call alone
    assert main(["eval", "--model", str(model_dir), "--data", str(data), "--tasks", "bleu", "--max-new-tokens", "2",
                 "--tp", str(world)]) == 0
    return agreed


def cli_with_rank_one_reading(rank, world, argv, other):
    """`shardlm ...argv` on every rank, rank 1 reading generate's --input or eval's --data text from the file
    `other` at the path argv names (a node's own copy of the file, another version of it): its exit status and
    what it printed."""
    import contextlib
    import io
    from pathlib import Path

    import shardlm.inference.commands as commands
    import shardlm.text_metrics as text_metrics
    from shardlm.cli import main
    if rank == 1:  # this worker's own modules
        requests, text = commands.read_requests, text_metrics.loss_text
        commands.read_requests = lambda path, a: requests(Path(other), a)
        text_metrics.loss_text = lambda path: text(Path(other))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main([str(a) for a in argv])
    return status, err.getvalue()


def long_work_past_the_timeout(rank, world, work_s):
    """first_rank_result and every_rank_done over a group whose timeout (1 s) is shorter than the work, with a
    stall limit of 1 s: work that says it moves (every 0.1 s) is waited for, its result or error reaching every
    rank; work that stops moving ends the wait on every rank, naming it (and the rank whose part stopped)."""
    import threading
    from datetime import timedelta

    from shardlm.config import RunError
    from shardlm.runtime.first_rank import Moved, every_rank_done, first_rank_result
    group = dist.new_group(timeout=timedelta(seconds=1))

    def moving(moved, then=lambda: "picked"):
        end = time.monotonic() + work_s
        while time.monotonic() < end:
            time.sleep(0.1)
            moved()
        return then()

    def damaged():
        raise ValueError("damaged")
    said = [first_rank_result(moving, group, 1.0, "the pick")]
    try:
        first_rank_result(lambda moved: moving(moved, damaged), group, 1.0, "the pick")
    except ValueError as e:
        said.append(str(e))
    try:
        first_rank_result(lambda moved: time.sleep(30), group, 1.0, "the pick")
    except RunError as e:
        said.append(str(e))
    for part in (moving, lambda moved: time.sleep(30)):  # rank 1's part; rank 0's is done at once
        moved = Moved()
        thread = threading.Thread(target=part if rank == 1 else (lambda moved: None), args=(moved,), daemon=True)
        thread.start()
        try:
            every_rank_done(thread, moved, group, 1.0, "the writes")
            said.append("all done")
        except RunError as e:
            said.append(str(e))
    return said


def default_corpus_of_rank_0(rank, world, cache, stuck):
    """The default corpus (here three small files, rank 0's reads of them 0.8 s apart, or stuck after the
    first) prepared by rank 0 alone while the others wait, at parallel.timeout_s 2: each rank's prepared
    directory, or what stopped it."""
    from pathlib import Path

    import shardlm.data.default as default
    import shardlm.data.prepare as prepare
    from shardlm.compat import train_data_dir
    from shardlm.config import RunError, load_config
    os.environ["XDG_CACHE_HOME"] = cache
    files = sorted(Path(os.__file__).parent.glob("json/*.py"))[:3]
    default.default_sources = lambda: files
    pieces, read = prepare.iter_pieces, []

    def slow(*args):
        for piece in pieces(*args):
            time.sleep(3600 if stuck and read else 0.8)
            read.append(1)
            yield piece
    if rank == 0:
        prepare.iter_pieces = slow
    try:
        return str(train_data_dir(load_config("tiny", {"parallel.timeout_s": "2"})))
    except RunError as e:
        return str(e)


def train_into_own_out(rank, world, root: str, overrides: dict):
    """Train `tiny` with --out `root`/rank<r>: each rank's own directory, as a path local to each node gives
    (the mesh is built here: the launch's check that the ranks were given one --out is not what is tested)."""
    from shardlm.config import ConfigError
    from shardlm.mesh import build_mesh
    try:
        trainer = tiny_trainer(world, {"train.steps": "1", **overrides}, out_dir=f"{root}/rank{rank}",
                               mesh=build_mesh(dp=world))
    except ConfigError as e:
        return str(e)
    trainer.run()
    trainer.close()
    return None
