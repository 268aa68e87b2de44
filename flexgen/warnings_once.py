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


# Keys of the warnings PyTorch's FlexAttention also shows once (its `_WARNINGS_SHOWN`, which ported tests clear to
# see a warning again): flexgen's own set, exported under that name.
_WARNINGS_SHOWN: set[str] = set()


def warn_once_key(key: str, text: str, category: type[Warning] = UserWarning, stacklevel: int = 2) -> None:
    """warnings.warn(text, category) unless `key` is in _WARNINGS_SHOWN; then it is."""
    if key in _WARNINGS_SHOWN:
        return
    _WARNINGS_SHOWN.add(key)
    warnings.warn(text, category, stacklevel=stacklevel + 1)
