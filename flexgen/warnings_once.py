"""One warning per distinct message for the life of the process, whatever the warnings filters say.

flexgen's notices about a call (a PyTorch option it ignores, the unfused path, a cache it cannot use) would
otherwise repeat on every step of a training loop."""
from __future__ import annotations

import warnings

_seen: set[str] = set()


def warn_once(text: str, stacklevel: int = 2) -> None:
    """warnings.warn(text) the first time this text comes; `stacklevel` as the caller would pass it to warn."""
    if text in _seen:
        return
    _seen.add(text)
    warnings.warn(text, UserWarning, stacklevel=stacklevel + 1)
