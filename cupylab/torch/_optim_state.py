"""The ``state`` mapping of :mod:`cupylab.torch.optim`'s optimizers: torch's
``defaultdict(dict)`` whose changes are counted.

A step launches on a table of addresses cached per param group (params, gradients, the state
tensors, master copies). The params and gradients are checked at every step by their data
pointers; the state tensors are not (two more reads per parameter a step). Instead every
change to the mapping or to a parameter's state dict — a state replaced, deleted or cleared,
``opt.state[p] = {...}``, ``opt.state[p]["exp_avg"] = t`` — bumps a counter that the step
compares in O(1), and any change makes every group's table be built again: a table never
points at a state tensor the optimizer no longer holds (whose memory may have been freed).

What it cannot see: a state tensor whose storage is swapped in place (``t.data = ...``,
``t.set_(...)``); in-place updates (``t.zero_()``, ``t.copy_(...)``) need nothing.
A mapping assigned to ``opt.state`` (torch's ``load_state_dict`` does so) is taken over at the
next step: copied into a counted mapping, with each parameter's dict copied likewise.
"""
from __future__ import annotations

import functools
from collections import defaultdict

__all__ = ["Version", "ParamState", "State", "tracked"]


class Version:
    """The change counter one optimizer's mapping and its parameters' dicts share."""

    __slots__ = ("n",)

    def __init__(self, n=0):
        self.n = n

    def __reduce__(self):
        return (Version, (self.n,))


def _counted(name):
    base = getattr(dict, name)

    def method(self, *args, **kwargs):
        self._v.n += 1
        return base(self, *args, **kwargs)

    method.__name__ = name
    return method


class ParamState(dict):
    """One parameter's state dict; its changes count in the optimizer's :class:`Version`."""

    __slots__ = ("_v",)

    def __init__(self, version, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._v = version

    def __reduce__(self):  # the counter first: pickle would set the items before the slots
        return (ParamState, (self._v, dict(self)))

    __setitem__ = _counted("__setitem__")
    __delitem__ = _counted("__delitem__")
    clear = _counted("clear")
    pop = _counted("pop")
    popitem = _counted("popitem")
    setdefault = _counted("setdefault")
    update = _counted("update")
    __ior__ = _counted("__ior__")


class State(defaultdict):
    """An optimizer's ``state``: a ``defaultdict`` of :class:`ParamState` whose changes count.
    Looking up a parameter with no state adds an empty dict without counting (nothing a table
    points at changes)."""

    def __init__(self, version, items=()):
        super().__init__(functools.partial(ParamState, version))
        self._v = version
        for k, v in items:
            dict.__setitem__(self, k, _param_state(version, v))

    def __reduce__(self):
        return (State, (self._v, list(self.items())))

    def copy(self):
        """A shallow copy: the same per-parameter dicts, and the same counter, so that the
        copy assigned back to ``optimizer.state`` still counts every change (its own
        mapping's changes count too: at worst a table built again). defaultdict's copy,
        ``copy.copy`` and ``|`` would call ``State(default_factory, mapping)``."""
        new = State(self._v)
        for k, v in self.items():
            dict.__setitem__(new, k, v)
        return new

    __copy__ = copy

    def __or__(self, other):
        if not isinstance(other, dict):
            return NotImplemented
        new = self.copy()
        new.update(other)
        return new

    def __ror__(self, other):
        if not isinstance(other, dict):
            return NotImplemented
        new = State(self._v, other.items())
        for k, v in self.items():
            dict.__setitem__(new, k, v)
        return new

    def __missing__(self, key):
        v = self.default_factory()
        dict.__setitem__(self, key, v)
        return v

    def __setitem__(self, key, value):
        self._v.n += 1
        dict.__setitem__(self, key, _param_state(self._v, value))

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args, **kwargs):
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def __ior__(self, other):
        self.update(other)
        return self

    __delitem__ = _counted("__delitem__")
    clear = _counted("clear")
    pop = _counted("pop")
    popitem = _counted("popitem")


def _param_state(version, value):
    if type(value) is ParamState and value._v is version:
        return value
    return ParamState(version, value) if isinstance(value, dict) else value


def tracked(state):
    """``state`` itself when it is a counted :class:`State`, else a counted copy of it (the
    parameters' dicts copied too)."""
    if type(state) is State:
        return state
    return State(Version(), state.items())
