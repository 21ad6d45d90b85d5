"""The embedded default corpus: the Python standard library's own sources.

Every machine that runs shardlm has them, so `shardlm train` with no arguments trains on real text with
no download. The files are chosen deterministically (sorted top-level modules, up to a byte budget)
and tokenized once with the byte tokenizer into a cache directory keyed by that choice.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import socket
import sysconfig
import tempfile
from pathlib import Path

from ..config import ConfigError
from .prepare import INDEX, prepare

BUDGET_BYTES = 4 << 20
# How the corpus is tokenized, in its cache key: a release that tokenizes it otherwise prepares it again.
TOKENIZATION = "byte, special tokens' spellings as text"


def default_sources(budget: int = BUDGET_BYTES) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files, total, seen = [], 0, set()
    for p in sorted(stdlib.glob("*.py")):
        st = p.stat()
        # Some distributions link one module under two names (Debian's _sysconfigdata_*): read it once, as
        # prepare refuses a file given twice.
        if (st.st_dev, st.st_ino) in seen or total + st.st_size > budget:
            continue
        seen.add((st.st_dev, st.st_ino))
        files.append(p)
        total += st.st_size
    if not files:
        raise FileNotFoundError(f"no Python sources found in {stdlib} for the default corpus")
    return files


def default_corpus(progress: bool = False, moved=None) -> Path:
    """Prepare (once) and return the directory of the default corpus (`moved`: as prepare's)."""
    files = default_sources()
    # A source edited in place keeps its size, not its modification time.
    stats = [(p, p.stat()) for p in files]
    key = hashlib.sha256("\n".join([TOKENIZATION] + [f"{p}:{st.st_size}:{st.st_mtime_ns}" for p, st in stats])
                         .encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shardlm" / f"stdlib-{key}"
    if not (cache / INDEX).is_file():
        _check_writable(cache.parent)
        # Several processes of one machine (ranks, concurrent jobs) may get here at once: each prepares
        # into its own directory and the first to finish renames it into place.
        tmp = cache.with_name(f"{cache.name}.tmp-{socket.gethostname()}-{os.getpid()}")
        _sweep_stale(cache)
        try:
            prepare(files, "byte", tmp, progress=progress, moved=moved)
            os.rename(tmp, cache)
        except OSError:  # another process won the race: its copy is complete
            if not (cache / INDEX).is_file():
                raise
        finally:  # an interrupted preparation leaves no half-written copy behind
            shutil.rmtree(tmp, ignore_errors=True)
    return cache


def _sweep_stale(cache: Path) -> None:
    # A process killed mid-preparation (SIGKILL, power loss) could not clean up: its pid is gone. Only this
    # host's are judged, as a cache directory in a shared home is also written by other nodes' ranks.
    for tmp in cache.parent.glob(f"{cache.name}.tmp-{socket.gethostname()}-*"):
        pid = tmp.name.rpartition("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _check_writable(directory: Path) -> None:
    # The user named no path here: an OSError would name a scratch directory and not say what to change.
    try:
        directory.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(dir=directory))
    except OSError as e:
        raise ConfigError(f"the default corpus (the Python standard library's sources, tokenized once) cannot be "
                          f"cached in {directory}: {e.strerror or e}; set XDG_CACHE_HOME to a writable directory, "
                          "or train on your own data (--data.path, made by `shardlm data prepare`)") from None
