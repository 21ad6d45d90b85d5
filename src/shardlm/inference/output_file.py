"""`generate --input/--output`'s output file: each completion written once it and every line before it are done
(a crash keeps them, in input order), an output that --overwrite replaces swapped in only once whole; and the
commands' tqdm progress bar."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def progress_bar(total: int, what: str, shown: bool = True, unit: str = "req"):
    """A tqdm bar on a terminal (nothing when stderr is a file or pipe, or where not `shown`); returns
    (update, close)."""
    from tqdm import tqdm
    bar = tqdm(total=total, desc=what, unit=unit, disable=None if shown else True, file=sys.stderr)
    return bar.update, bar.close


def generate_file(engine, requests, rows, out: Path, main: bool = True) -> int:
    """Runs the engine, writing each completion once it and all before it are done (a crash keeps them);
    under tensor parallelism every rank runs the same requests and the first writes them. An output that
    --overwrite replaces is replaced once the new one is whole: until then the lines go to a file beside it
    (.NAME.partial, which a crash leaves), so that a crash does not cost the old one too."""
    update, close = progress_bar(len(requests), "generate", main)
    written = 0
    replacing = main and out.exists()
    target = out.with_name(f".{out.name}.partial") if replacing else out
    try:
        with open(target if main else os.devnull, "w", encoding="utf-8") as f:
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

            def progress(n):
                update(n)
                flush()
            engine.run(requests, progress)
            flush()
        if replacing:
            os.replace(target, out)
    finally:
        close()
    if main:
        n, new = len(requests), sum(len(r.tokens) for r in requests)
        print(f"{n} completion{'s' if n != 1 else ''}, {new:,} new token{'s' if new != 1 else ''} -> {out}",
              file=sys.stderr)
    return 0
