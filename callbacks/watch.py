"""Evaluate every new checkpoint of a training run exactly once (`evaluate.py watch=RUN_DIR`, `callbacks=eval_on_save`).

A checkpoint is a `*.ckpt` file in the checkpoint folder or in its `unevaluated/` subfolder (where training with
`callbacks.model_checkpoint.keep_unevaluated=true` keeps what it would otherwise replace or delete); temporary files
of the atomic writer (`.<name>.tmp<pid>`, hidden) are never read, and a file must have been left alone for `settle_s`
seconds. Done-ness is keyed by file identity (size + mtime), not by name: `last.ckpt` is replaced at every save and is
then a new checkpoint. After each evaluation (or skip) a marker `<ckpt>.eval/done.json` (with a streaming window W:
`<ckpt>.window<W>.eval/done.json`, beside the results it marks) records that identity, the
checkpoint's content hash (`state_digest`: weights, model config and step), its run id and global step, and a `tag`
(the evaluator names), so a restarted watcher skips finished work and a new set of evaluators redoes it. A checkpoint
whose content was already evaluated (`last.ckpt` and `step000006.ckpt` saved together) is marked `same_as` that one;
one of another run, or of a second run in the same folder, is its own. A kept file is deleted once done.

Checkpoints record the steps their run saved (`saved_steps`): a step of this run that was never evaluated and whose
file is gone (replaced or rotated away while the watcher was busy) is reported once as missed.
A corrupt or truncated file is logged once (per identity) and the watcher goes on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from callbacks.checkpoint import (
    KEPT_DIR,
    CorruptCheckpointError,
    file_identity,
    load_checkpoint,
    read_marker,
    results_dir,
    results_suffix,
)

log = logging.getLogger(__name__)

EvaluateFn = Callable[[Path, dict], dict]  # (checkpoint path, loaded checkpoint) -> {metric: value}


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically (temporary name, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def state_digest(checkpoint: dict) -> str:
    """Content identity of a checkpoint: a hash of its weights, model config and global step (equal for two files
    of one saved state, different for another run's checkpoint of the same step)."""
    config = checkpoint.get("config") or {}
    h = hashlib.blake2b(digest_size=16)
    head = {k: config.get(k) for k in ("tokenizer", "backbone", "model")} | {
        "step": checkpoint.get("global_step")
    }
    h.update(json.dumps(head, sort_keys=True, default=str).encode())
    for name, t in sorted(checkpoint.get("state_dict", {}).items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def run_of(checkpoint: dict) -> str | None:
    return (checkpoint.get("config") or {}).get("run_id")


class Watcher:
    """Scans `ckpt_dir` and hands each new, settled checkpoint to `evaluate_fn` once."""

    def __init__(
        self,
        ckpt_dir: str | Path,
        evaluate_fn: EvaluateFn,
        settle_s: float = 1.0,
        tag: list[str] | None = None,
        window: int | None = None,
    ):
        self.ckpt_dir, self.evaluate_fn, self.settle_s = Path(ckpt_dir), evaluate_fn, settle_s
        self.window = window  # evaluate.py window=W: results and markers in <ckpt>.window<W>.eval/
        self.tag = list(tag or [])
        self.failed: dict[Path, dict] = {}  # path -> identity that failed: not retried until the file changes
        self.contents: dict[str, str] = {}  # state digest -> name of the checkpoint evaluated with it
        self.steps: set[tuple[str | None, int]] = set()  # (run id, global step) evaluated
        self.missed: set[tuple[str | None, int]] = set()  # reported once
        suffix = results_suffix(window)
        for marker in sorted(self.ckpt_dir.glob(f"*.ckpt{suffix}/done.json")):  # also of files now gone
            done = json.loads(marker.read_text())
            if done.get("tag") == self.tag:
                self.contents.setdefault(done.get("content"), marker.parent.name.removesuffix(suffix))
                self.steps.add((done.get("run_id"), int(done["global_step"])))

    def pending(self) -> list[Path]:
        """Settled checkpoints whose current identity has no marker yet, oldest first."""
        found = []
        now = time.time()
        for path in [*self.ckpt_dir.glob("*.ckpt"), *(self.ckpt_dir / KEPT_DIR).glob("*.ckpt")]:
            if path.name.startswith(".") or not path.is_file():
                continue
            try:
                ident = file_identity(path)
            except FileNotFoundError:  # removed by top-k rotation meanwhile
                continue
            marker = read_marker(path, self.window) or {}
            done = marker.get("identity") == ident and marker.get("tag") == self.tag
            if done or self.failed.get(path) == ident:
                continue
            if now - ident["mtime_ns"] / 1e9 >= self.settle_s:
                found.append((ident["mtime_ns"], path))
        return [p for _, p in sorted(found)]

    def mark_done(self, path: Path, ident: dict, checkpoint: dict, content: str, **info) -> None:
        step, run = int(checkpoint.get("global_step", -1)), run_of(checkpoint)
        marker = {"identity": ident, "content": content, "run_id": run, "global_step": step, "tag": self.tag}
        write_json(results_dir(path, self.window) / "done.json", marker | info)
        self.steps.add((run, step))
        if path.parent.name == KEPT_DIR:  # kept for this watcher only
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # the folder goes once empty
                path.parent.rmdir()

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
            step, content = int(checkpoint.get("global_step", -1)), state_digest(checkpoint)
            self.report_missed(checkpoint)
            if content in self.contents:
                log.info(
                    "%s: its state (step %d) was already evaluated (%s)",
                    path.name,
                    step,
                    self.contents[content],
                )
                self.mark_done(path, ident, checkpoint, content, same_as=self.contents[content])
                continue
            log.info("Evaluating %s (global step %d)", path, step)
            (results_dir(path, self.window) / "done.json").unlink(missing_ok=True)
            try:
                metrics = self.evaluate_fn(path, checkpoint)
            except Exception:
                log.exception("Evaluating %s failed; the watcher goes on", path)
                self.failed[path] = ident
                continue
            self.mark_done(path, ident, checkpoint, content, metrics=metrics)
            self.contents[content] = path.name
            evaluated.append(path)
        return evaluated

    def report_missed(self, checkpoint: dict) -> None:
        """Warn once about earlier saves of this checkpoint's run that were never evaluated: their files are gone
        (pending files are evaluated oldest first, so an earlier save still on disk has been handled)."""
        run, step = run_of(checkpoint), int(checkpoint.get("global_step", -1))
        missed = [
            s
            for s in checkpoint.get("saved_steps", [])
            if s < step and (run, s) not in self.steps | self.missed
        ]
        if missed:
            self.missed |= {(run, s) for s in missed}
            log.warning(
                "Missed the checkpoints of step(s) %s (run %s): replaced or deleted before they could be evaluated "
                "(evaluation is slower than saving). Train with callbacks.model_checkpoint.keep_unevaluated=true to "
                "keep every checkpoint until the watcher has evaluated it.",
                ", ".join(map(str, missed)),
                run,
            )


def watch(
    ckpt_dir: str | Path,
    evaluate_fn: EvaluateFn,
    poll_s: float = 30.0,
    timeout_s: float | None = None,
    once: bool = False,
    settle_s: float = 1.0,
    tag: list[str] | None = None,
    window: int | None = None,
) -> list[Path]:
    """Poll `ckpt_dir` every `poll_s` seconds; stop after one scan (`once`) or after `timeout_s` seconds without a
    new checkpoint (None: never). Returns the checkpoints evaluated."""
    watcher, evaluated = Watcher(ckpt_dir, evaluate_fn, settle_s, tag, window), []
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
