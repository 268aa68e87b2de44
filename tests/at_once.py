"""Run a function in several threads released together, for the tests of what threads share."""
from __future__ import annotations

import threading


def at_once(fn, count: int, tag: str = "") -> list:
    """[fn(0), ..., fn(count - 1)], each called in a thread of its own once all of them have started; the first
    thread's exception, if any, is raised here with its index (and `tag`)."""
    start = threading.Barrier(count)
    results, errors = [None] * count, [None] * count

    def run(i: int) -> None:
        try:
            start.wait()
            results[i] = fn(i)
        except BaseException as e:  # (raised in the caller's thread below)
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, e in enumerate(errors):
        if e is not None:
            raise AssertionError(f"thread {i} of {count}{tag}: {e!r}") from e
    return results
