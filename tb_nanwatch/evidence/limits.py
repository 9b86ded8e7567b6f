"""Limits on what a run dir may make a reader do, checked before the work.

A small file must not cost a large amount of memory or time: a compressed
array that inflates to gigabytes, a tensor that declares a huge shape, JSON
nested thousands deep, a range of a billion steps, a batch of 1e8 parts.
Each limit is checked on what the file *declares* (the zip directory, the
``.npy`` header, the tensor's shape, the text), before anything is
allocated; beyond it that run or bundle is refused with one line
(:class:`LimitError`) and everything else is read as usual.
``docs/reference/limits.md`` states the same numbers.

Standard library and NumPy only.
"""

from __future__ import annotations

import json
import math
import os
import stat
import zipfile
from collections.abc import Iterable
from typing import BinaryIO

import numpy as np

MB = 2**20
# Bytes of arrays read from one bundle.npz (its declared sizes): 512 MB, or
# the environment's TB_NANWATCH_MAX_BUNDLE_MB for a trusted, larger bundle.
MAX_BUNDLE_BYTES = 512 * MB
BUNDLE_LIMIT_VARIABLE = "TB_NANWATCH_MAX_BUNDLE_MB"
# Bytes one NaN Watch tag of an event file may declare (all its kept values).
MAX_TENSOR_BYTES = 64 * MB
# A JSON text: its size and nesting depth (run summary, incident, bundle.json).
MAX_JSON_BYTES = 32 * MB
MAX_JSON_DEPTH = 64
# Skipped steps a run summary's ranges may stand for (they are listed one by one).
MAX_SKIPPED_STEPS = 1_000_000
# Arrays one bundle's batch may hold (bundle.json's batch_size, batch_structure).
MAX_BATCH_PARTS = 4096
# Arrays one rewind point may hold (rewind.json's weights and optimizer
# variables plus steps x batch_size); its bytes: max_bundle_bytes().
MAX_REWIND_ARRAYS = 65536

_DEPTH_CHUNK = 1 << 20
# +1 for "[" and "{", -1 for "]" and "}", 0 for every other byte.
_NESTING = np.zeros(256, np.int8)
_NESTING[[ord("["), ord("{")]] = 1
_NESTING[[ord("]"), ord("}")]] = -1


class LimitError(ValueError):
    """What a file declares is beyond a limit (one line)."""


def count(value: object, most: int | None = None) -> int | None:
    """``value`` when a run dir's JSON gives a count there (an integer, not a
    bool, from 0 to ``most``), else None."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value if most is None or value <= most else None


def max_bundle_bytes() -> int:
    """:data:`MAX_BUNDLE_BYTES`, or ``TB_NANWATCH_MAX_BUNDLE_MB`` megabytes when set."""
    value = os.environ.get(BUNDLE_LIMIT_VARIABLE, "")
    try:
        return int(float(value) * MB) if value else MAX_BUNDLE_BYTES
    except ValueError:
        return MAX_BUNDLE_BYTES


def json_depth(text: str) -> int:
    """How deep ``[`` and ``{`` nest in a JSON text (those inside strings left
    out), without recursion; vectorized, faster than parsing the text."""
    # Without escaped backslashes and quotes, every '"' opens or closes a string.
    plain = text.replace("\\\\", "").replace('\\"', "")
    data = np.frombuffer(plain.encode("utf-8", "replace"), np.uint8)
    depth, deepest, quotes = 0, 0, 0
    for start in range(0, len(data), _DEPTH_CHUNK):
        chunk = data[start : start + _DEPTH_CHUNK]
        quote_at = np.flatnonzero(chunk == ord('"'))
        nesting = _NESTING[chunk]
        brackets = np.flatnonzero(nesting)
        outside = (np.searchsorted(quote_at, brackets) + quotes) % 2 == 0
        running = np.cumsum(nesting[brackets[outside]], dtype=np.int64) + depth
        if len(running):
            deepest, depth = max(deepest, int(running.max())), int(running[-1])
        quotes += len(quote_at)
    return deepest


def loads_bounded(
    text: str | bytes, what: str, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH
) -> object:
    """``json.loads(text)`` (NaN/Infinity tokens accepted) once its size and
    depth are within the limits; :class:`LimitError` or ``ValueError`` otherwise."""
    if len(text) > max_bytes:
        raise LimitError(
            f"{what} is {len(text) / MB:.1f} MB, more than the {max_bytes / MB:g} MB limit"
        )
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{what} is not UTF-8: {error}") from None
    opening = text.count("[") + text.count("{")
    depth = json_depth(text) if opening > max_depth else opening
    if depth > max_depth:
        raise LimitError(f"{what} nests {depth} deep, more than the limit of {max_depth}")
    try:
        return json.loads(text)
    except RecursionError:
        raise LimitError(f"{what} nests too deep to read") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{what} is malformed JSON: {error}") from None


def read_json_bounded(
    path: str, what: str, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH
) -> object:
    """The JSON file ``path`` (a regular file of at most ``max_bytes``), decoded;
    anything else (a FIFO, a device) is refused unread, never waited on."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    with os.fdopen(os.open(path, flags), "rb") as infile:
        info = os.fstat(infile.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{what} is not a regular file: not read")
        size = info.st_size
        if size > max_bytes:
            raise LimitError(
                f"{what} is {size / MB:.1f} MB, more than the {max_bytes / MB:g} MB limit"
            )
        return loads_bounded(infile.read(max_bytes + 1), what, max_bytes, max_depth)


def declared_bytes(shape: Iterable[int], itemsize: int) -> int:
    """Bytes an array of ``shape`` and ``itemsize`` takes (exact integers, no overflow)."""
    dims = [int(d) for d in shape]
    if any(d < 0 for d in dims):
        return 0
    return math.prod(dims) * max(int(itemsize), 1)


def npy_header(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[tuple, np.dtype]:
    """The (shape, dtype) the header of the ``.npy`` member ``info`` declares,
    read without its data (a ValueError when it is not an ``.npy`` header)."""
    with archive.open(info) as member:
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(member)
        else:
            shape, _, dtype = np.lib.format.read_array_header_2_0(member)
    return tuple(shape), np.dtype(dtype)


def npz_member_bytes(archive: zipfile.ZipFile, name: str) -> int:
    """What the ``.npy`` member ``name`` of an open ``.npz`` costs to load:
    the larger of its declared inflated size (zip directory) and its header's
    ``shape x itemsize``. A ``LimitError`` for an object (pickled) array."""
    member_name = name if name.endswith(".npy") else name + ".npy"
    if member_name not in archive.NameToInfo:
        raise KeyError(name)
    info = archive.getinfo(member_name)
    shape, dtype = npy_header(archive, info)
    if dtype.hasobject:
        raise LimitError(f"array {name!r} holds Python objects, which are never loaded")
    return max(info.file_size, declared_bytes(shape, dtype.itemsize))


def check_npz(source: str | BinaryIO, names: Iterable[str], max_bytes: int, what: str) -> None:
    """A :class:`LimitError` when loading the arrays ``names`` of the ``.npz``
    ``source`` would take more than ``max_bytes`` (checked on what it declares)."""
    total = 0
    try:
        with zipfile.ZipFile(source) as archive:
            for name in names:
                total += npz_member_bytes(archive, name)
                if total > max_bytes:
                    raise LimitError(
                        f"{what} declares more than {max_bytes / MB:g} MB of arrays (the limit; "
                        f"set {BUNDLE_LIMIT_VARIABLE} for a trusted bundle)"
                    )
    except KeyError as error:
        raise ValueError(f"{what} holds no array {error.args[0]!r}") from None
    except LimitError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
        raise LimitError(f"{what} is not a readable .npz file: {error}") from None
