"""Pipeline parallelism (GPipe, Huang et al. 2019; 1F1B and interleaved 1F1B, Narayanan et al. 2021): the
decoder's layers split into stages over the mesh's pp axis, and one engine that executes any schedule's
action table (schedules.py) with point-to-point sends and receives.

Each rank holds a Decoder slice with the layers of its stages (v of them with virtual stages), under the
whole model's parameter names; the first stage's rank also holds the embeddings, the last's the final
norm, the head and the loss. A step runs the rank's actions in order: sends and receives (the receives
waited for only where a computation reads them), a forward of a stage on a micro-batch, or its backward.
Each flow (activations or gradients, one direction, one pair of neighbours) has a group and so a stream
of its own: posted in one batch on one group, a forward's input waited for a later backward's gradient
still being computed two stages on (bench/README.md). On the GPUs of one node the flows move by the
copy engines instead (`parallel.pp_transfer`, comm/p2p.py): a posted receive then holds no SMs while
it waits for its sender. Each micro-batch's loss is divided by the number of micro-batches, so the
accumulated gradients are the mean over the step's batch, as without pipelining.
A stage's output is freed once sent (Megatron-LM's deallocate_output_tensor: backward needs only its
graph), and a micro-batch's activations go with its backward, so a schedule holds what its table says.
After the last backward, the tied embedding's two copies (first and last stage) add their gradients,
and the data-parallel engine reduces every gradient once (DDP, ZeRO-1, classic DP).
A mixture of experts' auxiliary losses (model/moe.py) are each stage's own: taken after the stage's forward,
scaled like the micro-batch's loss, and run backward with the stage's output (on the last stage, added to the
loss), so each layer's router gets the gradient one process gives it.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..comm.p2p import CopyEngineTransfers, resolve_pp_transfer
from ..mesh import flow_name
from ..model.decoder import Decoder
from ..model.moe import aux_loss, moe_layers
from ..model.weight_grad import WeightGradStore
from ..schedules import Action, batches, peer, rank_of
from .engine import Engine


def stage_decoder(cfg, pp: int, v: int, rank: int, layers_of: list[list[int]]) -> Decoder:
    """This rank's slice (on the current device, meta for parallelize): the layers of its stages rank,
    rank + pp, ..."""
    S = pp * v
    mine = [i for s in range(rank, S, pp) for i in layers_of[s]]
    return Decoder(cfg, mine, first=rank_of(0, pp) == rank, last=rank_of(S - 1, pp) == rank)


def _run_backward(outputs: tuple, grads: tuple) -> None:
    """Backward from a stage output whose data was freed after sending: the engine, without autograd's
    shape check of the output against its gradient (as Megatron-LM does)."""
    torch.autograd.Variable._execution_engine.run_backward(
        outputs, grads, False, False, (), True, True)


class _Posted:
    """One batch_isend_irecv call's works (one coalesced work under NCCL, one per operation under gloo),
    waited for at most once: a gloo send or receive waited for twice blocks for good."""

    def __init__(self, works, tensors):
        self.works, self.tensors, self.done = works, tensors, False

    def completed(self) -> bool:
        if not self.done and all(w.is_completed() for w in self.works):
            self.done, self.tensors = True, None  # the sent tensors may go
        return self.done

    def wait(self) -> None:
        if not self.done:
            for w in self.works:
                w.wait()
            self.done, self.tensors = True, None


@dataclass
class _Step:
    """What one step's actions pass each other, by (stage, micro-batch)."""
    data: list          # the micro-batches (inputs, targets)
    count: int          # micro-batches per step: each loss is divided by it, or
    weights: list | None  # multiplied by its weight (instruction data: its share of the trained targets)
    aux_weights: list | None  # the MoE auxiliary losses' (ForwardBackward says when they differ)
    loss: torch.Tensor  # their sum (on the last stage)
    inputs: dict = field(default_factory=dict)    # a stage's input, whose gradient goes back
    outputs: dict = field(default_factory=dict)   # a stage's output, until its backward
    aux: dict = field(default_factory=dict)       # a stage's scaled MoE auxiliary losses, until its backward
    recvs: dict = field(default_factory=dict)     # (kind, stage, mb) -> (receive posted, buffer)
    deferred: dict = field(default_factory=dict)  # weight-gradient matmuls queued by I, until W
    sending: list = field(default_factory=list)   # sends in flight


class PipelineSchedule:
    """One step of a schedule's table on this rank (the seam ForwardBackward fills without pipelining)."""

    def __init__(self, model: Decoder, engine: Engine, scaler, mesh, table: list[Action], layers_of: list[list[int]],
                 activation_shape, tied_group=None, transfer: str = "process_group",
                 aux_coefs: tuple[float, float] = (0.0, 0.0)):
        self.model, self.engine, self.scaler, self.mesh = model, engine, scaler, mesh
        self.moe_layers, self.aux_coefs = moe_layers(model), aux_coefs
        self.table, self.layers_of, self.tied_group = table, layers_of, tied_group
        self.activation_shape = activation_shape  # (micro-batch, sequence here, hidden): what stages send
        self.S = len(layers_of)
        self.group = mesh.pp_group
        self.pp = mesh.pp
        self.forward = self._stage_forward  # the seam tests patch, as ForwardBackward's
        self.timer = lambda action: nullcontext()  # around each computation: the seam a benchmark times
        self.weight_grads = WeightGradStore()
        if any(a.kind == "W" for a in table):
            # Linears whose gradient a hook sums over tp ranks (key/value heads kept whole) keep dW in I.
            for module in model.modules():
                if hasattr(module, "weight_grads") and not getattr(module, "partial_grads", None):
                    module.weight_grads = self.weight_grads
        param = next(model.parameters())
        self._connect(param.device)
        self.copy_engines = None
        if resolve_pp_transfer(transfer, self.group, param.device) == "copy_engine":
            try:
                self.copy_engines = CopyEngineTransfers(self.group, torch.Size(activation_shape).numel(),
                                                        param.dtype, param.device)
            except Exception as e:
                raise RuntimeError(f"the pipeline's copy-engine transfers could not be set up ({e}); "
                                   "--parallel.pp_transfer process_group sends through the process group") from e

    def symmetric_bytes(self) -> int:
        """Bytes in the copy-engine transfers' symmetric memory, which PyTorch's allocator statistics miss."""
        return self.copy_engines.symmetric_bytes() if self.copy_engines is not None else 0

    def _connect(self, device: torch.device) -> None:
        """Every flow this rank's table sends or receives on, made now, one at a time in the same order on every
        rank (the lowest flow not yet made has both its ranks at it). NCCL creates a group's communicator at
        its first operation and connects two ranks at their first send or receive, inside ncclGroupEnd,
        which blocks the CPU until the peer connects too (pytorch#113281). Left to the first step, staggered
        stages block there while their peers wait on them: a hang on GPUs that gloo never shows. (With the
        copy engines' transfers, `evaluate` alone uses these groups.)"""
        dist.barrier(group=self.group)
        for flow in sorted({self._flow(a) for a in self.table if a.kind in ("SEND_F", "SEND_B", "RECV_F", "RECV_B")}):
            op = dist.isend if flow[1] == self.mesh.pp_rank else dist.irecv
            for work in self._start(op, torch.zeros(1, device=device), flow):
                work.wait()

    def _flow(self, a: Action) -> tuple[str, int, int]:
        """(kind, source, destination pipeline ranks) of a communication action."""
        me, other = self.mesh.pp_rank, peer(a, self.pp)
        return (a.kind[-1],) + ((me, other) if a.kind.startswith("SEND") else (other, me))

    def _start(self, op, tensor: torch.Tensor, flow: tuple[str, int, int]) -> list:
        """A send or receive of `tensor` on its flow's group, to or from the flow's other rank: its works."""
        _, src, dst = flow
        other = dst if src == self.mesh.pp_rank else src
        # Indexed, not mesh.group(): a missing flow would be None, which torch takes for the whole world.
        group = self.mesh.groups[flow_name(*flow)]
        return dist.batch_isend_irecv([dist.P2POp(op, tensor, dist.get_global_rank(self.group, other), group)])

    def _transfer(self, op, tensor: torch.Tensor, flow: tuple[str, int, int]) -> list:
        """A step's send or receive: by the copy engines where the pipeline has them, else as `_start`."""
        kind, src, dst = flow
        if self.copy_engines is None:
            return self._start(op, tensor, flow)
        if op is dist.isend:
            return [self.copy_engines.send(kind, dst, tensor)]
        return [self.copy_engines.recv(kind, src, tensor)]

    def _stage_forward(self, stage: int, x: torch.Tensor, targets: torch.Tensor, length: int, documents=None):
        h = self.model.hidden_states(x, layers=self.layers_of[stage], embed=stage == 0, length=length,
                                     documents=documents)
        return self.model.head(h, targets) if stage == self.S - 1 else h

    def __call__(self, micro_batches, count: int, device: torch.device, weights=None, aux_weights=None) -> torch.Tensor:
        self.engine.wait_for_weights()  # ZeRO-1's all-gathers: forward does not enter through the model here
        step = _Step(list(micro_batches), count, weights, weights if aux_weights is None else aux_weights,
                     torch.zeros((), device=device))
        dtype = next(self.model.parameters()).dtype
        for item in batches(self.table):
            if isinstance(item, list):
                self._post(step, item, dtype, device)
                continue
            self._compute(step, item)
        for posted in step.sending:
            posted.wait()
        if self.tied_group is not None:  # the head's copy of the embedding and the embedding's: one weight
            grad = self.model.embed.weight.grad
            summed = grad.float()  # in fp32, as the data-parallel reductions: two fp16 halves may overflow
            dist.all_reduce(summed, group=self.tied_group)
            grad.copy_(summed)
        self.engine.prepare_backward(True)
        self.engine.finish_backward(True)  # every bucket at once: no backward is left to overlap
        dist.all_reduce(step.loss, group=self.group)  # the loss lives on the last stage
        return step.loss

    def _compute(self, step: "_Step", a: Action) -> None:
        """One computation, in a method of its own: its locals (a received tensor, an output and its graph)
        die with the call, not at the next action."""
        data = self._receive(step, a)  # waited for outside the timer: waiting is no computation
        with self.timer(a):
            if a.kind == "F":
                self._forward(step, a, data)
            elif a.kind in ("B", "I"):
                self._backward(step, a, data)
            elif a.kind == "W":
                self.weight_grads.run(step.deferred.pop((a.stage, a.mb)))
            else:
                raise ValueError(f"the pipeline engine does not run {a.kind} actions")

    def _post(self, step: "_Step", batch: list[Action], dtype, device) -> None:
        """One batch of sends and receives, each posted on its flow; the receives are waited for where a
        computation reads them, the sends (and the tensors they read) kept until they complete."""
        for a in batch:
            key = (a.stage, a.mb)
            if a.kind.startswith("RECV"):
                buf = torch.empty(self.activation_shape, dtype=dtype, device=device)
                step.recvs[(a.kind, a.stage, a.mb)] = (_Posted(self._transfer(dist.irecv, buf, self._flow(a)), []), buf)
                continue
            if a.kind == "SEND_F":
                out = step.outputs[key]
                sent = out.detach()
                out.data = torch.empty((1,), dtype=out.dtype, device=out.device)  # freed once sent
            else:
                sent = step.inputs.pop(key).grad
            step.sending.append(_Posted(self._transfer(dist.isend, sent, self._flow(a)), [sent]))
        step.sending = [p for p in step.sending if not p.completed()]

    def _receive(self, step: "_Step", a: Action) -> torch.Tensor | None:
        """The received tensor a computation reads (a stage's input, or its output's gradient), waited for."""
        kind = "RECV_F" if a.kind == "F" and a.stage > 0 else \
            "RECV_B" if a.kind in ("B", "I") and a.stage < self.S - 1 else None
        if kind is None:
            return None
        posted, buf = step.recvs.pop((kind, a.stage, a.mb))
        posted.wait()
        return buf

    def _forward(self, step: "_Step", a: Action, received: torch.Tensor | None) -> None:
        x, y = step.data[a.mb]
        documents = self.model.documents(x)  # every stage has the ids: packed examples' masks from them
        if received is not None:
            x = received.requires_grad_()
        out = self.forward(a.stage, x, y, y.shape[1], documents)  # the sequence's length, whatever slice x holds
        # The layers this forward ran hold their losses (a rank's other stages' were taken after theirs).
        aux = aux_loss(self.moe_layers, *self.aux_coefs) if self.moe_layers else None
        if aux is not None:
            aux = aux / step.count if step.aux_weights is None else aux * step.aux_weights[a.mb]
        if a.stage == self.S - 1:
            out = out / step.count if step.weights is None else out * step.weights[a.mb]
            step.loss += out.detach()
            out = out if aux is None else out + aux  # trained on, not reported as the loss
        elif aux is not None:
            step.aux[(a.stage, a.mb)] = aux
        step.inputs[(a.stage, a.mb)], step.outputs[(a.stage, a.mb)] = x, out

    def _backward(self, step: "_Step", a: Action, grad: torch.Tensor | None) -> None:
        """B, or I: B with the linear layers' weight gradients queued for the micro-batch's W."""
        key = (a.stage, a.mb)
        self.weight_grads.deferring = a.kind == "I"
        out = step.outputs.pop(key)
        factor = self.scaler.scale * self.engine.loss_factor()
        if grad is None:  # the last stage: out is the loss
            (out * factor if factor != 1.0 else out).backward()
        elif (aux := step.aux.pop(key, None)) is not None:  # the losses' gradient is the loss's: the scale
            _run_backward((out, aux), (grad, torch.full_like(aux, factor)))
        else:
            _run_backward((out,), (grad,))
        if a.kind == "I":
            step.deferred[key] = self.weight_grads.take()
            self.weight_grads.deferring = False
        if a.stage == 0:
            step.inputs.pop(key)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of one batch, forward only, stage after stage; every rank returns it."""
        self.engine.wait_for_weights()  # ZeRO-1's all-gathers of the last update (no whole-model forward hook runs)
        device = x.device
        loss = torch.zeros((), device=device)
        shape = (x.shape[0], x.shape[1], self.model.cfg.hidden_size)  # eval: no sequence split
        h = None
        for s in range(self.S):
            if rank_of(s, self.pp) != self.mesh.pp_rank:
                continue
            if s > 0:
                h = torch.empty(shape, dtype=next(self.model.parameters()).dtype, device=device)
                flow = ("F", rank_of(s - 1, self.pp), self.mesh.pp_rank)
                for w in self._start(dist.irecv, h, flow):
                    w.wait()
            out = self._stage_forward(s, x if s == 0 else h, y, x.shape[1], self.model.documents(x))
            if s == self.S - 1:
                loss = out.float()
            else:
                flow = ("F", self.mesh.pp_rank, rank_of(s + 1, self.pp))
                for w in self._start(dist.isend, out.contiguous(), flow):
                    w.wait()
        dist.all_reduce(loss, group=self.group)
        return loss

