"""`train.freeze`'s patterns (parallel/freeze.py applies them): a comma-separated list over the model's module and
parameter names, fnmatch-style, a pattern matching a name or any dotted suffix of it. Here, below both the
config's checks and the engine, so that the checks can ask what a value freezes without importing the engine.
"""
from __future__ import annotations

from fnmatch import fnmatchcase

from .errors import ConfigError


def patterns(spec: str) -> list[str]:
    """The patterns of a `train.freeze` value ("" : none); an empty item ("a,,b") is refused."""
    if not spec.strip():
        return []
    items = [p.strip() for p in spec.split(",")]
    if any(not p for p in items):
        raise ConfigError(f"train.freeze = {spec!r} has an empty pattern: patterns are separated by single commas")
    return items


def matches(pattern: str, name: str) -> bool:
    """Whether `pattern` matches dotted `name` or one of its dotted suffixes (the module docstring's rule)."""
    parts = name.split(".")
    return any(fnmatchcase(".".join(parts[i:]), pattern) for i in range(len(parts)))


def freezes(pattern: str, name: str) -> bool:
    """Whether `pattern` freezes the parameter `name`: it matches the name or one of the modules holding it."""
    parts = name.split(".")
    return any(matches(pattern, ".".join(parts[:i])) for i in range(1, len(parts) + 1))


def frozen_by_pattern(spec: str, names) -> dict[str, set[str]]:
    """Each pattern of `spec` with the parameter names (of `names`, a model's in its order) it freezes. A
    pattern that freezes none (it matches no name, or only modules without parameters) is a ConfigError
    naming it and the modules there are, as the engine and the planner both refuse it."""
    names = list(names)
    frozen = {p: {n for n in names if freezes(p, n)} for p in patterns(spec)}
    unmatched = [p for p, held in frozen.items() if not held]
    if unmatched:
        raise ConfigError(f"train.freeze: {', '.join(map(repr, unmatched))} match{'es' if len(unmatched) == 1 else ''}"
                          f" no parameter of this model (its modules: {module_names(names)}; layers.N is block N)")
    return frozen


def module_names(names) -> str:
    """The modules' own names (each a pattern matching every module of that name) in the model's order, those
    that hold parameters: read off the parameters' dotted names."""
    seen = []
    for name in names:
        for part in name.split(".")[:-1]:
            if not part.isdigit() and part not in seen:
                seen.append(part)
    return ", ".join(seen)
