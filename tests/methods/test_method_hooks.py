"""The cost hooks a method speaks through (issue 37): at most eight, typed (no ``Any``), and every public method
of ``Method`` is either a cost hook, a rule or note for people, or a training step."""

import inspect

from memfit.methods import METHODS
from memfit.methods.base import COST_HOOKS, TRAINING_HOOKS, Method

PEOPLE = ("rules", "plan_note")


def _public(cls) -> set:
    return {n for n, v in vars(cls).items() if inspect.isfunction(v) and not n.startswith("_")}


def test_at_most_eight_cost_hooks_and_nothing_else_unlisted():
    assert len(COST_HOOKS) <= 8
    assert _public(Method) == set(COST_HOOKS) | set(TRAINING_HOOKS) | set(PEOPLE)


def test_cost_hooks_are_typed_in_the_base_and_every_method():
    for cls in {Method, *(type(m) for m in METHODS.values())}:
        for name in COST_HOOKS:
            fn = vars(cls).get(name)
            if fn is None:
                continue
            annotations = inspect.get_annotations(fn)  # strings: ``from __future__ import annotations``
            assert "return" in annotations, (cls.__name__, name)
            untyped = [k for k, v in annotations.items() if "Any" in str(v) or "dict" in str(v)]
            assert not untyped, (cls.__name__, name, untyped)
            assert set(inspect.signature(fn).parameters) - {"self"} <= set(annotations), (cls.__name__, name)
