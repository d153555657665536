"""Trajectory queries: TorchRL's ``torchrl.data.replay_buffers.query``.

``rb.query(predicate)`` splits what a buffer stores into trajectories and returns those the
predicate keeps, as :class:`Trajectory` views, oldest first. A predicate is written with
:data:`traj` (``(traj.reward.sum() > 100) & (traj.length >= 50)``) or is any callable taking a
:class:`Trajectory` and returning a bool. :func:`iter_trajectories` and
:func:`filter_trajectories` do the same for a TensorDict of transitions ``[T]``.

Where trajectories start and stop is decided by the rule the slice samplers use
(:mod:`functional_rb.adapters.boundaries`): the steps are read in time order; a trajectory
ends where ``trajectory_key``'s id changes (by default the first of ``("collector",
"traj_ids")``, ``"traj_ids"``, ``"episode"`` present), or, with no ids, where an end flag (``("next", "done" | "truncated" | "terminated")``) is True, with
a ``UserWarning``. The newest stored step always ends a trajectory. Once a ring has wrapped,
time starts at the oldest stored row (the one after the last written): the oldest trajectory
may have lost its first steps, and one written across the wrap point is followed through it.
With ``ndim=2`` storages (``[time, env]``) trajectories live in one env column; the result is
grouped by column (row-major over the batch dims), oldest first within each.

Transforms: a predicate sees the values a sample would give (the buffer's transforms
applied). A predicate built from :data:`traj` knows the keys it reads
(:meth:`TrajectoryPredicate.required_keys`): only those entries are read, and only the
transforms whose ``out_keys`` reach them run (with the ``in_keys`` they need; a transform
without ``out_keys`` runs with every one before it). Kept trajectories are then read whole and
given every transform. An opaque callable sees the whole storage, transformed once.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

import torch
from tensordict import TensorClass, TensorDictBase, is_tensor_collection, lazy_stack
from tensordict.utils import unravel_key

from functional_rb.adapters import boundaries

__all__ = [
    "Trajectory",
    "TrajectoryPredicate",
    "traj",
    "iter_trajectories",
    "filter_trajectories",
    "query_buffer",
]

_UNREDUCED = (
    "{what} compares per-step values, so it is ambiguous as a trajectory filter. "
    "Call .any() or .all() to reduce it to one boolean, e.g. "
    "(traj.reward > 1).any()."
)


# ------------------------------------------------------------------------------ Trajectory
class Trajectory(TensorClass["nocast"]):
    """The steps of one trajectory: a tensorclass over ``data``, a TensorDict of batch ``[T]``.

    Attribute access and :meth:`get` read ``data``'s root entries first, then ``("next",
    name)``: ``trajectory.observation`` is the root observation, ``trajectory.reward`` and
    ``trajectory.done`` the post-step ones. Indexing with a key returns that entry; with an
    int, a slice or a tensor, a :class:`Trajectory` of those steps. Trajectories of different
    lengths stack with :func:`tensordict.lazy_stack` (batch ``[N, -1]``).

    Attributes:
      data: TensorDict ``[T]``, the steps in time order.
      length: ``T``. total_reward: the sum of the rewards (a 0-d tensor).
    """

    data: TensorDictBase

    def __post_init__(self) -> None:
        data = self.data
        if self.batch_size or data is None or not data.batch_dims:
            return
        if data.batch_dims != 1:
            raise ValueError(
                f"Trajectory: data must have a single batch dimension (time), got batch_size="
                f"{tuple(data.batch_size)}. Split a [B, T] batch into its trajectories first: "
                "Trajectory(data[b]) per row, or iter_trajectories(data.reshape(-1))."
            )
        self.batch_size = data.batch_size

    @property
    def length(self) -> int:
        """Number of steps ``T``."""
        return int(self.batch_size[0])

    @property
    def total_reward(self) -> torch.Tensor:
        """Sum of the rewards over the trajectory (0-d)."""
        return self.reward.sum()

    def get(self, key, default=None):
        """The entry ``key`` of ``data``, else ``("next", key)`` for a string key, else
        ``default``."""
        value = self.data.get(key, None)
        if value is None and isinstance(key, str):
            value = self.data.get(("next", key), None)
        return default if value is None else value

    def keys(self, *args, **kwargs):
        """``data``'s keys (same arguments as ``TensorDict.keys``)."""
        return self.data.keys(*args, **kwargs)


def _is_key(index) -> bool:
    return isinstance(index, str) or (
        isinstance(index, tuple) and bool(index) and all(isinstance(k, (str, tuple)) for k in index)
    )


def _install(cls) -> None:
    """tensorclass installs its own ``__getattr__``, ``__getitem__`` and ``__repr__`` when the
    class is made; the entry lookup is chained after them here."""
    by_attribute, by_index = cls.__getattr__, cls.__getitem__

    def __getattr__(self, name):
        try:
            return by_attribute(self, name)
        except AttributeError:
            if name.startswith("_"):
                raise
        value = self.get(name)
        if value is None:
            stored = sorted(map(str, self.data.keys(include_nested=True, leaves_only=True)))
            raise AttributeError(
                f"Trajectory has no entry {name!r} in its data (looked up {name!r} and "
                f"{('next', name)!r}); its entries are {stored}. Use trajectory[key] for "
                "other nested keys."
            ) from None
        return value

    def __getitem__(self, index):
        return self.data[index] if _is_key(index) else by_index(self, index)

    def __repr__(self):
        shape = (
            f"length={self.length}"
            if len(self.batch_size) == 1
            else f"batch_size={tuple(self.batch_size)}"
        )
        keys = None if self.data is None else sorted(map(str, self.data.keys()))
        return f"Trajectory({shape}, keys={keys})"

    cls.__getattr__, cls.__getitem__, cls.__repr__ = __getattr__, __getitem__, __repr__


_install(Trajectory)


# ------------------------------------------------------------------------------ predicates
def _union(a, b):
    return None if a is None or b is None else a | b


class TrajectoryPredicate:
    """A bool-valued test of a :class:`Trajectory`; combine with ``&``, ``|`` and ``~``.

    Made by comparing :data:`traj` expressions (``traj.length >= 50``), or from any callable:
    ``TrajectoryPredicate(fn, description, keys)`` with ``keys`` the data keys ``fn`` reads
    (None: unknown, so a query reads and transforms everything).
    """

    def __init__(
        self,
        fn: Callable[[Trajectory], bool],
        description: str = "predicate",
        keys: frozenset | None = None,
    ) -> None:
        self._fn, self._description, self._keys = fn, description, keys

    def required_keys(self) -> frozenset | None:
        """The data keys the predicate reads (root or ``("next", key)`` spellings as written),
        or None when unknown."""
        return self._keys

    def __call__(self, trajectory: Trajectory) -> bool:
        return bool(self._fn(trajectory))

    def __and__(self, other) -> TrajectoryPredicate:
        other = _as_predicate(other, "&")
        return TrajectoryPredicate(
            lambda t: self(t) and other(t),
            f"({self._description} & {other._description})",
            _union(self._keys, other._keys),
        )

    def __or__(self, other) -> TrajectoryPredicate:
        other = _as_predicate(other, "|")
        return TrajectoryPredicate(
            lambda t: self(t) or other(t),
            f"({self._description} | {other._description})",
            _union(self._keys, other._keys),
        )

    def __invert__(self) -> TrajectoryPredicate:
        return TrajectoryPredicate(lambda t: not self(t), f"~{self._description}", self._keys)

    def __repr__(self) -> str:
        return f"TrajectoryPredicate({self._description})"


def _as_predicate(other, op: str) -> TrajectoryPredicate:
    if isinstance(other, TrajectoryPredicate):
        return other
    if isinstance(other, _Stepwise):
        raise TypeError(f"TrajectoryPredicate {op}: " + _UNREDUCED.format(what=other._text))
    if callable(other):
        return TrajectoryPredicate(other, getattr(other, "__name__", repr(other)))
    raise TypeError(
        f"TrajectoryPredicate {op}: expected a predicate (a comparison of traj "
        f"expressions, or a callable taking a Trajectory), got "
        f"{type(other).__name__}."
    )


class _Stepwise:
    """A per-step comparison (``traj.reward > 1``): a predicate once reduced."""

    def __init__(self, fn, text: str, keys: frozenset) -> None:
        self._fn, self._text, self._keys = fn, text, keys

    def any(self) -> TrajectoryPredicate:
        """True when the comparison holds at some step."""
        return TrajectoryPredicate(
            lambda t: bool(self._fn(t).any()), f"{self._text}.any()", self._keys
        )

    def all(self) -> TrajectoryPredicate:
        """True when the comparison holds at every step."""
        return TrajectoryPredicate(
            lambda t: bool(self._fn(t).all()), f"{self._text}.all()", self._keys
        )

    def _refuse(self, *args):
        raise TypeError(_UNREDUCED.format(what=self._text))

    __call__ = __bool__ = __and__ = __or__ = __invert__ = _refuse

    def __repr__(self) -> str:
        return f"_Stepwise({self._text})"


def _comparison(op, symbol: str):
    def compare(self, other):
        return self._compare(op, symbol, other)

    compare.__name__ = f"__{op.__name__}__"
    return compare


class _Value:
    """A value computed from a trajectory: per step (a field, ``traj.reward``) or one per
    trajectory (``traj.length``, ``traj.reward.sum()``). Comparing it gives a predicate (per
    step: a :class:`_Stepwise` to reduce with ``.any()`` / ``.all()``)."""

    def __init__(self, fn, text: str, keys: frozenset, per_step: bool) -> None:
        self._fn, self._text, self._keys, self._per_step = fn, text, keys, per_step

    def _compare(self, op, symbol: str, other):
        text = f"({self._text} {symbol} {other!r})"

        def fn(t):
            return op(self._fn(t), other)

        if self._per_step:
            return _Stepwise(fn, text, self._keys)
        return TrajectoryPredicate(fn, text, self._keys)

    __gt__ = _comparison(operator.gt, ">")
    __ge__ = _comparison(operator.ge, ">=")
    __lt__ = _comparison(operator.lt, "<")
    __le__ = _comparison(operator.le, "<=")
    __eq__ = _comparison(operator.eq, "==")
    __ne__ = _comparison(operator.ne, "!=")
    __hash__ = None

    def _reduce(self, name: str, fn) -> _Value:
        if not self._per_step:  # AttributeError as in TorchRL, whose scalars have no reductions
            raise AttributeError(
                f"{self._text}.{name}(): {self._text} is already one value "
                f"per trajectory; reduce a per-step field instead, e.g. "
                f"traj.reward.{name}()."
            )
        return _Value(lambda t: fn(self._fn(t)), f"{self._text}.{name}()", self._keys, False)

    def sum(self) -> _Value:
        """Sum over the steps."""
        return self._reduce("sum", torch.sum)

    def mean(self) -> _Value:
        """Mean over the steps (as float)."""
        return self._reduce("mean", lambda x: x.float().mean())

    def max(self) -> _Value:
        """Maximum over the steps."""
        return self._reduce("max", torch.max)

    def min(self) -> _Value:
        """Minimum over the steps."""
        return self._reduce("min", torch.min)

    def first(self) -> _Value:
        """The value at the first step."""
        return self._reduce("first", lambda x: x[0])

    def last(self) -> _Value:
        """The value at the last step."""
        return self._reduce("last", lambda x: x[-1])

    def __repr__(self) -> str:
        return f"_Value({self._text})"


def _field(key, text: str) -> _Value:
    def read(trajectory):
        value = trajectory.get(key)
        if value is None:
            raise KeyError(
                f"{text}: the trajectory has no entry {key!r} (looked up the root and "
                f"('next', ...)). Name a stored key, or pass trajectory_key / "
                f"transforms that produce it."
            )
        return value

    return _Value(read, text, frozenset({unravel_key(key)}), per_step=True)


class _TrajectoryRef:
    """Where predicates start: ``traj.<name>`` (or ``traj[nested_key]``) is a per-step field
    read as :meth:`Trajectory.get` reads it; ``traj.length`` and ``traj.total_reward`` are one
    value per trajectory. Fields reduce with ``.sum()``, ``.mean()``, ``.max()``, ``.min()``,
    ``.first()``, ``.last()``; comparisons give predicates (per-step ones need ``.any()`` or
    ``.all()``).

    Examples: ``(traj.reward.sum() > 100) & (traj.length >= 50)``,
    ``(traj.reward > 10).any() | (traj.step_count.last() > 500)``,
    ``traj[("collector", "mask")].all()``.
    """

    @property
    def length(self) -> _Value:
        return _Value(lambda t: t.length, "traj.length", frozenset(), per_step=False)

    @property
    def total_reward(self) -> _Value:
        return _Value(
            lambda t: t.total_reward, "traj.total_reward", frozenset({"reward"}), per_step=False
        )

    def __getattr__(self, name: str) -> _Value:
        if name.startswith("_"):
            raise AttributeError(name)
        return _field(name, f"traj.{name}")

    def __getitem__(self, key) -> _Value:
        return _field(key, f"traj[{key!r}]")

    def __repr__(self) -> str:
        return "traj"


traj = _TrajectoryRef()


@runtime_checkable
class _ReadsKeys(Protocol):
    """A predicate that says which data keys it reads (None: unknown)."""

    def required_keys(self) -> frozenset | None: ...


def _check_predicate(predicate, where: str) -> None:
    if isinstance(predicate, _Stepwise):
        raise TypeError(f"{where}: " + _UNREDUCED.format(what=predicate._text))
    if predicate is not None and not callable(predicate):
        raise TypeError(
            f"{where}: predicate must be callable (a traj comparison or a function "
            f"of a Trajectory returning a bool), got {type(predicate).__name__}."
        )


# ------------------------------------------------------------------------------ transforms
def _parts(key) -> tuple:
    key = unravel_key(key)
    return key if isinstance(key, tuple) else (key,)


def _overlap(a, b) -> bool:
    a, b = _parts(a), _parts(b)
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def _needed_transforms(transforms: list, keys: set) -> tuple[list, set | None]:
    """The transforms a predicate reading ``keys`` needs, in order, and the stored keys they
    and it read (None: all). From the last transform back: one whose ``out_keys`` reach a
    needed key is kept and its ``in_keys`` become needed; one without ``out_keys`` may write
    anything, so it and all before it are kept and every key is read."""
    kept, keys = [], set(keys)
    for i in range(len(transforms) - 1, -1, -1):
        t = transforms[i]
        out_keys = getattr(t, "out_keys", None) or []  # TorchRL Transforms and plain callables
        if not out_keys:
            return list(transforms[: i + 1]) + kept[::-1], None
        if any(_overlap(o, k) for o in out_keys for k in keys):
            kept.append(t)
            keys.update(unravel_key(k) for k in (getattr(t, "in_keys", None) or []))
    return kept[::-1], keys


def _transformed(data, transforms: list):
    if not transforms:
        return data
    with data.unlock_():
        for t in transforms:
            data = t(data)
    return data


def _predicate_view(source, transforms: list, predicate) -> tuple:
    """``(view, whole)``: what ``predicate`` reads (the needed entries, the needed transforms
    applied) and whether that is all of it, every transform applied."""
    keys = predicate.required_keys() if isinstance(predicate, _ReadsKeys) else None
    run, fetch = transforms, None
    if keys is not None:
        wanted = set()
        for k in map(unravel_key, keys):
            wanted.update((k, ("next", k)) if isinstance(k, str) else (k,))
        run, fetch = _needed_transforms(transforms, wanted)
    view = source if fetch is None else source.select(*fetch, strict=False)
    if run and view is source:  # transforms set entries: not on the storage's own TensorDict
        view = source.copy()
    return _transformed(view, run), fetch is None and len(run) == len(transforms)


# ------------------------------------------------------------------------------ queries
def _query(
    source, transforms: list, predicate, trajectory_key, oldest: int, where: str
) -> list[Trajectory]:
    _check_predicate(predicate, where)
    if not source.batch_dims:
        raise ValueError(
            f"{where}: expected stored steps with at least one batch dimension "
            f"(time), got batch_size={tuple(source.batch_size)}."
        )
    if source.batch_size[0] == 0:
        return []
    found = boundaries.spans(source, trajectory_key, oldest, where)
    view, whole = (
        (None, False) if predicate is None else _predicate_view(source, transforms, predicate)
    )
    out = []
    for coords, first, length in found:
        if predicate is not None:
            seen = Trajectory(_read_steps(view, coords, first, length))
            if not predicate(seen):
                continue
            if whole:
                out.append(seen)
                continue
        steps = _read_steps(source, coords, first, length)
        out.append(Trajectory(_transformed(steps, transforms)))
    return out


def _stored_tensordict(source, where: str):
    """A storage's content as one TensorDict ``[T, *B]`` (list storages: stacked lazily)."""
    if isinstance(source, (list, tuple)):
        if not all(is_tensor_collection(item) for item in source):
            raise TypeError(
                f"{where} requires a tensordict-backed storage: the list storage holds "
                f"{type(next(i for i in source if not is_tensor_collection(i))).__name__} "
                "items. Store TensorDicts (one transition each) to query trajectories."
            )
        if any(item.batch_dims for item in source):
            raise TypeError(
                f"{where} on a list storage expects single-transition (scalar) "
                "TensorDict items, got batched ones. Extend with "
                "list(data.unbind(0)), or use a LazyTensorStorage."
            )
        return lazy_stack(list(source))
    if not is_tensor_collection(source):
        raise TypeError(
            f"{where} requires a tensordict-backed storage, got content of type "
            f"{type(source).__name__}. Store TensorDicts to query trajectories."
        )
    return source


def query_buffer(rb, predicate=None, *, trajectory_key=None) -> list[Trajectory]:
    """``rb.query(predicate=None, *, trajectory_key=None)`` (TorchRL's ``ReplayBuffer.query``):
    the stored trajectories ``predicate`` keeps (all when None) as :class:`Trajectory` views,
    oldest first (``ndim=2``: by env column), each with every transform of ``rb`` applied.
    Read under ``rb.lock``; see the module docstring."""
    storage = rb.storage
    with rb.lock:
        if not len(storage):
            return []
        source = storage[:]
        rows = storage.max_size_along_dim0()
        oldest = storage.next_row() if storage.len_along_dim0 >= rows else 0
    if isinstance(source, (list, tuple)) and not source:
        return []
    source = _stored_tensordict(source, "ReplayBuffer.query")
    return _query(
        source, list(rb.transform), predicate, trajectory_key, oldest, "ReplayBuffer.query"
    )


def iter_trajectories(data: TensorDictBase, trajectory_key=None) -> Iterator[Trajectory]:
    """The trajectories of ``data``, transitions ``[T]`` in time order, as :class:`Trajectory`
    views, oldest first. Boundaries as described in the module docstring (``trajectory_key``,
    else ids found by name, else end flags with a ``UserWarning``)."""
    where = "iter_trajectories"
    if not isinstance(data, TensorDictBase):
        raise TypeError(
            f"{where} expects a TensorDictBase of transitions [T], got "
            f"{type(data).__name__}. Trajectory queries require tensordict data: "
            "TensorDict({'observation': x, ...}, batch_size=[T])."
        )
    if data.batch_dims != 1:
        raise ValueError(
            f"{where} expects data with a single batch dimension (flat "
            f"transitions), got batch_size={tuple(data.batch_size)}. Pass "
            "data.reshape(-1) for time-major flat data, or one row at a time."
        )
    if data.batch_size[0] == 0:
        return
    for _, first, length in boundaries.spans(data, trajectory_key, 0, where):
        yield Trajectory(data[first : first + length])


def filter_trajectories(
    data: TensorDictBase, predicate=None, *, trajectory_key=None
) -> list[Trajectory]:
    """The trajectories of ``data`` (as :func:`iter_trajectories` finds them) that
    ``predicate`` keeps (all when None), oldest first."""
    _check_predicate(predicate, "filter_trajectories")
    return [t for t in iter_trajectories(data, trajectory_key) if predicate is None or predicate(t)]


def _read_steps(source, coords: tuple, first: int, length: int):
    """The ``length`` steps of column ``coords`` from row ``first`` on, through the wrap."""
    rows = source.batch_size[0]
    if first + length <= rows:  # a view
        return source[(slice(first, first + length), *coords)]
    index = torch.arange(first, first + length, device=source.device) % rows
    return source[(index, *coords)]
