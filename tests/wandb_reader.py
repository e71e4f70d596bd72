"""Read an offline W&B run file (`run-*.wandb`: LevelDB-log-framed protobuf records) back into Python."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

BLOCK = 32768
HEADER = 7  # file header ":W&B" + magic (2) + version (1); record header crc (4) + length (2) + type (1)


def finished_run(path: Path, timeout: float = 60.0) -> bytes:
    """The run file's bytes once W&B has written its `exit` record: `wandb.finish()` can return while W&B's service
    process is still writing an offline run (the file then holds its 7-byte header only)."""
    deadline = time.monotonic() + timeout
    while True:
        data = Path(path).read_bytes()
        try:
            done = any(r.WhichOneof("record_type") == "exit" for r in parse(data))
        except Exception:  # a record still being written
            done = False
        if done or time.monotonic() > deadline:
            return data
        time.sleep(0.2)


def records(path: Path):
    return parse(finished_run(path))


def parse(data: bytes):
    from wandb.proto import wandb_internal_pb2

    assert data[:4] == b":W&B", "not a W&B run file"
    pos, chunks = HEADER, []
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # block trailer padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunks.append(data[pos + HEADER : pos + HEADER + length])
        pos += HEADER + length
        if kind in (1, 4):  # FULL or LAST: a whole record is assembled
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(b"".join(chunks))
            chunks = []
            yield rec
        elif kind == 0:
            break


def read_offline_run(run_file: Path) -> tuple[dict, list[dict]]:
    """(config, history rows) of an offline run file."""
    config, history = {}, []
    for rec in records(run_file):
        kind = rec.WhichOneof("record_type")
        if kind == "config":
            for item in rec.config.update:
                config[item.key] = json.loads(item.value_json)
        elif kind == "run":
            for item in rec.run.config.update:
                config[item.key] = json.loads(item.value_json)
        elif kind == "history":
            history.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in rec.history.item
                }
            )
    return config, history


def read_offline_summary(run_file: Path) -> dict:
    """The run summary (`run.summary[...] = ...` and W&B's own last values) of an offline run file."""
    summary = {}
    for rec in records(run_file):
        if rec.WhichOneof("record_type") == "summary":
            for item in rec.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return summary
