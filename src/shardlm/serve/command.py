"""`shardlm serve`: a model (and LoRA adapters over it, chosen per request) behind an OpenAI-compatible
HTTP API, on uvicorn. The first SIGTERM or SIGINT drains: new requests get 503, those in flight finish,
then uvicorn shuts down gracefully and the process exits 0 (as vLLM's and Kubernetes' graceful shutdown
expect); a second signal ends it at once, with that signal's status.
"""
from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
import time
from pathlib import Path

from ..config import ConfigError
from ..inference.commands import check_world, runtime_args
from ..runtime.progress import progress

EPILOG = """\
endpoints (OpenAI's API; see the README's Serving section):
  POST /v1/completions        prompt, max_tokens (16), temperature (1), top_p, top_k (extension), seed,
                              stop (up to 4), stream (server-sent events), stream_options.include_usage;
                              n = 1 only
  POST /v1/chat/completions   messages (role, content, name; no tool calls), rendered with the tokenizer's
                              chat template; max_tokens (default:
                              the rest of the context) or max_completion_tokens; the same sampling fields
  GET  /v1/models             the base model (its id: --served-model-name, default the --model argument)
                              and each --adapter, whose id is its NAME: a request's "model" picks one
  GET  /v1/models/ID          one of them
  GET  /health                {"status": "ok"}, 503 {"status": "draining"} while shutting down
  GET  /metrics               JSON: requests total/active/queued/finished/cancelled/failed/rejected, tokens
                              generated, tokens_per_s over the last window_s seconds, slots_in_use / slots,
                              on a GPU memory_bytes and memory_peak_bytes (torch's allocator: this rank's;
                              with --replicas, the sum over their GPUs)
                              (Prometheus' text format to a client that asks for it: Accept text/plain)
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardlm serve", description="Serve a model over an OpenAI-compatible HTTP "
                                "API, many requests at once through one continuous-batching engine.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="an HF checkpoint directory, or a shardlm run or checkpoint")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                   help="a PEFT LoRA adapter directory served as model NAME over the base, applied per request "
                        "(repeatable)")
    p.add_argument("--served-model-name", default=None, help="the base model's id (default: --model as given)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: this machine only; "
                                                         "the server checks no API key)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=16, help="requests decoded at once (fewer where the GPU's "
                                                              "free memory holds fewer); the rest queue")
    p.add_argument("--max-len", type=int, default=None, help="positions per request, prompt and completion "
                                                              "(default: the model's context)")
    runtime_args(p)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (torchrun --nproc-per-node N -m shardlm "
                   "serve ... --tp N): each holds its slice of the weights and runs the same steps; rank 0 serves "
                   "HTTP")
    p.add_argument("--replicas", type=int, default=1, help="data-parallel replicas of the model, one per GPU, behind "
                   "this one server (each request goes to the one with the fewest in flight); refused without GPUs")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return p


def _adapters(specs: list[str], base: str, model: str) -> dict[str, Path]:
    from ..adapter_check import check_adapter_target
    from ..parallel.lora import read_peft_files
    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, directory = spec.partition("=")
        if not sep or not name or not directory:
            raise ConfigError(f"--adapter {spec!r}: expected NAME=DIR")
        if name in out or name == base:
            raise ConfigError(f"--adapter {spec!r}: the id {name!r} is taken (by the base model or another adapter)")
        if not Path(directory).is_dir():
            raise ConfigError(f"--adapter {spec!r}: {directory} is no directory")
        check_adapter_target(model, directory)  # a LoRA run or a merged export would get it twice
        read_peft_files(directory)  # a directory missing its files was named only once the base model had loaded
        out[name] = Path(directory)
    return out


def _bind(host: str, port: int):
    """The socket uvicorn will listen on, bound now: a host that does not resolve or a port in use is refused
    before the model loads (minutes for a large one), not after, and no other process takes the port while it
    loads (uvicorn, binding only then, failed with a log line of its own and status 3 after the banner had
    announced the server)."""
    import socket
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ConfigError(f"--host {host}: {e.strerror or e}") from None
    family, kind, proto, _, address = infos[0]
    s = socket.socket(family, kind, proto)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        s.bind(address)
        # Listening holds the port (a bound socket alone does not, against another SO_REUSEADDR bind); a client
        # that connects during the load waits in the backlog and is answered once the server is up.
        s.listen(2048)  # uvicorn's default backlog
    except OSError as e:
        s.close()
        raise ConfigError(_bind_error(host, port, e)) from None
    return s


def _bind_error(host: str, port: int, e: OSError) -> str:
    """Why the address cannot be listened on, naming the flag at fault and the fix (the bare strerror named
    --port also when --host was the trouble, and said nothing to do)."""
    import errno
    why = e.strerror or str(e)
    if e.errno == errno.EADDRINUSE:
        return (f"--port {port} on {host}: {why}: another process listens there (another shardlm serve?); stop it "
                "or pick another --port (0: any free one)")
    if e.errno == errno.EADDRNOTAVAIL:
        return (f"--host {host}: {why}: it is not an address of this machine; use 127.0.0.1 (this machine only) or "
                "0.0.0.0 (every interface)")
    if e.errno == errno.EACCES:
        return f"--port {port} on {host}: {why}: ports below 1024 need root; pick one from 1024 on"
    if e.errno == errno.EINVAL and host.lower().startswith("fe80:") and "%" not in host:
        return (f"--host {host}: {why}: a link-local IPv6 address is bound through its interface: give "
                f"{host}%IFACE (say %eth0), or :: for every interface")
    if e.errno == errno.EINVAL:
        return f"--host {host}: {why}: not an address to listen on; use 127.0.0.1, 0.0.0.0 or ::"
    return f"--port {port} on {host}: {why}"


def cmd_serve(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    from ..extras import import_optional
    for package in ("fastapi", "uvicorn"):  # before the model loads: a missing or broken extra fails at once
        import_optional(package, package, "serve", f"serve needs fastapi and uvicorn ({package} is not "
                        "installed): pip install 'shardlm[serve]'", ConfigError)
    if a.max_batch < 1:
        raise ConfigError(f"--max-batch {a.max_batch} must be at least 1")
    if a.max_len is not None and a.max_len < 2:  # a prompt is one token at least, its completion another
        raise ConfigError(f"--max-len {a.max_len} leaves no room for a prompt and its completion: give 2 or more")
    if a.served_model_name is not None and not a.served_model_name.strip():  # '' would fall back to --model unsaid
        raise ConfigError("--served-model-name is empty: give the id clients name in \"model\", or leave it out "
                          "(the id is then --model as given)")
    if not 0 <= a.port <= 65535:
        raise ConfigError(f"--port {a.port} is not a port (0 to 65535; 0: any free one)")
    _, rank, _ = check_world(a.tp)  # before the port: at --tp 1 each torchrun rank would serve it
    sock = None
    if a.tp == 1 or rank == 0:  # under torchrun only rank 0 serves HTTP; the others would race it
        sock = _bind(a.host, a.port)
    base = a.served_model_name or a.model
    adapters = _adapters(a.adapter, base, a.model)
    from ..inference import Engine, load_pretrained, slots_that_fit
    if adapters and not hasattr(Engine, "add_adapter"):
        raise ConfigError("--adapter: this version's engine cannot apply adapters per request (it has no "
                          "Engine.add_adapter yet); serve the merged model instead (shardlm export --merge, or "
                          "a PEFT merge), or use shardlm generate --adapter")
    from ..inference.commands import TIMEOUT_S, _tensor_parallel
    from .worker import warm_up_batches
    if adapters and a.tp > 1:
        # export --merge merges a LoRA run's own adapters, not a PEFT directory's: the advice once sent there
        raise ConfigError("--adapter with --tp: adapters are not sliced for tensor parallelism yet; serve the base "
                          "with the adapter merged into it instead (PEFT's merge_and_unload and save_pretrained; "
                          "a shardlm LoRA run's own: shardlm export --merge)")
    device, group, main = _tensor_parallel(a)
    devices = _replica_devices(a.replicas, a.tp, device, a.device)
    source, verified = a.model, False
    if len(devices) > 1 and Path(a.model).is_dir() and not (Path(a.model) / "config.json").is_file():
        # The replicas load one checkpoint, verified once: each taking a run's newest, a save that the run still
        # training committed between two loads put two steps' weights behind one model name.
        from ..checkpoint import resolve_checkpoint
        source, verified = str(resolve_checkpoint(a.model)), True
    model, tok, cfg = load_pretrained(source, device=device, dtype=a.dtype, tp_group=group, verify=not verified,
                                      stall_s=TIMEOUT_S, quantize=a.quantize)
    max_len = min(a.max_len or cfg.max_seq_len, cfg.max_seq_len)
    if a.max_len and a.max_len > max_len and main:  # once, not once per --tp rank
        print(f"shardlm serve: --max-len {a.max_len} is beyond the model's context: {max_len}", file=sys.stderr)
    slots = slots_that_fit(model, max_len, a.max_batch)
    plans = None
    if group is not None:
        from .tp import agree_slots, plan_group
        plans = plan_group()
        slots = agree_slots(slots, plans)
    engine = Engine(model, slots, max_len, compile={"auto": None, "on": True, "off": False}[a.compile],
                    decode=tok.text, vocab=tok.vocab_size)
    if plans is not None:
        from .tp import Leader, follow
        if not main:
            return follow(engine, plans)
        engine = Leader(engine, plans)
    engines = [engine]
    for other in devices[1:]:  # data-parallel replicas: the same model again on each further GPU
        again, _, _ = load_pretrained(source, device=other, dtype=a.dtype, verify=not verified, quantize=a.quantize)
        engines.append(Engine(again, min(slots, slots_that_fit(again, max_len, a.max_batch)), max_len,
                              compile={"auto": None, "on": True, "off": False}[a.compile], decode=tok.text,
                              vocab=tok.vocab_size))
    for e in engines:
        for name, directory in adapters.items():
            e.add_adapter(name, directory)
    try:
        server, worker = build_server(engines if len(engines) > 1 else engine, tok, base, adapters, a.host, a.port,
                                      a.log_level, lambda e: warm_up_batches(e, tok.eos_id or 0))
        where = f"{len(engines)} replicas on {', '.join(map(str, devices))}" if len(engines) > 1 else str(engine.device)
        n = len(engine.slots)
        # uvicorn names the address only where it binds it itself: the port chosen for --port 0 is told here
        host = f"[{a.host}]" if ":" in a.host else a.host
        print(f"shardlm serve: {base} ({n} slot{'s' if n != 1 else ''} of {max_len} positions, {where}"
              f"{f', tp {a.tp}' if plans else ''}), models: {', '.join([base, *adapters])}, on "
              f"http://{host}:{sock.getsockname()[1]}", file=sys.stderr, flush=True)
        server.run(sockets=[sock])
        worker.close(timeout=60)
    finally:
        if plans is not None:  # the followers exit with this rank
            engine.finish()
    return 0


def _replica_devices(replicas: int, tp: int, device, asked: str = "auto") -> list:
    """The device of each data-parallel replica: one GPU each from `device` on (`asked`: --device as given)."""
    import torch
    if replicas < 1:
        raise ConfigError(f"--replicas {replicas} must be at least 1")
    if replicas > 1 and tp > 1:
        raise ConfigError("--replicas with --tp: give one of them (replicas of a tensor-parallel model are not "
                          "supported yet)")
    if replicas == 1:
        return [device]
    if device.type != "cuda":
        # Copies on the CPU were loaded silently: they share its cores (each engine's products already use them
        # all), so they cost N times the memory and serve no faster than one engine batching the same requests.
        where = f"this server runs on the {device.type.upper()} (--device {asked})" if asked != "auto" else \
            "no GPU is visible to this process"
        raise ConfigError(f"--replicas {replicas} puts one copy of the model on each GPU, but {where}: copies on one "
                          "CPU would share its cores and serve no faster; leave --replicas out (one engine "
                          "batches up to --max-batch requests at once), or run on a host with a GPU per replica")
    first = device.index or 0  # --device cuda:K: the replicas on cuda:K on (from cuda:0, the first had shared K)
    if (gpus := torch.cuda.device_count()) < first + replicas:
        raise ConfigError(f"--replicas {replicas} needs one GPU each from cuda:{first} on (cuda:{first} to "
                          f"cuda:{first + replicas - 1}); {gpus} {'is' if gpus == 1 else 'are'} visible: give fewer "
                          "--replicas or an earlier --device")
    return [torch.device("cuda", first + i) for i in range(replicas)]


def build_server(engine, tok, base: str, adapters: dict, host: str, port: int, log_level: str = "info",
                 warm=lambda engine: []):
    """The uvicorn server (not started) of an app over `engine` (or a list of replicas' engines), and the
    started worker (or replica pool) that owns it, each engine having run the batches of requests `warm(engine)`
    makes (worker.warm_up_batches: every compiled shape before the first client waits)."""
    import uvicorn

    from ..data.instruct import chat_prompter
    from ..inference.load import with_adapters_chat_template
    from .app import ServerState, create_app
    from .protocol import Models
    from .worker import EngineWorker
    from .replicas import ReplicaPool
    engines = engine if isinstance(engine, list) else [engine]
    # before the warm-up: an adapter's unreadable tokenizer files end the start at once, not after minutes of it
    own = {n: t for n, d in adapters.items() if (t := with_adapters_chat_template(tok, d)) is not tok}
    workers, start = [], time.perf_counter()
    for e in engines:  # a bar on a terminal: compiling a large model's steps at a long context takes minutes
        batches = warm(e)
        # Off a terminal (a service's log, nohup) lines say the start is under way: a server that compiles before
        # it serves was silent for minutes.
        opening = (f"shardlm serve: warming up: {len(batches)} batches of requests through every step serving runs"
                   + (", compiling and capturing each (minutes for a large model at a long context)" if e.compile
                      else "")) if batches else None
        with progress(len(batches), "shardlm serve: warming up", "batches", opening=opening) as bar:
            workers.append(EngineWorker(e).start(batches, progress=bar.update))
    if any(e.compile for e in engines):
        print(f"shardlm serve: warmed up in {time.perf_counter() - start:.0f} s (the decode and prefill steps "
              "serving runs compiled and captured)", file=sys.stderr, flush=True)
    worker = workers[0] if len(workers) == 1 else ReplicaPool(workers)
    state = ServerState()
    models = Models(base, {n: str(d) for n, d in adapters.items()}, engines[0].max_len, tok, chat_prompter(tok),
                    engines[0].model.cfg.vocab_size, own)
    config = uvicorn.Config(create_app(worker, models, state), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=None)
    return _draining_server(uvicorn)(config, state), worker


def _draining_server(uvicorn):
    class DrainingServer(uvicorn.Server):
        """uvicorn's server whose first exit signal drains before it shuts down."""

        def __init__(self, config, state):
            super().__init__(config)
            self.serve_state = state

        def handle_exit(self, sig, frame):
            if not self.serve_state.draining:
                self.serve_state.draining = True
                print(f"shardlm serve: signal {sig}: draining {self.serve_state.in_flight} request(s), then "
                      "exiting; new requests get 503", file=sys.stderr, flush=True)
                return
            if threading.current_thread() is threading.main_thread():
                # The second: leave now, as that signal ends a process. uvicorn's own exit re-raised it only
                # after restoring asyncio's SIGINT handler, which cancelled every task: a Ctrl-C printed the
                # lifespan's and each running request's CancelledError tracebacks, a hundred lines.
                print(f"shardlm serve: signal {sig} again: exiting now, {self.serve_state.in_flight} request(s) "
                      "cut off", file=sys.stderr, flush=True)
                signal.signal(sig, signal.SIG_DFL)
                signal.raise_signal(sig)
            super().handle_exit(sig, frame)
            self.force_exit = True

        async def on_tick(self, counter: int) -> bool:
            if self.serve_state.draining and self.serve_state.idle:
                self.should_exit = True
            return await super().on_tick(counter)

        async def shutdown(self, sockets=None) -> None:
            # uvicorn waits for every connection to close, and one whose client stopped reading never does (its
            # transport waits to flush what was written to it): a drain never ended. Those still open once they
            # have had SEND_TIMEOUT_S to read are dropped.
            from . import app
            late = asyncio.get_running_loop().call_later(app.SEND_TIMEOUT_S, self._drop_connections)
            try:
                await super().shutdown(sockets)
            finally:
                late.cancel()

        def _drop_connections(self) -> None:
            for connection in list(self.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None:
                    transport.abort()
    return DrainingServer
