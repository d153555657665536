"""The invariant of write generations (:mod:`functional_rb.generations`), for
:func:`~functional_rb.testing.assert_invariants` (rule ``write generations``)."""

from __future__ import annotations

import numpy as np


def generation_problem(gens, stored: np.ndarray, ring: list | None) -> tuple | None:
    """``(detail, fix)`` when ``gens`` (a host ``GenerationState``) breaks the rule, else None.

    ``stored``: bool ``[capacity]``, which slots hold an item; ``ring``: per row, the flat
    positions of a FIFO ring's items oldest first (None for other writers). The rule: every
    stamp is in ``[0, clock]``, slots that hold no item were never stamped, a ring's stamps
    never decrease from its oldest item to its newest, the dropped-update counter is >= 0.
    """
    slots, clock, dropped = np.asarray(gens.slots), int(gens.clock), int(gens.dropped)
    if clock < 0 or dropped < 0:
        return (
            f"state.generations has clock={clock}, dropped={dropped}; both must be >= 0",
            "The clock wraps within [0, 2**31); the counter only grows.",
        )
    bad = np.flatnonzero((slots < 0) | (slots > clock))
    if bad.size:
        i = int(bad[0])
        return (
            f"state.generations.slots[{i}] is {int(slots[i])}, outside [0, clock={clock}]"
            f" ({bad.size} slots)",
            "A slot is stamped with the clock of the add that wrote it.",
        )
    bad = np.flatnonzero(~stored & (slots != 0))
    if bad.size:
        i = int(bad[0])
        return (
            f"slot {i} holds no item but has generation {int(slots[i])}",
            "Only the slots an add writes are stamped.",
        )
    for row in ring or ():
        stamps = slots[np.asarray(row, np.int64)]
        down = np.flatnonzero(np.diff(stamps) < 0)
        if down.size:
            j = int(down[0])
            return (
                f"along the ring (oldest first) slot {int(row[j])} has generation "
                f"{int(stamps[j])} but the newer slot {int(row[j + 1])} has "
                f"{int(stamps[j + 1])}",
                "Each add stamps its slots with a clock that only "
                "grows: a newer item never has an older stamp.",
            )
    return None
