"""Files: the one atomic write, and the one reading edge for files we did not write.

## Writing

The one atomic file write: readers see the old content or the new, never a mix.

Used for everything several processes or a later rerun read back: the plan, submission records,
requeue records, the preflight report, the training summary, checkpoint manifests and ``latest``.

## Reading

Task dirs, checkpoints, logs, submission records, the node ledger and imported checkpoints live on
shared filesystems: another user or tool may have put anything there. Everything that reads such a file
goes through here, so every reader gets the same guarantees:

- regular files only: a FIFO, socket or device is refused without blocking (``O_NONBLOCK`` on open,
  ``fstat`` before the first read); ``follow_symlinks=False`` also refuses a symlink;
- a byte cap per kind of file (the ``*_CAP`` constants): a bigger file is refused, never read whole;
- JSON parsed with a depth limit, finite numbers only (no NaN/Infinity, no float that overflows to inf)
  and integers inside int64 (``wide_ints``: up to 100 digits, for JSON other tools wrote: transformers
  saves ``model_max_length = int(1e30)``);
- no pickle: :func:`plain_unpickle` rebuilds builtin containers and scalars and refuses every class;
- every failure is :class:`Unreadable` (a ``ValueError``) naming the file and why, never a traceback.
  A missing file stays ``FileNotFoundError`` so callers keep their "not there yet" branch.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import pickle
import secrets
import stat
from pathlib import Path
from typing import Any, BinaryIO, Iterator


def fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, (os.O_RDONLY | os.O_DIRECTORY) if directory else os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path``: write a temporary sibling, fsync, rename over ``path``, fsync the directory."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """``atomic_write_text`` for bytes. The temporary sibling is created new (``O_EXCL | O_NOFOLLOW``): a file or
    a symlink someone left under its name is never written through nor removed (another name is taken), and the
    rename replaces a symlink at ``path`` itself, never what it points to."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for attempt in range(64):
        tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}" + (f".{secrets.token_hex(4)}" if attempt else ""))
        try:
            fd = os.open(tmp, flags, 0o666)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no free temporary name beside it", str(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # made by this call (O_EXCL): ours to drop
        raise
    fsync_path(path.parent, directory=True)


class Unwritable(ValueError):
    """A path the user named for us to write (``-o FILE``) holds what we may not replace; ``why`` says what."""

    def __init__(self, path: str | os.PathLike[str], why: str) -> None:
        self.path, self.why = str(path), why
        super().__init__(f"{self.path}: {why}")


def write_named_file(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Write a file at a path the user named (``render -o``, ``plot -o``, ``preflight --json``): new, or
    replacing a regular file of the user's own, atomically. A symlink (never written through), a directory, FIFO
    or device (a FIFO would block the write), or another user's file is refused: :class:`Unwritable`."""
    check_named_file(path)
    atomic_write_bytes(Path(path), data.encode("utf-8") if isinstance(data, str) else data)


def check_named_file(path: str | os.PathLike[str]) -> None:
    """What :func:`write_named_file` refuses, checked before anything is written (:class:`Unwritable`)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise Unwritable(path, f"a symlink (to {os.readlink(path)}), which is never written through")
    if not stat.S_ISREG(st.st_mode):
        raise Unwritable(path, f"{file_kind(st.st_mode)}, not a regular file")
    if st.st_uid != os.geteuid():
        raise Unwritable(path, f"a file of another user (uid {st.st_uid})")


def open_append(path: str | os.PathLike[str]) -> io.FileIO:
    """``path`` opened to append bytes (created if missing), refusing a symlink (ELOOP: never written through)
    and anything but a regular file, without blocking (a FIFO with no reader): :class:`NotRegularFile`."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFile(errno.ELOOP, "a symlink, which is never written through", str(path)) from None
        if exc.errno == errno.ENXIO:
            raise NotRegularFile(errno.ENXIO, "a FIFO, not a regular file", str(path)) from None
        raise
    return _regular(fd, path, "ab")


def open_append_text(path: str | os.PathLike[str]) -> io.TextIOWrapper:
    """:func:`open_append` as UTF-8 text, each line written through (a log another process tails)."""
    return io.TextIOWrapper(io.BufferedWriter(open_append(path)), encoding="utf-8", line_buffering=True, write_through=True)


# ---------------------------------------------------------------- reading what others may have written

KIB = 1 << 10
MIB = 1 << 20

# Caps by kind of file: far above anything a real run writes, far below what would hurt a login node.
RECORD_CAP = 4 * MIB  # small JSON records: submission.json, owner, requeues, summary, preflight report, plan
LEDGER_CAP = 16 * MIB  # the node-health ledger
MANIFEST_CAP = 256 * MIB  # a checkpoint manifest (~200 bytes a file)
CONFIG_CAP = 64 * MIB  # config.json, trainer_state.json, a safetensors index, a DeepSpeed JSON
LINE_CAP = 4 * MIB  # one JSONL line (metrics.jsonl, a dataset record)
METRICS_CAP = 64 * MIB  # the part of metrics.jsonl a reader keeps (its newest lines beyond this)
DUMP_CAP = 64 * MIB  # a flight-recorder dump
RESULT_CAP = 16 * MIB  # a submitit result pickle
TAG_CAP = 4 * KIB  # a one-line pointer file: ``latest``
MAX_DEPTH = 64  # JSON nesting: our files nest 5 deep at most
INT_LIMIT = 1 << 63  # integers outside int64 are refused (sizes, steps, ranks, times)


class Unreadable(ValueError):
    """A file that cannot be trusted or read; ``why`` says what was found, ``path`` names it."""

    def __init__(self, path: str | os.PathLike[str] | None, why: str) -> None:
        self.path = str(path) if path is not None else ""
        self.why = why
        super().__init__(f"{self.path}: {why}" if self.path else why)


class NotRegularFile(OSError):
    """A path that should be a file is a FIFO, socket, device or directory (or a refused symlink)."""


def file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "a special file"


FILE, DIRECTORY, MISSING, UNREACHABLE = "a file", "a directory", "missing", "unreachable: "


def path_kind(path: str | os.PathLike[str]) -> str:
    """What a path a user named is, never raising (``Path.is_dir`` raises for a name too long or a directory
    it may not search): ``FILE`` (regular), ``DIRECTORY``, ``MISSING``, another kind ("a FIFO", "a socket"),
    or ``UNREACHABLE`` + why for any other failure to look (from :func:`describe_os_error`)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError) as exc:
        return UNREACHABLE + describe_os_error(path, exc).removeprefix("unreadable: ") if os.path.islink(path) else MISSING
    except OSError as exc:
        return UNREACHABLE + describe_os_error(path, exc).removeprefix("unreadable: ")
    except ValueError:  # a NUL byte in the name
        return UNREACHABLE + "the name holds a NUL byte"
    return FILE if stat.S_ISREG(mode) else file_kind(mode)


def describe_os_error(path: str | os.PathLike[str], exc: OSError) -> str:
    """One line for an OSError met while reading ``path``: the errno name and what it means, and where a
    symlink points when it dangles ("dangling symlink to /gone/shard.pt")."""
    if isinstance(exc, NotRegularFile):
        return str(exc.strerror)
    if isinstance(exc, FileNotFoundError) and os.path.islink(path):
        return f"unreadable: dangling symlink to {os.readlink(path)}"
    code = errno.errorcode.get(exc.errno or 0, "")
    what = exc.strerror or str(exc)
    return f"unreadable: {what}" + (f" ({code})" if code and code not in what else "")


def open_regular(path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> io.FileIO:
    """``path`` opened for binary reading (unbuffered), refusing anything but a regular file without ever
    blocking: a FIFO would block ``open`` forever, a device is endless. NotRegularFile names what it is."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if not follow_symlinks and exc.errno == errno.ELOOP:
            raise NotRegularFile(errno.ELOOP, "a symlink, not a regular file", str(path)) from None
        raise
    return _regular(fd, path, "rb")


def _regular(fd: int, path: str | os.PathLike[str], mode: str) -> io.FileIO:
    """The open ``fd`` as an unbuffered file, if it is a regular file (else closed, and NotRegularFile)."""
    try:
        kind = os.fstat(fd).st_mode
        if not stat.S_ISREG(kind):
            raise NotRegularFile(errno.EINVAL, f"{file_kind(kind)}, not a regular file", str(path))
        os.set_blocking(fd, True)
        return io.FileIO(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def _cap_text(cap: int) -> str:
    return f"{cap // MIB} MiB" if cap >= MIB and cap % MIB == 0 else f"{cap // KIB} KiB" if cap >= KIB else f"{cap} bytes"


def read_bytes(path: str | os.PathLike[str], cap: int, *, follow_symlinks: bool = True) -> bytes:
    """The whole of a regular file of at most ``cap`` bytes. FileNotFoundError when it is not there (and no
    dangling link); Unreadable for everything else (not a regular file, over the cap, an I/O error)."""
    try:
        with open_regular(path, follow_symlinks=follow_symlinks) as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > cap:
                raise Unreadable(path, f"{size} bytes, over the {_cap_text(cap)} cap for this kind of file")
            data = _read_upto(fh, cap + 1)
    except FileNotFoundError as exc:
        if os.path.islink(path):
            raise Unreadable(path, describe_os_error(path, exc)) from None
        raise
    except OSError as exc:
        raise Unreadable(path, describe_os_error(path, exc)) from None
    if len(data) > cap:  # grew while we read
        raise Unreadable(path, f"over the {_cap_text(cap)} cap for this kind of file")
    return data


def _read_upto(fh: BinaryIO, limit: int) -> bytes:
    chunks, left = [], limit
    while left > 0:
        chunk = fh.read(min(left, 4 * MIB))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_text(path: str | os.PathLike[str], cap: int, *, follow_symlinks: bool = True, errors: str = "strict") -> str:
    """A regular file's text (UTF-8) under ``cap`` bytes; Unreadable when not UTF-8 (with ``errors='strict'``)."""
    data = read_bytes(path, cap, follow_symlinks=follow_symlinks)
    try:
        return data.decode("utf-8", errors)
    except UnicodeDecodeError as exc:
        raise Unreadable(path, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def read_tail(path: str | os.PathLike[str], offset: int, max_bytes: int) -> tuple[bytes, int]:
    """Bytes of a regular file from ``offset`` to its end, at most the last ``max_bytes`` of them:
    (bytes, where they start). A file that shrank is read from 0. Never blocks; Unreadable as read_bytes."""
    try:
        with open_regular(path) as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < offset:
                offset = 0
            start = max(offset, size - max_bytes)
            fh.seek(start)
            return _read_upto(fh, size - start), start
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise Unreadable(path, describe_os_error(path, exc)) from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number this file may hold")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _bounded_int(text: str) -> int:
    if len(text) > 20:
        raise ValueError(f"integer of {len(text)} digits is out of range")
    value = int(text)
    if not -INT_LIMIT <= value < INT_LIMIT:
        raise ValueError(f"integer {text} is out of range")
    return value


WIDE_INT_DIGITS = 100  # files of other tools: transformers writes model_max_length = int(1e30) (31 digits)


def _wide_int(text: str) -> int:
    if len(text) > WIDE_INT_DIGITS:
        raise ValueError(f"integer of {len(text)} digits is out of range")
    return int(text)


def json_depth(value: Any, limit: int) -> int:
    """How deep ``value`` nests (iterative: never recurses), stopping once past ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((child, depth + 1) for child in item if isinstance(child, (dict, list)))
    return deepest


def loads_json(raw: str | bytes, *, source: str | os.PathLike[str] | None = None, max_depth: int = MAX_DEPTH,
               finite: bool = True, wide_ints: bool = False) -> Any:
    """JSON text as Python values, or Unreadable: not JSON, nested deeper than ``max_depth``, NaN/Infinity,
    a float that overflows, or an integer outside int64. ``finite=False`` lets NaN and ±Infinity through
    (metrics, where a NaN loss is the evidence). ``wide_ints``: integers of up to ``WIDE_INT_DIGITS`` digits, for
    files other tools wrote (an HF tokenizer_config.json's 31-digit ``model_max_length`` is no damage)."""
    floats: dict[str, Any] = {"parse_constant": _refuse_constant, "parse_float": _finite_float} if finite else {}
    try:
        value = json.loads(raw, parse_int=_wide_int if wide_ints else _bounded_int, **floats)
    except RecursionError:
        raise Unreadable(source, f"JSON nested deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise Unreadable(source, f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except UnicodeDecodeError as exc:
        raise Unreadable(source, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except ValueError as exc:
        raise Unreadable(source, f"not valid JSON: {exc}") from None
    if json_depth(value, max_depth) > max_depth:
        raise Unreadable(source, f"JSON nested deeper than {max_depth} levels")
    return value


def read_json(path: str | os.PathLike[str], cap: int = RECORD_CAP, *, expect: type | None = dict,
              max_depth: int = MAX_DEPTH, follow_symlinks: bool = True, wide_ints: bool = False) -> Any:
    """A JSON file read through every guard above; ``expect`` (dict by default, None for any) is the shape
    the top level must have. FileNotFoundError when it is not there; Unreadable otherwise."""
    value = loads_json(read_bytes(path, cap, follow_symlinks=follow_symlinks), source=path, max_depth=max_depth,
                       wide_ints=wide_ints)
    if expect is not None and not isinstance(value, expect):
        raise Unreadable(path, f"a JSON {_json_kind(value)} where a JSON {_json_kind(expect())} belongs")
    return value


def json_lines(data: bytes, *, source: str | os.PathLike[str] | None = None, first_line: int = 1,
               finite: bool = True) -> Iterator[tuple[int, Any]]:
    """The lines of JSONL bytes that parse through :func:`loads_json` (``finite`` as there), with their line
    numbers; a torn, foreign, hostile or over-``LINE_CAP`` line is left out (rows of a log, not a record to refuse)."""
    for number, line in enumerate(data.split(b"\n"), start=first_line):
        if not line.strip() or len(line) > LINE_CAP:
            continue
        try:
            yield number, loads_json(line, source=source, finite=finite)
        except Unreadable:
            continue


def _json_kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")


class _PlainUnpickler(pickle.Unpickler):
    """Builtin containers and scalars only: every global (a class, a function: the way pickles run code) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed (only plain values are read)")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed")


def plain_unpickle(data: bytes, *, source: str | os.PathLike[str] | None = None) -> Any:
    """A pickle of plain values (dicts, lists, tuples, strings, numbers); Unreadable for anything else.
    Never runs code: no global is ever looked up."""
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except RecursionError:
        raise Unreadable(source, "pickle nested too deep") from None
    except Exception as exc:  # noqa: BLE001 -- torn, foreign or hostile: all the same verdict
        raise Unreadable(source, f"not a pickle of plain values ({type(exc).__name__}: {str(exc)[:200]})") from None


def read_plain_pickle(path: str | os.PathLike[str], cap: int = RESULT_CAP) -> Any:
    return plain_unpickle(read_bytes(path, cap), source=path)


def is_inside(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> bool:
    """``path``, with every symlink resolved, is ``root`` or lies under it (``root`` resolved too)."""
    try:
        real_root, real = Path(root).resolve(), Path(path).resolve()
    except (OSError, RuntimeError):
        return False
    return real == real_root or real_root in real.parents


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks after boot, /proc/PID/stat field 22); None if gone. With the pid,
    it names one process: a pid the kernel handed out again has another start time."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None

