"""Results files: a stream of msgpack result records (rollout_service/api/types.py's wire format) between a header
and an end record holding their count, so that a file cut short anywhere, even between two records, is an
error rather than fewer results; read in chunks, so a file of any size loads. Files written before the header
existed (results only) still load; one of those cut between two records cannot be told from a shorter one.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator

import msgpack

from rollout_service.api.types import RolloutResult
from rollout_service.api.wire import WIRE_SCHEMA_VERSION, check_record, packb

FILE_HEADER = {"schema": WIRE_SCHEMA_VERSION, "kind": "results_file"}
READ_SIZE = 1 << 20  # bytes read from a results file at a time


def save_results(path: str | Path, results: Iterable[RolloutResult]) -> int:
    """Write `results` (any iterable: they are encoded one at a time) to `path`; returns how many. The file
    is written next to `path` under a temporary name and renamed over it once complete, so an error (a
    result that would not load back: ValueError naming it and the field; or one raised by `results`)
    leaves `path` as it was, and no reader ever sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    count = 0
    try:
        with open(tmp, "xb") as f:
            f.write(packb(FILE_HEADER))
            for r in results:
                f.write(_result_record(r, count))
                count += 1
            f.write(packb({"schema": WIRE_SCHEMA_VERSION, "kind": "end", "count": count}))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return count


def _result_record(r: Any, index: int) -> bytes:
    if not isinstance(r, RolloutResult):
        raise ValueError(f"save_results: item {index} is a {type(r).__name__}, not a RolloutResult")
    try:
        return r.to_msgpack()
    except ValueError as e:
        raise ValueError(f"save_results: result {index} (request {r.request_id!r}): {e}") from None


def load_results(path: str | Path) -> list[RolloutResult]:
    """Every result saved in `path` (see iter_results)."""
    return list(iter_results(path))


def iter_results(path: str | Path) -> Iterator[RolloutResult]:
    """The results saved in `path`, one at a time. The file is read in chunks, never whole: memory holds
    one record at a time, whatever the file's size. A file that is truncated or corrupt is a ValueError
    naming the byte offset where it goes wrong, and a record whose fields have the wrong types one naming
    the result's index, its offset and the field (the results before it have been yielded)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ValueError(f"{path}: empty file, not a results file (save_results writes a header and an end "
                             "record even when there are no results)")
        # No valid record is larger than its file: bounding the buffer (and with it the lengths a record's
        # header may claim) by the file's size keeps a corrupt length from asking for more memory.
        unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False, read_size=min(READ_SIZE, size),
                                    max_buffer_size=size)
        yield from _file_results(_records(unpacker, path), size, path)


_EOF = object()


def _records(unpacker: msgpack.Unpacker, path: Any) -> Iterator[tuple[int, Any]]:
    """(byte offset, record) of every whole record, then (offset after the last one, _EOF). The unpacker's
    own tell() is no guide to a truncated file: it counts the bytes of an unfinished record too."""
    offset = 0
    while True:
        try:
            record = next(unpacker)
        except StopIteration:
            yield offset, _EOF
            return
        except Exception as e:  # msgpack raises several unrelated types on garbage
            raise ValueError(f"{path}: corrupt at byte offset {offset}: not msgpack ({type(e).__name__}: {e})") from None
        yield offset, record
        offset = unpacker.tell()


def _kind(record: Any) -> Any:
    return record.get("kind") if isinstance(record, dict) else None


def _file_results(records: Iterator[tuple[int, Any]], size: int, path: Any) -> Iterator[RolloutResult]:
    offset, record = next(records)
    legacy = _kind(record) == "result"  # a file written before the header existed
    if not legacy and record is not _EOF:
        if _kind(record) != FILE_HEADER["kind"] or record.get("schema") != WIRE_SCHEMA_VERSION:
            raise ValueError(f"{path}: not a results file: the record at byte offset 0 is neither a results-file "
                             f"header (schema {WIRE_SCHEMA_VERSION}) nor a result")
        offset, record = next(records)
    index = 0
    while record is not _EOF and not (_kind(record) == "end" and not legacy):
        try:
            result = RolloutResult.from_dict(check_record(record, "result"))
        except ValueError as e:
            raise ValueError(f"{path}: result {index} at byte offset {offset}: {e}") from None
        yield result
        index += 1
        offset, record = next(records)
    if record is _EOF:
        if offset < size:
            raise ValueError(f"{path}: truncated: the record at byte offset {offset} is cut short by the end of "
                             f"the file ({size} bytes), after {index} whole results")
        if not legacy:
            raise ValueError(f"{path}: truncated at byte offset {offset}: the file ends after {index} results "
                             "without the end record save_results writes last")
        return
    if record.get("count") != index:
        raise ValueError(f"{path}: the end record at byte offset {offset} counts {record.get('count')!r} results, "
                         f"but the file holds {index}")
    offset, record = next(records)
    if record is not _EOF or offset != size:
        raise ValueError(f"{path}: data after the end record, at byte offset {offset} (of {size} bytes)")
