"""Where a multi-GPU step's time goes, from every rank's torch.profiler trace (`bench/tensor_parallel.py
--profile N` writes them as DIR/SYSTEM-rankR.trace.json[.gz]): per rank the GPU's busy time, split into compute
and NCCL and their overlap, by kernel class, and idle; then NCCL's kernels matched across the ranks by their
order: the faster rank's duration of each is its moving time (the last to arrive waits for nobody), the rest
each rank's waiting for the others; by collective.

    python bench/trace_collectives.py DIR SYSTEM [--steps N]
"""
import gzip
import json
import re
from pathlib import Path

from common import covered as union, kernel_kind


def load(path):
    op = gzip.open if str(path).endswith(".gz") else open
    with op(path, "rt") as f:
        return json.load(f)


def events(trace):
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(ev, key=lambda e: float(e["ts"]))


def main(d, system, steps):
    ranks = sorted(p for p in Path(d).iterdir() if re.fullmatch(rf"{re.escape(system)}-rank\d+\.trace\.json(\.gz)?", p.name))
    if not ranks:
        raise SystemExit(f"no {system}-rankN.trace.json[.gz] in {d} (bench/tensor_parallel.py --profile writes them; "
                         "a --local-collectives run's are SYSTEM-local-rankN)")
    per = []
    for p in ranks:
        ev = events(load(p))
        if not ev:
            raise SystemExit(f"{p} holds no GPU kernel: a trace of a CPU run, or of no step")
        t0, t1 = float(ev[0]["ts"]), max(float(e["ts"]) + float(e["dur"]) for e in ev)
        span = (t1 - t0) / 1e3 / steps
        iv = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ev]
        busy = union(iv) / 1e3 / steps
        nccl = [e for e in ev if "nccl" in e["name"].lower()]
        compute_iv = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ev if "nccl" not in e["name"].lower()]
        comp = union(compute_iv) / 1e3 / steps
        nccl_ms = union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in nccl]) / 1e3 / steps
        overlap = comp + nccl_ms - busy
        kinds = {}
        for e in ev:
            k = kernel_kind(e["name"], e["cat"])
            kinds[k] = kinds.get(k, 0.0) + float(e["dur"]) / 1e3 / steps
        names = {}
        for e in nccl:
            n = e["name"].split("(")[0]
            names[n] = names.get(n, 0) + 1 / steps
        per.append(dict(rank=p.name, span_ms=span, busy_ms=busy, compute_ms=comp, nccl_ms=nccl_ms, overlap_ms=overlap,
                        idle_pct=100 * (1 - busy / span), kinds=kinds, nccl=nccl, n_nccl=len(nccl) / steps,
                        nccl_names=names))
    for r in per:
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["kinds"].items(), key=lambda x: -x[1]))
        print(f"{system} {r['rank']}: span {r['span_ms']:.1f} ms/step, busy {r['busy_ms']:.1f} (compute {r['compute_ms']:.1f}, "
              f"nccl {r['nccl_ms']:.1f}, both at once {r['overlap_ms']:.1f}), idle {r['idle_pct']:.1f}% | {kinds} | "
              f"{r['n_nccl']:.0f} nccl kernels/step {r['nccl_names']}")
    if len(per) >= 2 and all(len(r["nccl"]) == len(per[0]["nccl"]) for r in per):
        durs = list(zip(*[[float(e["dur"]) for e in r["nccl"]] for r in per]))
        moving = sum(min(d) for d in durs) / 1e3 / steps
        waiting = [sum(d[i] - min(d) for d in durs) / 1e3 / steps for i in range(len(per))]
        small = sorted(min(d) for d in durs)
        med = small[len(small) // 2]
        p90 = small[int(0.9 * len(small))]
        by_kind = {}
        for i, e in enumerate(per[0]["nccl"]):
            n = e["name"].split("(")[0][:40]
            m = by_kind.setdefault(n, [0, 0.0, 0.0])
            m[0] += 1
            m[1] += min(durs[i])
            m[2] += max(durs[i]) - min(durs[i])
        print(f"nccl matched: {len(durs) / steps:.0f}/step, moving (faster rank) {moving:.1f} ms/step, "
              f"waiting per rank {[round(w, 1) for w in waiting]} ms/step; per collective min-duration median "
              f"{med:.1f} us, p90 {p90:.1f} us")
        for n, (c, mv, wt) in sorted(by_kind.items(), key=lambda x: -x[1][1]):
            print(f"  {n}: {c / steps:.0f}/step, moving {mv / c:.1f} us each ({mv / 1e3 / steps:.1f} ms/step), "
                  f"spread {wt / c:.1f} us each ({wt / 1e3 / steps:.1f} ms/step)")
    elif len(per) >= 2:
        print("nccl kernel counts differ across ranks:", [len(r["nccl"]) for r in per])


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("system")
    p.add_argument("--steps", type=int, default=1, help="the steps each trace holds (--profile N)")
    a = p.parse_args()
    main(a.dir, a.system, a.steps)
