"""File access inside the kernel cache: whose files flexgen trusts, and no symbolic links.

Security model. The cache holds machine code that flexgen loads and runs, so whoever can write to
it can run code in every later flexgen process. flexgen creates it private to its owner (folders
0700, files 0600, a CACHEDIR.TAG at the root) and loads an entry only when the cache root, every
folder below it and every file read are owned by the current user (or root) and writable by no one
else. A cache that another user owns (a prebuilt cache shared on a cluster) is read only with
FLEXGEN_CACHE_TRUST_SHARED=1, which trusts its owner; even then nothing that group or others can
write is accepted, and flexgen never writes into a folder it does not own.
Inside the cache no symbolic link is followed: folders and files are opened relative to their
parent's descriptor with O_NOFOLLOW. The checksums in meta.json catch corruption and half-written
entries; they are not a signature (whoever can write meta.json can rewrite them), which is why
ownership and permissions are checked.
"""
from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from pathlib import Path

from . import paths
from .errors import NotAFlexgenCacheError, UnsafeCacheError

DIR_MODE = 0o700
FILE_MODE = 0o600
MARKER = "CACHEDIR.TAG"
_MARKER_TMP = re.compile(r"\.CACHEDIR\.TAG\.[0-9a-f]{16}\.tmp$")  # write_atomic's name for it
MARKER_TEXT = ("Signature: 8a477f597d28d172789f06886806bc55\n"
               "# This folder is a flexgen kernel cache, created by flexgen.\n"
               "# For information about cache directory tags see https://bford.info/cachedir/\n")
VERSION_NAME = re.compile(r"\d+\.\d+[0-9A-Za-z.+-]*\Z")  # the folders a flexgen version writes in the root

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a planted FIFO must not hang
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def current_uid() -> int:
    return os.geteuid()


def check(st: os.stat_result, path: Path, write: bool = False) -> None:
    """Raise UnsafeCacheError unless `st` (of `path`) may be trusted: owned by this user or root
    (any owner for reading with FLEXGEN_CACHE_TRUST_SHARED=1) and writable by no one else."""
    if st.st_mode & 0o022:
        raise UnsafeCacheError(f"{path} can be written by other users (mode {stat.filemode(st.st_mode)}); "
                               f"flexgen does not load code that others can change (run: chmod go-w {path})")
    if st.st_uid not in (current_uid(), 0):
        if write:
            raise UnsafeCacheError(f"{path} belongs to another user (uid {st.st_uid}); flexgen writes only into "
                                   "a cache it owns")
        if not paths.trust_shared():
            raise UnsafeCacheError(f"{path} belongs to another user (uid {st.st_uid}); to load kernels from a cache "
                                   "that user provides, set FLEXGEN_CACHE_TRUST_SHARED=1")


def _link_error(parent_fd: int, name: str, path: Path, err: OSError) -> OSError:
    """The error for a failed O_NOFOLLOW open: UnsafeCacheError for a symbolic link, else `err`."""
    if err.errno in (errno.ELOOP, errno.ENOTDIR):
        try:
            if stat.S_ISLNK(os.lstat(name, dir_fd=parent_fd).st_mode):
                return UnsafeCacheError(f"{path} is a symbolic link; flexgen follows no links inside its cache")
        except OSError:
            pass
    return err


def open_dir(parent_fd: int, name: str, path: Path, create: bool = False, replace: bool = False) -> int:
    """A descriptor of the folder `name` in `parent_fd`, checked with `check` (for writing if `create`).
    `create` makes it (0700) when missing; `replace` also removes a file or link found in its place."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        if not create:
            raise
        fd = _make_dir(parent_fd, name)
    except PermissionError as e:
        raise PermissionError(e.errno, e.strerror, str(path)) from None  # name the folder, not just `name`
    except OSError as e:
        if not (replace and e.errno in (errno.ELOOP, errno.ENOTDIR)):
            raise _link_error(parent_fd, name, path, e) from None
        os.unlink(name, dir_fd=parent_fd)  # a file or link where an entry folder belongs: rebuilt below
        fd = _make_dir(parent_fd, name)
    try:
        check(os.fstat(fd), path, write=create)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make_dir(parent_fd: int, name: str) -> int:
    try:
        os.mkdir(name, DIR_MODE, dir_fd=parent_fd)
    except FileExistsError:
        pass  # made by another process meanwhile
    return os.open(name, DIR_FLAGS, dir_fd=parent_fd)


def read_file(dir_fd: int, name: str, path: Path, trusted: bool = True) -> bytes:
    """The bytes of a regular file, opened without following links; checked with `check` if `trusted`."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        raise _link_error(dir_fd, name, path, e) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        if trusted:
            check(st, path)
        return f.read()


def write_atomic(dir_fd: int, name: str, data: bytes | str) -> None:
    """Write a private (0600) temporary file next to `name`, then rename it over `name`: readers see
    the old or the new file, never half of one. Whatever else stands at `name` is removed first."""
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, _CREATE_FLAGS, FILE_MODE, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        try:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except IsADirectoryError:
            remove_tree(dir_fd, name)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise


def remove_tree(parent_fd: int, name: str) -> None:
    """Remove a folder and everything in it, following no links (only for a folder where a file belongs)."""
    fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    try:
        with os.scandir(fd) as it:
            children = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for child, is_dir in children:
            if is_dir:
                remove_tree(fd, child)
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


# ---------------------------------------------------------------- the root and the folders below it


def is_marked(root_fd: int) -> bool:
    """True if the root holds the CACHEDIR.TAG that flexgen writes when it creates its cache."""
    try:
        text = read_file(root_fd, MARKER, Path(MARKER), trusted=False)
    except OSError:
        return False
    return text.decode(errors="replace") == MARKER_TEXT


def _foreign_names(root_fd: int) -> list[str]:
    """What in the root flexgen did not write: anything but version folders and the marker (a new root
    being claimed by another thread or process at once shows its marker or the marker's temporary file)."""
    def ours(e) -> bool:
        if e.is_dir(follow_symlinks=False):
            return bool(VERSION_NAME.match(e.name))
        return bool(_MARKER_TMP.match(e.name)) or (e.name == MARKER and is_marked(root_fd))

    with os.scandir(root_fd) as it:
        return [e.name for e in it if not ours(e)]


def looks_like_cache(root_fd: int) -> bool:
    """Marked by flexgen, or (a cache of an older flexgen) holding nothing but flexgen version folders."""
    if is_marked(root_fd):
        return True
    with os.scandir(root_fd) as it:
        names = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    return bool(names) and all(is_dir and VERSION_NAME.match(n) for n, is_dir in names)


def open_root(create: bool = False) -> int:
    """A descriptor of the cache root, checked. With `create`, a missing root is made (0700) and
    marked, and a root that holds anything but a flexgen cache is refused (NotAFlexgenCacheError)."""
    root = paths.cache_root()
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC  # the root itself may be a link the user chose
    try:
        fd = os.open(root, flags)
    except FileNotFoundError:
        if not create:
            raise
        root.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(root, DIR_MODE)
        except FileExistsError:
            pass
        fd = os.open(root, flags)
    try:
        if create and not is_marked(fd):
            _claim(fd, root)
        else:
            try:
                check(os.fstat(fd), root, write=create)
            except UnsafeCacheError:
                if not create and is_empty(fd):  # nothing to load yet; the first write claims it
                    raise FileNotFoundError(errno.ENOENT, "empty cache folder", str(root)) from None
                raise
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_empty(fd: int) -> bool:
    with os.scandir(fd) as it:
        return next(it, None) is None


def _claim(fd: int, root: Path) -> None:
    """Mark an unmarked root as flexgen's cache, if it is empty or holds only flexgen's own folders."""
    if not is_marked(fd):
        if _foreign_names(fd):
            raise NotAFlexgenCacheError(
                f"the cache folder {root} (FLEXGEN_CACHE_DIR) holds files that flexgen did not write, and no "
                f"{MARKER} from flexgen; flexgen keeps kernels only in a folder it created. "
                "Point FLEXGEN_CACHE_DIR at a new or empty folder.")
        if os.fstat(fd).st_uid == current_uid():
            os.fchmod(fd, DIR_MODE)  # an empty folder the user made becomes private like one flexgen makes
    check(os.fstat(fd), root, write=True)
    write_atomic(fd, MARKER, MARKER_TEXT)


def open_dirs(parts: tuple[str, ...], create: bool = False, replace_leaf: bool = False) -> int:
    """A descriptor of <root>/<parts...>, every folder on the way checked and none a link.
    `create` makes missing folders (and the root, marked); `replace_leaf`: see `open_dir`."""
    fd = open_root(create)
    path = paths.cache_root()
    try:
        for i, name in enumerate(parts):
            path = path / name
            child = open_dir(fd, name, path, create, replace=replace_leaf and i == len(parts) - 1)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_path(folder: Path, create: bool = False) -> int:
    """A descriptor of `folder`: through `open_dirs` when it lies in the cache, else made as it is."""
    try:
        parts = Path(folder).relative_to(paths.cache_root()).parts
    except ValueError:
        if create:
            os.makedirs(folder, DIR_MODE, exist_ok=True)
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    return open_dirs(parts, create)
