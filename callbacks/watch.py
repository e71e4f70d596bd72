"""Evaluate every new checkpoint of a training run exactly once (`evaluate.py watch=RUN_DIR`, `callbacks=eval_on_save`).

A checkpoint is a `*.ckpt` file in the checkpoint folder; temporary files of the atomic writer (`.<name>.tmp<pid>`,
hidden) are never read, and a file must have been left alone for `settle_s` seconds. Done-ness is keyed by file
identity (size + mtime), not by name: `last.ckpt` is replaced at every save and is then a new checkpoint. After each
evaluation (or skip) a marker `<ckpt>.eval/done.json` records that identity, the checkpoint's global step and a
`tag` (the evaluator names), so a restarted watcher skips finished work and a new set of evaluators redoes it. Checkpoints of a step already evaluated (`last.ckpt` and `step000006.ckpt`
saved together hold the same state) are marked `same_as` the first one instead of being evaluated again.
A corrupt or truncated file is logged once (per identity) and the watcher goes on.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from callbacks.checkpoint import CorruptCheckpointError, load_checkpoint

log = logging.getLogger(__name__)

EvaluateFn = Callable[[Path, dict], dict]  # (checkpoint path, loaded checkpoint) -> {metric: value}


def results_dir(ckpt: str | Path) -> Path:
    """Where a checkpoint's evaluation results go: `<ckpt>.eval/` beside it."""
    ckpt = Path(ckpt)
    return ckpt.with_name(ckpt.name + ".eval")


def file_identity(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically (temporary name, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def read_marker(ckpt: Path) -> dict | None:
    try:
        return json.loads((results_dir(ckpt) / "done.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class Watcher:
    """Scans `ckpt_dir` and hands each new, settled checkpoint to `evaluate_fn` once."""

    def __init__(
        self,
        ckpt_dir: str | Path,
        evaluate_fn: EvaluateFn,
        settle_s: float = 1.0,
        tag: list[str] | None = None,
    ):
        self.ckpt_dir, self.evaluate_fn, self.settle_s = Path(ckpt_dir), evaluate_fn, settle_s
        self.tag = list(tag or [])
        self.failed: dict[Path, dict] = {}  # path -> identity that failed: not retried until the file changes
        self.steps_done: dict[int, str] = {}  # global step -> name of the checkpoint evaluated at that step
        for marker in sorted(self.ckpt_dir.glob("*.ckpt.eval/done.json")):
            done = json.loads(marker.read_text())
            if done.get("tag") == self.tag:
                self.steps_done.setdefault(int(done["global_step"]), marker.parent.name.removesuffix(".eval"))

    def pending(self) -> list[Path]:
        """Settled checkpoints whose current identity has no marker yet, oldest first."""
        if not self.ckpt_dir.is_dir():
            return []
        found = []
        now = time.time()
        for path in self.ckpt_dir.glob("*.ckpt"):
            if path.name.startswith(".") or not path.is_file():
                continue
            try:
                ident = file_identity(path)
            except FileNotFoundError:  # removed by top-k rotation meanwhile
                continue
            marker = read_marker(path) or {}
            done = marker.get("identity") == ident and marker.get("tag") == self.tag
            if done or self.failed.get(path) == ident:
                continue
            if now - ident["mtime_ns"] / 1e9 >= self.settle_s:
                found.append((ident["mtime_ns"], path))
        return [p for _, p in sorted(found)]

    def mark_done(self, path: Path, ident: dict, step: int, **info) -> None:
        write_json(
            results_dir(path) / "done.json", {"identity": ident, "global_step": step, "tag": self.tag, **info}
        )

    def scan(self) -> list[Path]:
        """Evaluate every pending checkpoint; returns the ones evaluated (not those skipped or failed)."""
        evaluated = []
        for path in self.pending():
            try:
                ident = file_identity(path)
                checkpoint = load_checkpoint(path)
            except FileNotFoundError:
                continue
            except CorruptCheckpointError as e:
                log.error("Skipping checkpoint: %s", e)
                self.failed[path] = ident
                continue
            step = int(checkpoint.get("global_step", -1))
            if step in self.steps_done:
                log.info("%s: step %d was already evaluated (%s)", path.name, step, self.steps_done[step])
                self.mark_done(path, ident, step, same_as=self.steps_done[step])
                continue
            log.info("Evaluating %s (global step %d)", path, step)
            (results_dir(path) / "done.json").unlink(missing_ok=True)
            try:
                metrics = self.evaluate_fn(path, checkpoint)
            except Exception:
                log.exception("Evaluating %s failed; the watcher goes on", path)
                self.failed[path] = ident
                continue
            self.mark_done(path, ident, step, metrics=metrics)
            self.steps_done[step] = path.name
            evaluated.append(path)
        return evaluated


def watch(
    ckpt_dir: str | Path,
    evaluate_fn: EvaluateFn,
    poll_s: float = 30.0,
    timeout_s: float | None = None,
    once: bool = False,
    settle_s: float = 1.0,
    tag: list[str] | None = None,
) -> list[Path]:
    """Poll `ckpt_dir` every `poll_s` seconds; stop after one scan (`once`) or after `timeout_s` seconds without a
    new checkpoint (None: never). Returns the checkpoints evaluated."""
    watcher, evaluated = Watcher(ckpt_dir, evaluate_fn, settle_s, tag), []
    last_new = time.monotonic()
    log.info("Watching %s for new checkpoints (every %ss)", ckpt_dir, poll_s)
    while True:
        new = watcher.scan()
        evaluated += new
        if new:
            last_new = time.monotonic()
        if once:
            return evaluated
        if timeout_s is not None and time.monotonic() - last_new >= timeout_s:
            log.info("No new checkpoint for %ss; the watcher stops", timeout_s)
            return evaluated
        time.sleep(poll_s)
