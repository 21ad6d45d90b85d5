"""The device mesh: ranks laid out as a grid with named axes (pp, dp, cp, tp), tensor parallel innermost so
that its heavy collectives stay inside a node (Narayanan et al. 2021). As in picotron, the grid is a
reshaped arange, and every group is a line (or plane) of it along some axes. The same ranks are read
through two named views (torchtitan's `ParallelDims`):

    dense   (pp, dp, cp, tp)      what attention, embeddings and dense MLPs are split over
    experts (pp, edp, ep, tp)     the dp x cp block reshaped, ep innermost: experts split over ep, each
                                  expert's replicas over edp = dp x cp / ep

With ep 1 the expert view adds nothing. Every rank creates every group, in the same order, once, when the
mesh is built. Besides one group per axis the mesh holds the derived groups: `dp+cp` (the ranks holding
the same dense parameters, over which their gradients are reduced), `pp+tp` (the ranks holding different
parts of one model replica), `pp_ends` (each line's first and last pipeline stage, which hold a tied
embedding's two copies) and the pipeline's point-to-point flows (`flow_name`: a two-rank group for the
activations from each stage's rank to the next and one for their gradients back, so that each flow has a
stream of its own).

The layout is validated from the environment torchrun sets, on every rank, before the process group
exists, so a bad layout fails with the same message everywhere and no rank waits in a collective.
"""
from __future__ import annotations

import math
import os
import sys
import threading
import warnings
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .config import Config, ConfigError, RunError, validate
from .config.views import VIEWS, view_shapes
from .runtime.device import pick_device
from .runtime.launch_env import check_rendezvous_env, world_from_env
from .runtime.store import StoreSilent, store_answers

AXES, EXPERT_AXES = VIEWS["dense"], VIEWS["experts"]  # outermost to innermost
# ("dp", "cp", "tp"), ("edp", "tp"), ("cp", "tp"): a mixture of experts under tensor parallelism routes each tp
# rank's own tokens, so its whole experts reduce over the tp ranks too and its routing counts span them.
DERIVED = (("dp", "cp"), ("pp", "tp"), ("dp", "cp", "tp"), ("edp", "tp"), ("cp", "tp"))


@dataclass
class DeviceMesh:
    sizes: dict = field(default_factory=lambda: dict.fromkeys(AXES + EXPERT_AXES, 1))   # axis -> degree
    coords: dict = field(default_factory=lambda: dict.fromkeys(AXES + EXPERT_AXES, 0))  # axis -> this rank's index
    groups: dict = field(default_factory=dict)  # "tp", "dp+cp", ... -> process group; absent: size 1
    rank: int = 0
    local_rank: int = 0

    @property
    def world(self) -> int:
        return math.prod(self.sizes[a] for a in AXES)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def size(self, axes: str) -> int:
        """The degree of an axis, or of several joined by '+' ("dp+cp"); axes of either view ("ep", "edp")."""
        return math.prod(self.sizes[a] for a in axes.split("+"))

    def coord(self, axis: str) -> int:
        return self.coords[axis]

    def group(self, axes: str):
        """The process group over an axis or a derived set of axes ("dp+cp"); None where its size is 1. A
        set of axes all but one of which have size 1 is that axis's group."""
        if axes not in self.sizes and "+" not in axes:  # a named group of its own, as pp_ends
            return self.groups.get(axes)
        wide = [a for a in axes.split("+") if self.sizes[a] > 1]
        return self.groups.get("+".join(wide)) if len(wide) == 1 else self.groups.get(axes)

    def release_groups(self) -> None:
        self.groups = {}

    def any_rank(self, failed: bool, device: torch.device) -> bool:
        """Whether a check failed on any rank (a MAX all-reduce over the world, on `device`: its backend's):
        every rank reaches it, so a failure on one (the main rank's save or directory, one GPU's free memory)
        stops them all together instead of leaving the others waiting in their next collective."""
        if self.world == 1:
            return failed
        flag = torch.tensor([float(failed)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def from_main(self, value):
        """The main rank's `value` on every rank (a broadcast of the object: what it alone could find out)."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # The data-parallel and tensor-parallel views most code asks for.
    dp = property(lambda self: self.sizes["dp"])
    tp = property(lambda self: self.sizes["tp"])
    pp = property(lambda self: self.sizes["pp"])
    cp = property(lambda self: self.sizes["cp"])
    dp_rank = property(lambda self: self.coords["dp"])
    tp_rank = property(lambda self: self.coords["tp"])
    pp_rank = property(lambda self: self.coords["pp"])
    dp_group = property(lambda self: self.group("dp"))
    tp_group = property(lambda self: self.group("tp"))
    pp_group = property(lambda self: self.group("pp"))


def flow_name(kind: str, src: int, dst: int) -> str:
    """The group carrying one pipeline flow: `kind` "F" (activations) or "B" (their gradients) from pipeline
    rank src to dst. Under NCCL a group's operations run in order on one stream: with both directions and
    both kinds on one group, a receive waiting for a slow peer held up another peer's data already sent.
    (NCCL warns that kernels of several communicators waiting on each other can hang where they cannot
    all be resident; Megatron-LM's separate sends and receives take the same risk.)"""
    return f"pp_{kind}_{src}_{dst}"


def flows(pp: int) -> list[tuple[str, int, int]]:
    """Every flow a pipeline of pp ranks may use: activations from each rank to the next, their gradients
    back, the last rank's next the first (virtual stages wrap around)."""
    return list(dict.fromkeys(f for a in range(pp) for f in (("F", a, (a + 1) % pp), ("B", (a + 1) % pp, a))))


def build_mesh(pp: int = 1, dp: int = 1, cp: int = 1, tp: int = 1, timeout: timedelta | None = None,
               ep: int = 1) -> DeviceMesh:
    """The mesh of an initialised process group (or of one process when none is initialised)."""
    sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
    views = view_shapes({**sizes, "ep": ep})
    if not dist.is_initialized():
        if math.prod(sizes.values()) != 1:
            raise ValueError(f"a mesh of {sizes} needs an initialised process group of that many ranks")
        return DeviceMesh()
    world, rank = dist.get_world_size(), dist.get_rank()
    if math.prod(sizes.values()) != world:
        raise ValueError(f"mesh {sizes} does not have the world size {world}")
    mesh = DeviceMesh({**views["dense"], **views["experts"]}, {}, {}, rank, int(os.environ.get("LOCAL_RANK", 0)))
    # Every rank must create every group, in the same order, even those it is not in.
    for kind, view in views.items():
        grid = torch.arange(world).view(*view.values())
        names = list(view)
        mesh.coords.update(zip(names, (int(i) for i in (grid == rank).nonzero()[0])))
        if kind == "experts" and ep == 1:  # every expert is whole on each rank: edp is dp x cp itself
            for name, same in (("edp", "dp+cp"), ("edp+tp", "dp+cp+tp")):
                if (replicas := mesh.group(same)) is not None:
                    mesh.groups[name] = replicas
            continue
        wanted = [(a,) for a in names] + [d for d in DERIVED if all(a in view for a in d)]
        for axes in wanted:
            name = "+".join(axes)
            if name not in mesh.groups:  # pp and tp: the same ranks in both views
                _add_groups(mesh, grid, names, axes, timeout)
    if pp > 1:  # each line's first and last stage (a tied embedding's two copies), and its flows
        grid = torch.arange(world).view(pp, dp, cp, tp)
        for line in grid.permute(1, 2, 3, 0).reshape(-1, pp).tolist():
            group = dist.new_group([line[0], line[-1]], timeout=timeout)
            if rank in (line[0], line[-1]):
                mesh.groups["pp_ends"] = group
            for kind, a, b in flows(pp):
                group = dist.new_group([line[a], line[b]], timeout=timeout)
                if rank in (line[a], line[b]):
                    mesh.groups[flow_name(kind, a, b)] = group
    return mesh


def _add_groups(mesh: DeviceMesh, grid: torch.Tensor, names: list[str], axes: tuple, timeout) -> None:
    """The groups along `axes` of one view's grid: this rank's kept under the axes' joined name. A group
    that spans the whole world is the default group itself; one of size 1 needs none, nor does a set of
    axes of which one alone has a degree above 1 (DeviceMesh.group finds that axis's own)."""
    sizes = dict(zip(names, grid.shape))
    size = math.prod(sizes[a] for a in axes)
    if size == 1 or (len(axes) > 1 and sum(sizes[a] > 1 for a in axes) < 2):
        return
    name = "+".join(axes)
    if size == grid.numel():
        mesh.groups[name] = dist.group.WORLD
        return
    inner = [names.index(a) for a in axes]
    outer = [i for i in range(len(names)) if i not in inner]
    for line in grid.permute(*outer, *inner).reshape(-1, size).tolist():
        group = dist.new_group(line, timeout=timeout)
        if mesh.rank in line:
            mesh.groups[name] = group


def init_distributed(cfg: Config, also: dict | None = None) -> DeviceMesh:
    """The mesh of `cfg`'s layout; `also`: other settings (--out) that every rank must share with the config."""
    world, rank, local_rank = world_from_env()
    validate(cfg, world)
    if world == 1:
        return DeviceMesh()
    if cfg.train.device.startswith("cuda"):  # refused before the rendezvous: it would join with gloo, the rest
        pick_device(cfg.train.device)        # with NCCL, and both wait out the timeout
    use_cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
    local_world = max(int(os.environ.get("LOCAL_WORLD_SIZE", 0)), local_rank + 1)
    if use_cuda:
        # Every rank of the node checks the node's process count, so none goes on into a rendezvous that
        # the ranks without a GPU never join.
        gpus = torch.cuda.device_count()
        if local_world > gpus:
            raise ConfigError(f"{local_world} processes on this node need one GPU each, but {gpus} "
                              f"{'is' if gpus == 1 else 'are'} visible: start at most {gpus} per node "
                              f"(torchrun --nproc-per-node {gpus}), or train on the CPU (--train.device cpu)")
        torch.cuda.set_device(local_rank)
    p = cfg.parallel
    if p.tp > 1 and local_world % p.tp and rank == 0:
        warnings.warn(f"parallel.tp = {p.tp} spans nodes of {local_world} processes each: it works, but its "
                      "collectives (several per layer) then cross the network and will be slow", stacklevel=2)
    elif p.cp > 1 and local_world % (p.tp * p.cp) and rank == 0:  # cp's ranks sit tp apart (AXES)
        warnings.warn(f"parallel.cp = {p.cp} (x parallel.tp = {p.tp}) spans nodes of {local_world} processes each: "
                      "it works, but its all-to-alls (four per layer, each way) then cross the network and will be "
                      "slow", stacklevel=2)
    # gloo raises at the timeout. NCCL's watchdog would abort the communicator and let the step go on with
    # the aborted collectives' data: the trainer's own watchdog (runtime/watchdog.py) ends the rank at
    # timeout_s instead, and NCCL's, at twice that, is only the backstop.
    timeout = timedelta(seconds=p.timeout_s * (2 if use_cuda else 1))
    if not dist.is_initialized():
        check_rendezvous_env(world)
        rendezvous("nccl" if use_cuda else "gloo", timeout, world, local_rank == 0)
    # Before the mesh: ranks given other layouts would create other groups and wait in each other's.
    check_same_settings({**_settings(cfg), **(also or {})})
    return build_mesh(p.pp, p.dp, p.cp, p.tp, timeout, ep=p.ep)


def _settings(cfg: Config) -> dict:
    """The config's keys as "section.key": value. The data's paths are left out: what they hold is compared
    once it is read (a copy of the data at another path on another node trains alike); so is offload_dir,
    each node's own scratch disk, which holds only that node's ranks' files."""
    flat = {f"{section}.{key}": value for section, keys in cfg.to_dict().items() for key, value in keys.items()}
    return {k: v for k, v in flat.items() if k not in ("data.path", "data.eval_path", "parallel.offload_dir")}


def every_rank(value) -> list:
    """Each rank's `value`, on every rank (a gather of objects over the world)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def check_same_settings(mine: dict) -> None:
    """Refuse, on every rank at once, ranks started with different `mine` (one rank's other config or
    --out, a node left with an old job script). They went on to train on silently diverging replicas (another
    train.lr), or to abort in gloo's C++ ('Is there a distributed collective mismatch in your code?') at the
    first collective of another shape, or to fail at the first save, steps later (another --out)."""
    every = every_rank(mine)
    first = every[0]
    for rank, theirs in enumerate(every):
        keys = [k for k in dict.fromkeys([*first, *theirs]) if first.get(k) != theirs.get(k)]
        if keys:
            shown = ", ".join(f"{k} = {theirs.get(k)!r} where rank 0 has {first.get(k)!r}" for k in keys[:3])
            more = f" (and {len(keys) - 3} more)" if len(keys) > 3 else ""
            raise ConfigError(f"the ranks were started with different settings: rank {rank} has {shown}{more}; "
                              "start every rank with the same config and arguments")


def rendezvous(backend: str, timeout: timedelta, world: int, say: bool) -> None:
    """init_process_group, which waits for every rank of the job up to `timeout`: a rank started by hand whose
    peers never start, or a node of the job slow to come up, waited in silence. Where `say` (a node's first
    rank), a line tells what it waits for once the wait is no longer a start-up's."""
    done = threading.Event()

    def waiting():
        if not done.wait(min(10.0, timeout.total_seconds() / 4)):
            print(f"shardlm: waiting for all {world} ranks to join at {os.environ['MASTER_ADDR']}:"
                  f"{os.environ['MASTER_PORT']} (for up to {timeout.total_seconds():g} s): each must be started, "
                  "with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE", file=sys.stderr, flush=True)
    if say:
        threading.Thread(target=waiting, name="shardlm-rendezvous", daemon=True).start()
    host, port, rank = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ.get("RANK", 0))
    unreachable = RunError(f"rank {rank} could not reach the job's store at {host}:{port} within "
                           f"{timeout.total_seconds():g} s: rank 0 serves it (torchrun's agent, under torchrun) and "
                           "was not started, or cannot be reached from this host; start every rank with the same "
                           "MASTER_ADDR and MASTER_PORT")
    try:
        if rank != 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            # torch's client would wait forever on something listening there that is not a store
            if not store_answers(host, port, world, timeout.total_seconds()):
                raise unreachable
        dist.init_process_group(backend, timeout=timeout, **_attempt_store(timeout))
    except StoreSilent as e:
        raise RunError(f"rank {rank}: {e}: a stopped or hung process of an earlier job may hold the port, or "
                       "another service listens there; free it, or set MASTER_PORT to a free port, the same on "
                       "every rank") from None
    except RuntimeError as e:  # DistStoreError, DistNetworkError
        if isinstance(e, RunError) or "trying to connect to" not in str(e):
            raise
        raise unreachable from None  # otherwise said as a peer that "died or stalled, which one could not be told"
    finally:
        done.set()


def _attempt_store(timeout: timedelta) -> dict:
    """init_process_group's store for an attempt that torchrun restarted (--max-restarts): a prefix of its own in
    the agent's store. torch's rendezvous reuses that store across attempts with the same keys, so a restarted
    rank could read the failed attempt's peer addresses and give up connecting to a dead process (gloo's
    'Connection refused'), or the group wait at the rendezvous until its timeout: about half the restarts failed."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt in ("", "0"):
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    return {"store": dist.PrefixStore(f"shardlm/attempt_{attempt}/", store), "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])}
