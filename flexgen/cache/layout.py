"""The names flexgen writes in its cache, and how to recognise them (see paths.py for the layout).

Listing and clearing walk only what matches these names, through folder descriptors and without
following links, so a folder or file that flexgen did not write is never read as an entry or removed.
"""
from __future__ import annotations

import os
import re

from .safefs import DIR_FLAGS

SOURCE = "source.cu"
CUBIN = "kernel.cubin"
META = "meta.json"
PTX = "kernel.ptx"
LOG = "compile.log"
LOCKS = ".locks"
FAILED = "failed"
LEGACY_JINJA = ".jinja"  # template bytecode that earlier flexgen versions kept (never read now)

ENTRY_FILES = (SOURCE, CUBIN, META, PTX)
FAILED_FILES = (SOURCE, LOG)

ARCH_NAME = re.compile(r"sm_\d+[a-z]?\Z")
KEY_NAME = re.compile(r"[0-9a-f]{64}\Z")
LOCK_NAME = re.compile(r"[0-9a-f]{64}\.lock\Z")
JINJA_NAME = re.compile(r"__jinja2_[0-9a-f]{40}\.cache\Z")
_TEMP_NAME = re.compile(r"\.(.+)\.[0-9a-f]{16}\.tmp\Z")  # safefs.write_atomic's temporary files


def is_own_file(name: str, known: tuple[str, ...]) -> bool:
    """One of the `known` files, or a temporary file left while writing one of them."""
    temp = _TEMP_NAME.match(name)
    return name in known or (temp is not None and temp.group(1) in known)


def subdirs(fd: int, pattern: re.Pattern) -> list[str]:
    """The names of the folders (not links) in the folder `fd` that match `pattern`, sorted."""
    with os.scandir(fd) as it:
        return sorted(e.name for e in it if e.is_dir(follow_symlinks=False) and pattern.match(e.name))


def open_sub(fd: int, name: str) -> int | None:
    """A descriptor of the folder `name` in `fd` (never through a link); None if it is gone or unreadable."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=fd)
    except OSError:
        return None


def open_root_readonly(root) -> int | None:
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
