"""Every metric family the product counts is declared, with the label values it counts.

Read from the code itself: each call that counts (`.count(F, …)`, `.observe(F, v, …)`,
`counter_buffer.add(F, …)`) whose family resolves to a `Family` must name a declared one,
and its literal label values must be in the family's vocabulary; every declared counter and
histogram must be counted somewhere. Label values computed at run time (a deadline's kind,
a run's terminal status) are checked where they are computed (tests/unit/jobs/test_metrics.py).
"""

from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass
from pathlib import Path

from iotqueue import metrics
from iotqueue.metrics import GAUGE, Family, family_values

ROOT = Path(__file__).resolve().parents[2]
APPS = ("iotqueue", "devices", "jobs", "triggers", "webhooks")
# The mechanism itself passes families through as arguments.
MECHANISM = "iotqueue.metrics"
# Method name -> how many arguments come before the label values.
COUNTING = {"count": 1, "add": 1, "observe": 2}


@dataclass(frozen=True)
class Counted:
    where: str
    family: Family | None
    labels: tuple[str, ...]
    inline: bool = False


def _modules() -> list[tuple[str, ast.Module]]:
    found = []
    for app in APPS:
        for path in sorted((ROOT / app).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if name != MECHANISM:
                found.append((name, ast.parse(path.read_text(encoding="utf-8"))))
    return found


def _resolve(module, node: ast.expr) -> object:
    """What a Name or dotted Attribute names in `module`'s namespace (None: a local)."""
    if isinstance(node, ast.Name):
        return getattr(module, node.id, None)
    if isinstance(node, ast.Attribute):
        owner = _resolve(module, node.value)
        return getattr(owner, node.attr, None) if owner is not None else None
    return None


def _counting_calls() -> list[Counted]:
    counted = []
    for name, tree in _modules():
        module = None
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            skip = COUNTING.get(node.func.attr)
            if skip is None or not node.args:
                continue
            first, where = node.args[0], f"{name}:{node.lineno}"
            if isinstance(first, ast.Call) and getattr(first.func, "id", None) == "Family":
                counted.append(Counted(where, None, (), inline=True))
                continue
            if not isinstance(first, ast.Name | ast.Attribute):
                continue
            module = module or importlib.import_module(name)
            family = _resolve(module, first)
            if isinstance(family, Family):
                labels = tuple(
                    arg.value
                    for arg in node.args[skip:]
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                )
                counted.append(Counted(where, family, labels))
    return counted


def test_every_counted_family_is_declared_with_the_values_counted():
    # given every place the product counts a metric
    counted = _counting_calls()

    # then none counts a family built on the spot, or one that no app declared
    assert not [c.where for c in counted if c.inline]
    declared = {family.name: family for family in metrics.families()}
    undeclared = [(c.where, c.family.name) for c in counted if declared.get(c.family.name) != c.family]
    assert not undeclared, f"counted but not declared: {undeclared}"

    # and every literal label value counted is in its family's vocabulary
    strays = [
        (c.where, c.family.name, value)
        for c in counted
        for value in c.labels
        if family_values(c.family) and value not in family_values(c.family)
    ]
    assert not strays, f"label values counted but not declared: {strays}"


def test_every_declared_counter_and_histogram_is_counted_somewhere():
    # a declared family nobody counts stays at zero forever: a name left behind
    counted = {c.family.name for c in _counting_calls() if c.family is not None}
    exported = {family.name for family in metrics.families() if family.kind != GAUGE}

    assert exported - counted == set()
    assert counted, "the scan found no counting call: it is looking in the wrong place"
