"""kernels.LookupGuard: the recorded dictionary reads a decode step repeats instead of walking the modules."""

from __future__ import annotations

import collections

import pytest

MISSING = object()


@pytest.fixture
def guard_of(kernels):
    return lambda reads, empty=(): kernels.LookupGuard(list(reads), list(empty), MISSING)


def test_holds_while_every_read_gives_the_same_object(guard_of):
    value, table = object(), {"a": None}
    d = {"x": value, "n": None}
    hooks = collections.OrderedDict()
    guard = guard_of([(d, "x", value), (d, "n", None), (d, "gone", MISSING), (table, "a", None)], [hooks])
    assert guard.holds()
    d["x"] = object()  # an equal-looking replacement is still another object
    assert not guard.holds()
    d["x"] = value
    assert guard.holds()
    d["gone"] = 1  # a key that was missing appears
    assert not guard.holds()
    del d["gone"]
    del d["n"]  # a key that held None disappears
    assert not guard.holds()
    d["n"] = None
    hooks[1] = print  # a dict that had to stay empty (a hook table) gains an entry
    assert not guard.holds()
    hooks.clear()
    assert guard.holds()


def test_refuses_what_is_not_a_dict(guard_of):
    with pytest.raises(RuntimeError, match="dict"):
        guard_of([([], "x", None)])
    with pytest.raises(RuntimeError, match="dicts"):
        guard_of([], [[]])
