"""The adapters' error rule, and the helpers that implement it.

An adapter fails as TorchRL's class of the same name fails, then says how to fix it:

1. **TorchRL's exception type.** Code written against TorchRL catches what it caught there
   (``RuntimeError`` for an empty storage, ``ValueError`` for a bad argument value,
   ``TypeError`` for a wrong type, ``NotImplementedError`` for what a class does not do).
2. **TorchRL's phrase first.** Where TorchRL raises, its message opens ours, word for word, so
   a ``pytest.raises(..., match=<TorchRL's phrase>)`` written for TorchRL matches ours.
3. **Then our fix.** What to pass or call instead; for a message of our own, the component
   that raised (``"TensorStorage: ..."``) and the value received.

Where a check has a TorchRL counterpart and we add a fix, raise it through
:func:`torchrl_error`, which keeps the two parts apart: ``phrase`` is TorchRL's message,
character for character (tests match it with ``pytest.raises(..., match=...)``); ``fix`` is
ours, after a space; ``owner`` prefixes ``"<owner>: "`` where our message names the component::

    raise torchrl_error(RuntimeError, "batch_size not specified.",
                        "Configure it on the replay buffer or pass it to can_sample().")
    # RuntimeError: batch_size not specified. Configure it on the replay buffer or pass it
    # to can_sample().

A check that raises TorchRL's message with nothing added raises it directly (e.g.
``RuntimeError(EMPTY_STORAGE_ERROR)``); a check TorchRL does not make raises our own message,
chex-style: ``"<component>.<method>: <argument> must be <expected>, got <received>. <fix>"``.

:func:`not_an_adapter` is the one message for a component of the wrong class (most often
TorchRL's own class handed to an adapter): ``"<owner>: <what> must be a functional_rb.adapters
<kind>, got <module>.<Class>."`` then the fix, which for one of TorchRL's classes names the
adapters' class of the same name.

:func:`entry` reads a key the user named (a ``traj_key``, a ``done_key``, ...) from a
TensorDict: ``TensorDict.get(key)`` returns None for a missing key, which would surface later as
``'NoneType' object is not subscriptable``; ``entry`` raises a ``KeyError`` naming the argument,
the key, the entries the data has, and the fix.
"""

from __future__ import annotations

import sys

__all__ = [
    "torchrl_error",
    "not_an_adapter",
    "is_torchrl",
    "counterpart",
    "entry",
    "MissingEntryError",
]


def torchrl_error(
    exc_type: type, phrase: str, fix: str = "", *, owner: str | None = None
) -> Exception:
    """``exc_type("<owner>: <phrase> <fix>")``: TorchRL's exception type and phrase first, then
    the fix (``owner`` names the component raising, when the phrase does not)."""
    message = phrase if not fix else f"{phrase} {fix}"
    return exc_type(message if owner is None else f"{owner}: {message}")


def is_torchrl(obj) -> bool:
    """Whether ``obj`` is an instance of one of TorchRL's classes."""
    return type(obj).__module__.startswith("torchrl")


def counterpart(name: str):
    """The adapters' public object called ``name`` (TorchRL's name), or None.

    Read from the ``functional_rb.adapters`` package, which Python imports before any of its
    modules and which has finished importing by the time an adapter raises."""
    package = sys.modules.get(__package__)
    if package is None or name not in getattr(package, "__all__", ()):
        return None
    return getattr(package, name)


def exported(suffix: str) -> list:
    """The names ``functional_rb.adapters`` exports that end with ``suffix`` (its order)."""
    package = sys.modules.get(__package__)
    return [n for n in getattr(package, "__all__", ()) if n.endswith(suffix)]


def not_an_adapter(
    owner: str,
    what: str,
    kind: str,
    obj,
    *,
    fix: str | None = None,
    torchrl_fix: str | None = None,
) -> TypeError:
    """``TypeError("<owner>: <what> must be a functional_rb.adapters <kind>, got
    <module>.<Class>. <fix>")``.

    ``fix`` is always given when passed; otherwise ``torchrl_fix`` (a template of ``{name}``,
    the class's name) when ``obj`` is one of TorchRL's classes, prefixed with "This is
    TorchRL's class: "."""
    name = type(obj).__name__
    message = (
        f"{owner}: {what} must be a functional_rb.adapters {kind}, got "
        f"{type(obj).__module__}.{name}."
    )
    if fix is None and torchrl_fix is not None and is_torchrl(obj):
        fix = "This is TorchRL's class: " + torchrl_fix.format(name=name)
    return TypeError(message if not fix else f"{message} {fix}")


class MissingEntryError(KeyError):
    """A ``KeyError`` whose message prints as written (``KeyError`` prints its repr, escaping
    every quote of the keys it names)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def entry(data, key, *, where: str, argument: str, fix: str = ""):
    """``data.get(key)`` of a TensorDict, or :class:`MissingEntryError` (a ``KeyError``) when
    ``data`` has no entry ``key``: ``"<where>: <argument>=<key> is not in the data, whose
    entries are [...]. <fix>"``."""
    value = data.get(key, None)
    if value is not None:
        return value
    entries = sorted(data.keys(include_nested=True, leaves_only=True), key=str)
    shown = ", ".join(map(repr, entries[:20])) + (
        f", ... {len(entries) - 20} more" if len(entries) > 20 else ""
    )
    tail = f" {fix}" if fix else f" Pass {argument}= naming one of them."
    raise MissingEntryError(
        f"{where}: {argument}={key!r} is not in the data, whose entries are [{shown}].{tail}"
    )
