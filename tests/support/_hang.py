"""A bound for test bodies that could deadlock: run in a thread joined with a timeout, a hang
fails the test instead of stopping the suite."""

import threading

HANG_S = 60  # far above what any bounded body takes (a few seconds on a busy machine)


def within(fn, seconds: float = HANG_S):
    """``fn()`` in a thread; fails (instead of hanging) when it does not return in time."""
    out, err = [], []

    def run():
        try:
            out.append(fn())
        except BaseException as e:  # re-raised in the test's thread
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {seconds} s"
    if err:
        raise err[0]
    return out[0]
