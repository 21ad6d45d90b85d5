"""Optional packages (pyproject.toml's extras) told apart as missing or broken when their import fails.

A package that is not installed wants `pip install`; one that is installed but fails to import (a shared library
gone, a dependency of another version) wants a reinstall, which `pip install` alone does not do: it sees the
package there and stops. Each caller keeps its own line for a missing package; a broken one is said the same way
everywhere: which package, that it is installed, the import error's first line, and the command to reinstall it.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys


def is_missing(e: BaseException, name: str, module: str | None = None) -> bool:
    """Whether the failed import `e` (of `module`, by default `name`) says the package imported as `name` is not
    installed, rather than installed and failing."""
    if not isinstance(e, ModuleNotFoundError):
        return False  # a package's own ImportError (a missing .so) is raised from inside it: it is there
    ours = [n for n in (name, module or name) if e.name == n or (e.name or "").startswith(n + ".")]
    if ours and e.name in sys.modules and sys.modules[e.name] is None:
        return True  # blocked by a None in sys.modules, as an install without it (the tests make it missing so)
    try:
        # A ModuleNotFoundError from inside an installed package (a dependency gone, its own compiled submodule
        # deleted) names another module than the package's: only where the package cannot be found is it missing.
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # a parent package that fails, or a None in sys.modules
        return True


def broken_line(needs: str, package: str, e: BaseException) -> str:
    """One line: `needs` needs `package`, installed but failing to import with `e`, and how to reinstall it."""
    first = (str(e).strip().splitlines() or [""])[0]
    if len(first) > 200:  # a line, not a screenful
        first = first[:200] + "..."
    return (f"{needs} needs {package}, which is installed but fails to import ({type(e).__name__}: {first}); "
            f"reinstall it: pip install --force-reinstall {package}")


def import_optional(module: str, package: str, needs: str, missing: str, error: type[Exception],
                    name: str | None = None):
    """`module`, imported; else `error` raised with one line: `missing` where `package` (imported as `name`, by
    default `module`'s top-level package) is not installed, broken_line's where it is but fails to import.

    Any exception counts: a package's import runs its code, which may raise anything (a protobuf its generated
    code predates raises TypeError, an old numpy an AttributeError); it was a traceback."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - whatever an installed package's import raises, said in one line
        if is_missing(e, name or module.split(".")[0], module):
            raise error(missing) from None
        raise error(broken_line(needs, package, e)) from None
