"""`generate --input/--output`'s output file: each completion written once it and every line before it are done
(a crash keeps them, in input order), an output that --overwrite replaces swapped in only once whole."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ..runtime.progress import duration, progress
from .request_lines import written_in_place


def generate_file(engine, requests, rows, out: Path, main: bool = True) -> int:
    """Runs the engine, writing each completion once it and all before it are done (a crash keeps them);
    under tensor parallelism every rank runs the same requests and the first writes them. An output that
    --overwrite replaces is replaced once the new one is whole: until then the lines go to a file beside it
    (.NAME.partial, which a crash leaves), so that a crash does not cost the old one too."""
    bar, start = progress(len(requests), "generate", "requests", main), time.perf_counter()
    written = 0
    # Through a link, the file it names is replaced (the link kept); a device, a pipe or a descriptor is appended
    # to: replacing it would put a file where it was, or unlink the file a shell redirected stdout to.
    in_place, real = written_in_place(out), Path(os.path.realpath(out))
    replacing = main and not in_place and real.is_file()
    target = real.with_name(f".{real.name}.partial") if replacing else out
    try:
        with open(target if main else os.devnull, "a" if in_place else "w", encoding="utf-8") as f:
            def flush():
                nonlocal written
                while written < len(requests) and requests[written].done:
                    r, row = requests[written], rows[written]
                    asked = {"prompt": row["prompt"]} if row.get("messages") is None else {"messages": row["messages"]}
                    line = {**asked, "completion": r.text, "finish_reason": r.finish_reason,
                            "prompt_tokens": len(r.prompt), "completion_tokens": len(r.tokens)}
                    if row["id"] is not None:
                        line = {"id": row["id"], **line}
                    f.write(json.dumps(line, ensure_ascii=False) + "\n")
                    written += 1
                f.flush()

            def advance(n):
                bar.update(n)
                flush()
            engine.run(requests, advance)
            flush()
        if replacing:
            os.replace(target, real)
    finally:
        bar.close()
    if main:
        n, new, took = len(requests), sum(len(r.tokens) for r in requests), time.perf_counter() - start
        print(f"{n} completion{'s' if n != 1 else ''}, {new:,} new token{'s' if new != 1 else ''} in "
              f"{duration(took)} ({new / max(took, 1e-9):,.0f} tokens/s) -> {out}", file=sys.stderr)
    return 0
