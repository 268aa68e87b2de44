"""One warning per distinct message for the life of the process, whatever the warnings filters say.

flexgen's notices about a call (a PyTorch option it ignores, the unfused path, a cache it cannot use) would
otherwise repeat on every step of a training loop."""
from __future__ import annotations

import warnings

_seen: set[str] = set()
# Keys of the warnings PyTorch's FlexAttention also shows once (its `_WARNINGS_SHOWN`, which ported tests clear to
# see a warning again): flexgen's own set, exported under that name.
_WARNINGS_SHOWN: set[str] = set()


def warn_once(text: str, stacklevel: int = 2) -> None:
    """warnings.warn(text) the first time this text comes; `stacklevel` as the caller would pass it to warn."""
    _warn_first(_seen, text, text, UserWarning, stacklevel)


def warn_once_key(key: str, text: str, category: type[Warning] = UserWarning, stacklevel: int = 2) -> None:
    """warnings.warn(text, category) unless `key` is in _WARNINGS_SHOWN; then it is."""
    _warn_first(_WARNINGS_SHOWN, key, text, category, stacklevel)


def _warn_first(seen: set[str], key: str, text: str, category: type[Warning], stacklevel: int) -> None:
    if key in seen:
        return
    seen.add(key)
    warnings.warn(text, category, stacklevel=stacklevel + 2)  # (+2: this function and its caller)
