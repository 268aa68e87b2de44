"""The kernel cache against a hostile or broken filesystem: no template bytecode on disk, `cache clear`
removes only what flexgen wrote, a private cache that loads only from trusted owners and follows no
links, read-only / another user's / full caches, corrupt metadata, hung lock holders, compile logging.

Compiles go through a fake backend (cubin bytes derived from the source, a ptxas-style report), so
neither a GPU nor NVRTC is needed. Other users are real where the tests run as root (chown, seteuid),
and simulated (safefs.current_uid) elsewhere.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import jinja2
import pytest

from flexgen import __version__, cli, warnings_once
from flexgen.cache import errors, jit, paths, store
from flexgen.cache.errors import CompilerFailure
from flexgen.cache.lock import FileLock
from flexgen.cache.nvrtc import CompileOutput
from flexgen.codegen import render as render_module
from flexgen.codegen.api import make_spec

FIXTURES = str(Path(__file__).resolve().parent / "fixtures" / "templates")
NOBODY = 65534  # a real other user where we are root
STRANGER = 12345  # a third user, neither us nor root
IS_ROOT = os.geteuid() == 0


class FakeBackend:
    """A compiler backend for the cache's tests: deterministic cubin bytes and a ptxas report."""

    NAME = "fake"
    compiles: list[str] = []

    @staticmethod
    def version() -> str:
        return "fake-1.0"

    @staticmethod
    def flags(spec) -> list[str]:
        return [f"--gpu-architecture={spec.arch}"]

    @classmethod
    def compile(cls, source: str, flags: list[str], name: str = "kernel.cu") -> CompileOutput:
        cls.compiles.append(name)
        if "this line is not C++" in source:
            raise CompilerFailure("kernel.cu(5): error: this declaration has no storage class or type specifier")
        entry = name[: -len(".cu")]
        report = (f"ptxas info    : Compiling entry function '{entry}' for 'sm_80'\n"
                  f"ptxas info    : Function properties for {entry}\n"
                  "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
                  "ptxas info    : Used 40 registers, used 1 barriers, 0 bytes smem\n")
        return CompileOutput(fake_cubin(source), report, 0.25)

    @staticmethod
    def ptx(source: str, flags: list[str]) -> str:
        return f"// PTX of {hashlib.sha256(source.encode()).hexdigest()}\n.entry flexgen_fwd\n"


def fake_cubin(source: str) -> bytes:
    return b"\x7fELF" + hashlib.sha256(source.encode()).digest() * 8


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(root))
    for var in ("FLEXGEN_TEMPLATE_DIR", "FLEXGEN_NO_JIT", "FLEXGEN_COMPILER", "FLEXGEN_CACHE_TRUST_SHARED",
                "FLEXGEN_LOCK_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setitem(jit.BACKENDS, "fake", FakeBackend)
    monkeypatch.setattr(FakeBackend, "compiles", [])
    monkeypatch.setattr(warnings_once, "_seen", set())
    try:
        from flexgen.cache import events
        monkeypatch.setattr(events, "_unsaved_warned", False)  # "once per process": once per test here
    except ImportError:
        pass
    jit.clear_memory()
    yield root
    jit.clear_memory()


def spec_for(tag: str, arch: str = "sm_80", **options):
    return make_spec("fwd", head_dim=64, arch=arch, tag=tag, **options)


def get(tag: str, arch: str = "sm_80", **options):
    return jit.get_kernel(spec_for(tag, arch, **options), FIXTURES, "fake")


def key_of(tag: str, **options) -> str:
    return jit.plan(spec_for(tag, **options), FIXTURES, FakeBackend)[2]


def tree(root: Path) -> dict:
    """Every item under `root` (links not followed): relative path -> file bytes, link target or 'dir'."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(folder) / name
            rel = str(p.relative_to(root))
            out[rel] = ("link", os.readlink(p)) if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return out


def every_path(root: Path):
    yield root
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            yield Path(folder) / name


@contextmanager
def as_user(uid: int):
    """Act as another user (effective ids only; root gets its ids back afterwards)."""
    groups = os.getgroups()
    os.setgroups([])
    os.setegid(uid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
        os.setgroups(groups)


def give_away(path: Path, monkeypatch) -> None:
    """Make `path` another user's: a real chown as root; elsewhere every file looks foreign."""
    if IS_ROOT:
        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
    else:
        from flexgen.cache import safefs
        monkeypatch.setattr(safefs, "current_uid", lambda: os.geteuid() + 1)


def part(kernel, name: str) -> Path:
    return {"root": paths.cache_root(), "version": paths.version_dir(), "arch": kernel.path.parent,
            "entry": kernel.path}.get(name, kernel.path / name)


# ---------------------------------------------------------------- 1. no template bytecode on disk


def test_template_bytecode_is_never_loaded_from_disk(cache, tmp_path):
    """Jinja's bytecode cache is unmarshalled code: one planted where flexgen kept it must not run."""
    render_module._environment.cache_clear()
    ran = tmp_path / "planted-code-ran"
    name = "sm80/fwd.cu.j2"
    env = jinja2.Environment(loader=jinja2.FileSystemLoader([FIXTURES] + [str(d) for d in paths.template_dirs()]))
    source, filename, _ = env.loader.get_source(env, name)
    planted = jinja2.FileSystemBytecodeCache(str(cache / __version__ / ".jinja"))
    bucket = planted.get_bucket(env, name, filename, source)
    bucket.code = compile(f"open({str(ran)!r}, 'w').close()", filename, "exec")
    (cache / __version__ / ".jinja").mkdir(parents=True)
    planted.set_bucket(bucket)

    text = render_module.render(spec_for("bytecode"), FIXTURES)
    assert not ran.exists(), "template bytecode planted in the cache was executed"
    assert "// tag: bytecode" in text and "FixtureParams" in text

    shutil.rmtree(cache)
    render_module._environment.cache_clear()
    render_module.render(spec_for("bytecode"), FIXTURES)
    assert not cache.exists(), "rendering wrote to the cache folder"


# ---------------------------------------------------------------- 2. clear removes only flexgen's files


def test_clear_refuses_a_folder_that_is_not_a_flexgen_cache(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    (home / "Documents").mkdir(parents=True)
    (home / "Documents" / "thesis.tex").write_text("years of work")
    (home / __version__ / "sm_80").mkdir(parents=True)  # even a folder that looks like a version
    (home / ".bashrc").write_text("export PATH")
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(home))
    before = tree(home)
    with pytest.raises(errors.NotAFlexgenCacheError, match="does not look like a flexgen kernel cache"):
        store.clear()
    assert cli.main(["cache", "clear"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flexgen: ") and str(home) in err and "FLEXGEN_CACHE_DIR" in err
    assert tree(home) == before


def test_jit_never_writes_into_a_folder_that_is_not_its_cache(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "Documents").mkdir(parents=True)
    (home / "Documents" / "notes.txt").write_text("mine")
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(home))
    before = tree(home)
    with pytest.warns(UserWarning, match="holds files that flexgen did not write"):
        kernel = get("home")
    assert kernel.cubin == fake_cubin(kernel.source) and tree(home) == before


def test_clear_removes_only_what_flexgen_wrote(cache, tmp_path):
    a = get("one")
    b = get("two", arch="sm_90a")
    assert a.ptx.startswith("// PTX of")
    with pytest.raises(errors.FlexgenCompileError):
        get("broken", break_it=True)
    assert (paths.failed_dir(key_of("broken", break_it=True)) / "source.cu").exists()

    outside = tmp_path / "outside"
    (outside / "entry").mkdir(parents=True)
    (outside / "entry" / "kernel.cubin").write_bytes(b"not yours")
    foreign = {
        cache / "notes.txt": b"notes",
        a.path / "mine.txt": b"kept with its folder",
        a.path.parent / "my-notes" / "todo.txt": b"todo",
        a.path.parent / ("e" * 64) / "photo.jpg": b"jpeg",
        paths.version_dir() / "failed" / "README": b"readme",
        paths.version_dir() / ".jinja" / "user-notes.txt": b"notes",
    }
    legacy_bytecode = paths.version_dir() / ".jinja" / f"__jinja2_{'0' * 40}.cache"  # what older versions kept
    for path, data in foreign.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (paths.version_dir() / "sm_75").symlink_to(outside, target_is_directory=True)
    (b.path.parent / ("f" * 64)).symlink_to(outside / "entry", target_is_directory=True)
    legacy_bytecode.write_bytes(b"j2 bytecode")
    outside_before = tree(outside)

    done = store.clear()
    assert not legacy_bytecode.exists()
    assert done.entries == 2 and done.bytes >= len(a.cubin) + len(b.cubin)
    for path, data in foreign.items():
        assert path.read_bytes() == data, f"clear touched {path}"
    assert tree(outside) == outside_before
    assert (paths.version_dir() / "sm_75").is_symlink() and (b.path.parent / ("f" * 64)).is_symlink()
    assert sorted(p.name for p in a.path.iterdir()) == ["mine.txt"]
    assert not b.path.exists() and not paths.failed_dir(key_of("broken", break_it=True)).exists()
    assert not (a.path.parent / ".locks").exists() and not (b.path.parent / ".locks").exists()
    assert any(str(a.path) in k for k in done.kept) and (cache / "CACHEDIR.TAG").is_file()


def test_an_empty_folder_or_an_older_unmarked_cache_is_adopted(tmp_path, monkeypatch):
    empty = tmp_path / "made-by-the-user"
    empty.mkdir()
    os.chmod(empty, 0o775)  # what mkdir gives under the common umask 002
    older = tmp_path / "older"
    (older / "0.0.9" / "sm_80").mkdir(parents=True)
    for root in (empty, older):
        monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(root))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            kernel = get(f"adopted-{root.name}")
        assert kernel.path.parent.parent.parent == root and (root / "CACHEDIR.TAG").is_file()
        assert store.load("sm_80", kernel.key) is not None
    assert empty.stat().st_mode & 0o777 == 0o700
    assert store.clear().entries == 1 and (older / "CACHEDIR.TAG").is_file() and not (older / "0.0.9").exists()


# ---------------------------------------------------------------- 3. private, trusted, no links, checksums


def test_cache_is_private_to_its_owner(cache):
    kernel = get("private")
    kernel.ptx
    with pytest.raises(errors.FlexgenCompileError):
        get("private-broken", break_it=True)
    modes = {p: p.lstat().st_mode & 0o777 for p in every_path(cache)}
    assert {oct(m) for p, m in modes.items() if p.is_dir()} == {"0o700"}
    assert {oct(m) for p, m in modes.items() if not p.is_dir()} == {"0o600"}
    names = {str(p.relative_to(cache)) for p in modes if p != cache}
    assert f"{__version__}/sm_80/.locks/{kernel.key}.lock" in names and "CACHEDIR.TAG" in names
    assert (cache / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55")


TARGETS = ["root", "version", "arch", "entry", "meta.json", "kernel.cubin", "source.cu"]


@pytest.mark.parametrize("target", TARGETS)
def test_what_another_user_owns_is_not_loaded(cache, monkeypatch, target):
    kernel = get("owned")
    give_away(part(kernel, target), monkeypatch)
    jit.clear_memory()
    with pytest.warns(UserWarning, match="belongs to another user"):
        again = get("owned")
    assert len(FakeBackend.compiles) == 2 and again.cubin == kernel.cubin
    if target in ("root", "version", "arch", "entry") and IS_ROOT:
        assert not kernel.path.exists() or (kernel.path.stat().st_uid == NOBODY) == (target == "entry")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits", [0o020, 0o002], ids=["group", "others"])
def test_what_others_can_write_is_not_loaded(cache, target, bits):
    kernel = get("writable")
    path = part(kernel, target)
    os.chmod(path, path.stat().st_mode | bits)
    jit.clear_memory()
    with pytest.warns(UserWarning, match="can be written by other users"):
        again = get("writable")
    assert len(FakeBackend.compiles) == 2 and again.cubin == kernel.cubin


def served_read_only(monkeypatch, kernel, tag: str, not_saved: str) -> None:
    """The cached kernel loads with FLEXGEN_NO_JIT=1 and no warning; a miss compiles, is not saved
    (warned, matching `not_saved`), and still works from memory."""
    monkeypatch.setenv("FLEXGEN_NO_JIT", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get(tag).cubin == kernel.cubin
    monkeypatch.delenv("FLEXGEN_NO_JIT")
    with pytest.warns(UserWarning, match=not_saved):
        other = get(tag + "-miss")
    assert other.cubin == fake_cubin(other.source) and other.ptx.startswith("// PTX of")
    assert store.load(kernel.spec.arch, other.key) is None


def publish(cache: Path, monkeypatch) -> None:
    """What an administrator does to share a prebuilt cache: readable by all, writable by its owner only."""
    for p in every_path(cache):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
        give_away(p, monkeypatch)


def test_another_users_cache_needs_the_opt_in_and_stays_read_only(cache, monkeypatch):
    kernel = get("shared")
    publish(cache, monkeypatch)
    before = tree(cache)
    jit.clear_memory()
    monkeypatch.setenv("FLEXGEN_NO_JIT", "1")
    with pytest.warns(UserWarning, match="FLEXGEN_CACHE_TRUST_SHARED=1"), pytest.raises(errors.KernelNotCachedError):
        get("shared")

    monkeypatch.setenv("FLEXGEN_CACHE_TRUST_SHARED", "1")
    served_read_only(monkeypatch, kernel, "shared", "cannot save compiled kernels")
    assert len(FakeBackend.compiles) == 2
    assert tree(cache) == before, "flexgen wrote into a cache that another user owns"

    os.chmod(kernel.path / "kernel.cubin", 0o664)  # the opt-in trusts the owner, never everyone
    jit.clear_memory()
    monkeypatch.setenv("FLEXGEN_NO_JIT", "1")
    with pytest.warns(UserWarning, match="can be written by other users"), pytest.raises(errors.KernelNotCachedError):
        get("shared")


@pytest.mark.parametrize("target", ["meta.json", "kernel.cubin", "source.cu", "entry", "arch"])
def test_links_inside_the_cache_are_not_followed(cache, tmp_path, target):
    kernel = get("linked")
    path = part(kernel, target)
    copy = tmp_path / "outside" / path.name
    copy.parent.mkdir()
    (shutil.copytree if path.is_dir() else shutil.copy2)(path, copy)
    (shutil.rmtree if path.is_dir() else os.unlink)(path)
    path.symlink_to(copy, target_is_directory=copy.is_dir())
    outside = tree(copy.parent)
    jit.clear_memory()
    with pytest.warns(UserWarning, match="symbolic link"):
        again = get("linked")
    assert len(FakeBackend.compiles) == 2 and again.cubin == kernel.cubin
    assert tree(copy.parent) == outside


def test_lock_and_failed_source_links_are_not_followed(cache, tmp_path):
    key = key_of("broken-link", break_it=True)
    lock, failed = paths.lock_path("sm_80", key), paths.failed_dir(key)
    lock.parent.mkdir(parents=True)
    failed.parent.mkdir(parents=True)
    lock.symlink_to(tmp_path / "created-through-the-lock-link")
    (tmp_path / "elsewhere").mkdir()
    failed.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.warns(UserWarning, match="symbolic link"), pytest.raises(errors.FlexgenCompileError) as err:
        get("broken-link", break_it=True)
    assert not (tmp_path / "created-through-the-lock-link").exists()
    assert list((tmp_path / "elsewhere").iterdir()) == []
    saved = Path(err.value.source_path)
    assert saved.read_text().count("this line is not C++") == 1 and tmp_path / "elsewhere" not in saved.parents


def test_source_and_ptx_are_checked_like_the_cubin(cache):
    kernel = get("sums")
    ptx = kernel.ptx
    meta = json.loads((kernel.path / "meta.json").read_text())
    assert meta["source_sha256"] == hashlib.sha256(kernel.source.encode()).hexdigest()
    assert meta["ptx_sha256"] == hashlib.sha256(ptx.encode()).hexdigest()

    (kernel.path / "source.cu").write_text(kernel.source + "// changed\n")
    jit.clear_memory()
    with pytest.warns(UserWarning, match="source.cu does not match"):
        get("sums")
    assert len(FakeBackend.compiles) == 2

    again = get("sums")
    assert again.ptx == ptx
    (kernel.path / "kernel.ptx").write_text(".entry something_else\n")
    jit.clear_memory()
    with pytest.warns(UserWarning, match="kernel.ptx does not match"):
        assert get("sums").ptx == ptx
    assert len(FakeBackend.compiles) == 2


# ---------------------------------------------------------------- 4. read-only, another user's, full


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT])
def test_failed_write_keeps_the_kernel_in_memory_and_warns_once(cache, monkeypatch, code):
    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(store, "write_atomic", refuse)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first, second = get("full-1"), get("full-2")
        assert get("full-1") is first and first.ptx.startswith("// PTX of")
    assert first.cubin == fake_cubin(first.source) and second.cubin == fake_cubin(second.source)
    assert len(FakeBackend.compiles) == 2
    notes = [str(w.message) for w in seen if "cannot save" in str(w.message)]
    assert len(notes) == 1 and os.strerror(code) in notes[0] and "FLEXGEN_CACHE_DIR" in notes[0]
    assert store.load("sm_80", first.key) is None


needs_root = pytest.mark.skipif(not IS_ROOT, reason="acting as other users needs root")


@pytest.fixture
def shared_tmp():
    """A folder other users can reach (pytest's own tmp folders are private to root)."""
    base = Path(tempfile.mkdtemp(prefix="flexgen-cache-test-"))
    os.chmod(base, 0o755)
    yield base
    for p in every_path(base):
        if p.is_dir() and not p.is_symlink():
            os.chmod(p, 0o700)
    shutil.rmtree(base)


@needs_root
def test_read_only_cache_of_a_real_user(shared_tmp, monkeypatch):
    get("warm-up")  # imports every module while root can still read them all
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(shared_tmp / "cache"))
    os.chown(shared_tmp, NOBODY, NOBODY)
    jit.clear_memory()
    with as_user(NOBODY):
        kernel = get("read-only")
    for p in every_path(shared_tmp / "cache"):
        os.chmod(p, 0o500 if p.is_dir() else 0o400)
    jit.clear_memory()
    with as_user(NOBODY):
        served_read_only(monkeypatch, kernel, "read-only", "cannot save compiled kernels.*Permission denied")
        with pytest.raises(errors.FlexgenCompileError) as err:
            get("read-only-broken", break_it=True)
    assert Path(err.value.source_path).read_text().count("this line is not C++") == 1


@needs_root
@pytest.mark.parametrize("readable", [True, False], ids=["published", "private"])
def test_another_real_users_cache(shared_tmp, monkeypatch, readable):
    get("warm-up")
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(shared_tmp / "cache"))
    jit.clear_memory()
    kernel = get("theirs")
    for p in every_path(shared_tmp / "cache"):
        os.chown(p, STRANGER, STRANGER)
        os.chmod(p, (0o755 if p.is_dir() else 0o644) if readable else (0o700 if p.is_dir() else 0o600))
    jit.clear_memory()
    monkeypatch.setenv("FLEXGEN_NO_JIT", "1")
    monkeypatch.setenv("FLEXGEN_CACHE_TRUST_SHARED", "1")
    with as_user(NOBODY):
        if readable:
            served_read_only(monkeypatch, kernel, "theirs", "cannot save compiled kernels")
        else:
            with pytest.warns(UserWarning, match=f"cannot read {shared_tmp / 'cache'} .Permission denied"), \
                    pytest.raises(errors.KernelNotCachedError):
                get("theirs")
            monkeypatch.delenv("FLEXGEN_NO_JIT")
            with pytest.warns(UserWarning, match="cannot save compiled kernels"):
                assert get("theirs-miss").cubin[:4] == b"\x7fELF"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # each problem is reported once, not once per kernel
            assert get("theirs-miss-2").cubin[:4] == b"\x7fELF"


# ---------------------------------------------------------------- 5. corrupt metadata is rebuilt


def _corrupt_meta(kernel, how: str) -> None:
    meta_file = kernel.path / "meta.json"
    meta = json.loads(meta_file.read_text())
    if how == "directory":
        meta_file.unlink()
        (meta_file / "inside").mkdir(parents=True)
    elif how == "fifo":
        meta_file.unlink()
        os.mkfifo(meta_file, 0o600)
    elif how == "entry is a file":
        shutil.rmtree(kernel.path)
        kernel.path.write_text("{}")
    else:
        data = {
            "list": b"[]", "null": b"null", "number": b"7", "not utf-8": b"\xff\xfe{\x00}",
            "truncated": b'{"key": "tr',
            "field missing": json.dumps({k: v for k, v in meta.items() if k != "cubin_sha256"}).encode(),
            "field of wrong type": json.dumps(dict(meta, compiler=["nvrtc"])).encode(),
            "flags missing": json.dumps(dict(meta, compiler={"name": "fake"})).encode(),
            "another kernel's": json.dumps(dict(meta, key="0" * 64)).encode(),
        }[how]
        meta_file.write_bytes(data)


@pytest.mark.parametrize("how", ["list", "null", "number", "not utf-8", "truncated", "field missing",
                                 "field of wrong type", "flags missing", "another kernel's", "directory", "fifo",
                                 "entry is a file"])
def test_corrupt_metadata_is_rebuilt(cache, capsys, how):
    kernel = get("corrupt")
    _corrupt_meta(kernel, how)
    assert cli.main(["cache", "ls"]) == 0 and "kernel(s)" in capsys.readouterr().out
    jit.clear_memory()
    with pytest.warns(UserWarning, match="corrupted"):
        again = get("corrupt")
    assert len(FakeBackend.compiles) == 2 and again.cubin == kernel.cubin
    jit.clear_memory()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # whole again: loads without a warning or a compile
        assert get("corrupt").cubin == kernel.cubin
    assert len(FakeBackend.compiles) == 2


# ---------------------------------------------------------------- 6. a hung lock holder


HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("holder", ["stopped process", "thread"])
def test_a_hung_lock_holder_ends_in_a_clear_timeout(cache, monkeypatch, holder):
    lock_file = paths.lock_path("sm_80", key_of("hung"))
    lock_file.parent.mkdir(parents=True)
    monkeypatch.setenv("FLEXGEN_LOCK_TIMEOUT", "0.5")
    proc, release = None, threading.Event()
    if holder == "stopped process":
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lock_file)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "locked"
        os.kill(proc.pid, signal.SIGSTOP)
    else:
        held = threading.Event()

        def hold():
            with FileLock(lock_file, timeout=5):
                held.set()
                release.wait(60)

        threading.Thread(target=hold, daemon=True).start()
        assert held.wait(10)
    outcome = {}

    def attempt():
        try:
            get("hung")
        except BaseException as e:  # noqa: BLE001 (the test inspects it)
            outcome["error"] = e

    try:
        start = time.monotonic()
        waiter = threading.Thread(target=attempt, daemon=True)
        waiter.start()
        waiter.join(20)
        assert not waiter.is_alive(), "still waiting for a lock whose holder is stopped"
        assert time.monotonic() - start < 10
    finally:
        release.set()
        if proc is not None:
            proc.kill()
            proc.wait()
    err = outcome.get("error")
    assert isinstance(err, errors.LockTimeoutError) and isinstance(err, TimeoutError)
    assert str(lock_file) in str(err) and "FLEXGEN_LOCK_TIMEOUT" in str(err) and "stopped or hung" in str(err)
    assert not FakeBackend.compiles
    assert get("hung").cubin[:4] == b"\x7fELF"  # once the holder is gone


@pytest.mark.parametrize("text", ["soon", "-1", "nan"])
def test_lock_timeout_setting_is_checked(monkeypatch, text):
    monkeypatch.setenv("FLEXGEN_LOCK_TIMEOUT", text)
    with pytest.raises(ValueError, match="FLEXGEN_LOCK_TIMEOUT must be a number of seconds"):
        get("timeout-setting")


# ---------------------------------------------------------------- 7. compile logging


def test_each_compile_is_logged(cache, caplog):
    caplog.set_level(logging.INFO, logger="flexgen.cache")
    kernel = get("logged")
    lines = [r.getMessage() for r in caplog.records if r.name == "flexgen.cache" and r.levelno == logging.INFO]
    assert len(lines) == 2, lines
    start, done = lines
    what = f"fwd kernel sm80/fwd.cu.j2 (head_dim=64, bf16, key {kernel.key[:16]}) for sm_80"
    assert start == f"compiling {what} with fake"
    assert done == f"compiled {what} with fake in 0.25 s"
    caplog.clear()
    jit.clear_memory()
    get("logged")  # from disk: nothing compiled, nothing logged
    assert not [r for r in caplog.records if r.name == "flexgen.cache"]


def test_a_new_root_claimed_by_many_threads_at_once(tmp_path, monkeypatch):
    """Writers that find the same new, empty cache folder at once all claim it: one's marker, half
    written, is no foreign file to the others."""
    import threading

    from flexgen.cache import safefs

    root = tmp_path / "fresh"
    root.mkdir()
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(root))
    errors, start = [], threading.Barrier(8)

    def claim():
        start.wait()
        try:
            os.close(safefs.open_root(create=True))
        except Exception as e:  # noqa: BLE001 - any error fails the test below
            errors.append(e)

    for _ in range(20):
        for p in root.iterdir():
            p.unlink()
        threads = [threading.Thread(target=claim) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert safefs.is_marked(os.open(root, os.O_RDONLY | os.O_DIRECTORY))
    # a temporary file that is not the marker's still makes the folder foreign
    for p in root.iterdir():
        p.unlink()
    (root / ".notes.0123456789abcdef.tmp").write_text("mine")
    with pytest.raises(safefs.NotAFlexgenCacheError):
        safefs.open_root(create=True)
