"""A run dir is a closed box: the path rules every reader and writer follows.

A run dir may come from anyone. Every path taken from its own files (the
``repro_bundle`` of a run summary, the ``model`` of a ``bundle.json``) must be
relative, without ``..``, and must resolve inside the run dir after symlinks
(:func:`inside`); anything else is refused with one line (:class:`RunDirError`).
Writing into a run dir (:func:`safe_write_bytes`, :func:`safe_write_text`)
never follows a symlink in any component below the run dir, never writes into
an existing file (it writes its own new temporary file and renames it over the
name), and never replaces what is not a regular file of this user. Reading
from a run dir (:func:`read_inside`, :func:`list_inside`) never follows a
symlink in any component below the run dir, and opens only regular files,
without blocking (a FIFO, a device or a socket is refused with one line).

Local paths only: a URL-like path (``gs://``, ``ram://``) has no symlinks and
is left to its file system (:func:`is_remote`). Standard library only.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
import uuid
from typing import BinaryIO

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_BINARY", 0)
# Without dir_fd support (Windows) the same rules are checked by path.
_BY_FD = os.open in os.supports_dir_fd and os.rename in os.supports_dir_fd and bool(_NOFOLLOW)


class RunDirError(ValueError):
    """A path that would leave the run dir, or a write the box refuses (one line)."""


def is_remote(path: str) -> bool:
    """A URL-like path (``gs://``, ``ram://`` ...), not a local one."""
    return "://" in str(path)


def relative_path(value: object, what: str = "path") -> str:
    """``value`` as a normalized relative POSIX path with no ``..``, or a
    :class:`RunDirError` naming ``what`` (a path named in a run dir's JSON)."""
    if not isinstance(value, str) or not value or "\x00" in value:
        raise RunDirError(f"{what} {value!r} is not a path")
    text = value.replace("\\", "/")
    if text.startswith("/") or (len(text) > 1 and text[1] == ":") or is_remote(text):
        raise RunDirError(
            f"{what} {value!r} is not relative: only paths inside the run dir are used"
        )
    parts = [part for part in text.split("/") if part not in ("", ".")]
    if not parts or ".." in parts:
        raise RunDirError(f"{what} {value!r} leaves the run dir")
    return "/".join(parts)


def within(root: str, path: str) -> bool:
    """Whether the real ``path`` is the real ``root`` or below it."""
    real_root, real = os.path.realpath(root), os.path.realpath(path)
    try:
        return os.path.commonpath([real_root, real]) == real_root
    except ValueError:  # different drives
        return False


def inside(run_dir: str, relative: object, what: str = "path") -> str:
    """The real path of ``run_dir/relative``; a :class:`RunDirError` unless
    ``relative`` is relative and resolves inside ``run_dir`` after symlinks."""
    clean = relative_path(relative, what)
    if is_remote(run_dir):
        return posixpath.join(run_dir, clean)
    real = os.path.realpath(os.path.join(run_dir, *clean.split("/")))
    if not within(run_dir, real):
        raise RunDirError(
            f"{what} {relative!r} resolves outside the run dir {run_dir!r} (through a symlink)"
        )
    return real


def safe_write_text(run_dir: str, relative: str, text: str, make_dirs: bool = False) -> str:
    """:func:`safe_write_bytes` of ``text`` in UTF-8."""
    return safe_write_bytes(run_dir, relative, text.encode("utf-8"), make_dirs)


def safe_write_bytes(run_dir: str, relative: str, data: bytes, make_dirs: bool = False) -> str:
    """Writes ``data`` to ``run_dir/relative`` inside the box; returns the path.

    No component below ``run_dir`` may be a symlink (missing directories are
    created with ``make_dirs``); the bytes go to a new file of our own
    (``O_CREAT | O_EXCL | O_NOFOLLOW``), synced, then renamed over the name,
    which must be absent or a regular file of this user. With ``make_dirs``
    the run dir and missing directories below it are created. Raises
    :class:`RunDirError` (one line) or ``OSError``.
    """
    parts = relative_path(relative, "file").split("/")
    path = os.path.join(run_dir, *parts)
    if make_dirs:
        os.makedirs(run_dir, exist_ok=True)  # the run dir itself is the caller's choice
    if _BY_FD:
        _write_by_fd(run_dir, parts, data, make_dirs)
    else:
        _write_by_path(run_dir, parts, data, make_dirs)
    return path


def _refused(run_dir: str, parts: list[str], why: str) -> RunDirError:
    return RunDirError(f"not written: {'/'.join(parts)} in {run_dir!r} {why}")


def _open_dir(parent_fd: int, name: str, make: bool, where: tuple[str, list[str]]) -> int:
    """The fd of directory ``name`` under ``parent_fd``, never through a symlink."""
    try:
        return os.open(name, _DIR_FLAGS | _NOFOLLOW, dir_fd=parent_fd)
    except FileNotFoundError:
        if not make:
            raise
    except OSError:  # ELOOP / ENOTDIR: a symlink, or a file where a directory goes
        raise _refused(*where, "(a symlink or not a directory)") from None
    try:
        os.mkdir(name, 0o777, dir_fd=parent_fd)
    except FileExistsError:
        pass  # made meanwhile: opened (and checked) below
    return _open_dir(parent_fd, name, False, where)


def _write_by_fd(run_dir: str, parts: list[str], data: bytes, make_dirs: bool) -> None:
    fds = [os.open(run_dir, _DIR_FLAGS)]
    try:
        for index, name in enumerate(parts[:-1]):
            where = (run_dir, parts[: index + 1])
            fds.append(_open_dir(fds[-1], name, make_dirs, where))
        directory, name = fds[-1], parts[-1]
        try:
            info = os.stat(name, dir_fd=directory, follow_symlinks=False)
        except FileNotFoundError:
            info = None
        _check_target(info, run_dir, parts)
        temporary = f".{name}.{uuid.uuid4().hex}.tmp"
        fd = os.open(temporary, _NEW_FILE, 0o666, dir_fd=directory)
        try:
            _write_all(fd, data)
            os.replace(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            os.unlink(temporary, dir_fd=directory)
            raise
    finally:
        for fd in reversed(fds):
            os.close(fd)


def _check_target(info: os.stat_result | None, run_dir: str, parts: list[str]) -> None:
    """The name written over must be absent or a regular file of this user."""
    if info is None:
        return
    if not stat.S_ISREG(info.st_mode):
        raise _refused(run_dir, parts, "exists and is not a regular file (a symlink?)")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise _refused(run_dir, parts, "exists and belongs to another user")


def _write_all(fd: int, data: bytes) -> None:
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_by_path(run_dir: str, parts: list[str], data: bytes, make_dirs: bool) -> None:
    directory = run_dir
    for index, name in enumerate(parts[:-1]):
        directory = os.path.join(directory, name)
        if os.path.islink(directory):
            raise _refused(run_dir, parts[: index + 1], "(a symlink)")
        if make_dirs and not os.path.exists(directory):
            os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, parts[-1])
    info = os.lstat(target) if os.path.lexists(target) else None
    _check_target(info, run_dir, parts)
    temporary = os.path.join(directory, f".{parts[-1]}.{uuid.uuid4().hex}.tmp")
    fd = os.open(temporary, _NEW_FILE, 0o666)
    try:
        _write_all(fd, data)
        os.replace(temporary, target)
    except BaseException:
        os.unlink(temporary)
        raise


# -- reading -----------------------------------------------------------------------------

_READ_FLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)


def read_inside(run_dir: str, relative: str, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of the regular file ``run_dir/relative``, at most ``max_bytes``.

    No component below ``run_dir`` may be a symlink, and the file must be a
    regular file (a FIFO, device or socket is never waited on): else a
    :class:`RunDirError`. Larger than ``max_bytes``: a ``ValueError`` before
    anything is read. Missing: ``FileNotFoundError``. Local paths only.
    """
    parts = relative_path(relative, what).split("/")
    try:
        fd = _open_inside(run_dir, parts, what)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT, f"{what} is missing", os.path.join(run_dir, *parts)
        ) from None
    with os.fdopen(fd, "rb") as infile:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise ValueError(
                f"{what} is {size / 2**20:.1f} MB, more than the {max_bytes / 2**20:g} MB limit"
            )
        data = infile.read(size + 1)  # not max_bytes + 1: read() allocates what it is asked
        if len(data) > size:  # grew meanwhile
            data += infile.read(max_bytes + 1 - len(data))
    if len(data) > max_bytes:
        raise ValueError(f"{what} is more than the {max_bytes / 2**20:g} MB limit")
    return data


def open_regular(path: str, what: str = "file") -> BinaryIO:
    """``path`` (already checked to be inside its run dir) opened for reading
    when it is a regular file, never waiting on a FIFO: else a :class:`RunDirError`."""
    return os.fdopen(_open_regular(path, what), "rb")


def list_inside(run_dir: str, relative: str, what: str = "directory") -> list[str]:
    """The names in the directory ``run_dir/relative``, reached without
    following a symlink below ``run_dir`` (else a :class:`RunDirError`)."""
    parts = relative_path(relative, what).split("/")
    if not _BY_FD:
        _check_path(run_dir, parts, what, last_is_dir=True)
        return os.listdir(os.path.join(run_dir, *parts))
    fds = _open_dirs(run_dir, parts, what)
    try:
        return os.listdir(fds[-1])
    finally:
        for fd in reversed(fds):
            os.close(fd)


def _not_followed(what: str, parts: list[str]) -> RunDirError:
    return RunDirError(
        f"{what}: {'/'.join(parts)} is a symlink or not a directory: not followed "
        "(nothing outside the run dir is read)"
    )


_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
    (stat.S_ISLNK, "a symlink"),
    (stat.S_ISDIR, "a directory"),
)


def _not_regular(what: str, mode: int) -> RunDirError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return RunDirError(f"{what} is {kind}, not a regular file: not read")


def _open_dirs(run_dir: str, parts: list[str], what: str) -> list[int]:
    """The fds of ``run_dir`` and each directory of ``parts`` below it."""
    fds = [os.open(run_dir, _DIR_FLAGS)]
    try:
        for index, name in enumerate(parts):
            try:
                fds.append(os.open(name, _DIR_FLAGS | _NOFOLLOW, dir_fd=fds[-1]))
            except FileNotFoundError:
                raise
            except OSError:  # ELOOP / ENOTDIR
                raise _not_followed(what, parts[: index + 1]) from None
    except BaseException:
        for fd in reversed(fds):
            os.close(fd)
        raise
    return fds


def _open_inside(run_dir: str, parts: list[str], what: str) -> int:
    """A read-only fd of the regular file ``parts`` below ``run_dir``."""
    if not _BY_FD:
        _check_path(run_dir, parts, what, last_is_dir=False)
        return _open_regular(os.path.join(run_dir, *parts), what)
    fds = _open_dirs(run_dir, parts[:-1], what)
    try:
        info = os.stat(parts[-1], dir_fd=fds[-1], follow_symlinks=False)
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(what, info.st_mode)
        return _open_regular(parts[-1], what, fds[-1])
    finally:
        for fd in reversed(fds):
            os.close(fd)


def _open_regular(path: str, what: str, dir_fd: int | None = None) -> int:
    """``path`` opened without following a symlink and without blocking,
    checked to be a regular file once open."""
    try:
        fd = os.open(path, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENXIO):  # a symlink; a socket
            raise RunDirError(f"{what} is a symlink or a socket: not read") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(what, mode)
    return fd


def _check_path(run_dir: str, parts: list[str], what: str, last_is_dir: bool) -> None:
    """By path (no dir_fd support): no component below ``run_dir`` a symlink."""
    directory = run_dir
    for index, name in enumerate(parts if last_is_dir else parts[:-1]):
        directory = os.path.join(directory, name)
        if os.path.islink(directory) or not os.path.isdir(directory):
            if not os.path.lexists(directory):
                raise FileNotFoundError(f"{what}: {'/'.join(parts[: index + 1])} is missing")
            raise _not_followed(what, parts[: index + 1])
