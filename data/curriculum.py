"""BABILong datamodule with the RMT segment curriculum (Bulatov et al. 2022; Kuratov et al. 2024, App. A).

Stages over the maximum number of segments (RMT 1-2-4-6-8-16-32, RMT-R 2-4-6-8-16-32). In stage n every batch has
k segments of `segment_size` tokens, exactly k * segment_size tokens per sample (no padding), with k ~ U{k_min..n}
(k_min = 1 unless the task's shortest sample needs more), except that a share `mixed_length_ratio` of the batches
has exactly k = n, and a share `facts_only_ratio` of the batches of a later stage repeats stage 0's facts alone
(rehearsal: keeps a skill the backbone's warm start taught while it learns to search). Facts lie at random
sentence boundaries of the whole sample, so a short sample is often answered from its last segment alone; a share
`early_facts_ratio` of the rows of k >= 2 segments has every fact before the last segment (the question's), where
only memory can carry them (rows whose facts do not fit there stay as they are). A single-stage schedule
with ratio 1 is the plain mode: every sample has n segments. A batch has `batch_size` rows, or with a token
budget `batch_tokens` min(batch_size, batch_tokens // (k * segment_size)) (at least 1): a step of 32 segments then
costs about what one of 2 does.
Stage 0 (only first, e.g. [0, 1, 2]) is the easy start: the bAbI facts alone, no background (left-padded rows),
validated on facts-only samples as `acc@0seg`; the model learns the task before it learns to find the facts.

Data stream: an infinite sampler draws keys (n, j); training batch j of stage n is a pure function of
(seed, n, j), so any number of workers gives the same batches. `CurriculumCallback` advances the stage after a
validation when the monitored metric has not improved for `patience` validations, or when the stage has spent its
step budget; the new stage starts at the next key the sampler draws (batches the loader already prefetched keep
the old stage), and the datamodule records that index. Checkpoints hold the stage and these start indices; a
resumed run draws from `trainer.global_step * accumulate_grad_batches` on with the same stage per index, so it
sees exactly the batches of an uninterrupted run. Validation runs every `trainer.val_check_interval` batches.

Validation: one dataloader per segment count (`val/<task>/acc@<k>seg`) and per context length
(`val/<task>/acc@<length>`), over held-out background ("validation" split) with fixed seeds; test: sets of
exactly k segments (`test_segments`, e.g. the training lengths) and the length grid 0 (facts only), 1k, ..., 128k
(or more) over the "test" split, or the official BABILong data for the grid. `val_names` /
`test_names` name the loaders in order: log `f"val/{name}"` with `add_dataloader_idx=False`.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import lightning as L
import numpy as np
from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, Sampler

from data.babi import generate_task
from data.babilong import (
    Haystack,
    HaystackSet,
    OfficialSet,
    TaskTokens,
    check_task,
    collate,
    length_name,
    load_official,
    make_sample,
)
from data.corpus import Corpus
from data.heap import release_freed_memory
from data.sentences import SentenceStore, tokenize_sentences
from data.tokenizer import Tokenizer
from models.config_errors import ConfigError

RMT_SCHEDULE = (1, 2, 4, 6, 8, 16, 32)
DEFAULT_TEST_LENGTHS = (0, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
TRAIN, VALIDATION, TEST = 0, 1, 2  # seed-key tags of the three sample streams


def draw_segments(
    rng: np.random.Generator, n: int, k_min: int, mixed_length_ratio: float, facts_only_ratio: float = 0.0
) -> int:
    """Segments of one batch in stage n: 0 (facts only) with probability `facts_only_ratio`, else n with
    probability `mixed_length_ratio`, else k ~ U{k_min..n}. Stage 0 (facts only) gives 0."""
    if n == 0:
        return 0
    if facts_only_ratio and rng.random() < facts_only_ratio:  # no draw at 0: the batches of earlier runs
        return 0
    if rng.random() < mixed_length_ratio:
        return n
    return int(rng.integers(k_min, n + 1))


class CurriculumBatches(Dataset):
    """Training batch for key (n, j): same-k samples of exactly k * segment_size tokens, a function of (seed, n, j);
    k = 0: the facts alone (no background), left-padded to the longest row. Rows: `rows(k)`."""

    def __init__(
        self,
        tasks: TaskTokens,
        haystack: Haystack,
        segment_size: int,
        batch_size: int,
        mixed_length_ratio: float,
        seed: int,
        pad_id: int,
        context_loss: bool,
        task: str,
        batch_tokens: int | None = None,
        facts_only_ratio: float = 0.0,
        early_facts_ratio: float = 0.0,
    ):
        self.tasks, self.haystack, self.L, self.B = tasks, haystack, segment_size, batch_size
        self.batch_tokens = batch_tokens
        self.ratio, self.facts_only_ratio = mixed_length_ratio, facts_only_ratio
        self.early_facts_ratio = early_facts_ratio
        self.seed, self.task = seed, task
        self.pad_id, self.context_loss = pad_id, context_loss
        shortest = int((tasks.facts_len + tasks.extra_len).min())
        self.k_min = -(-shortest // segment_size)
        self._fitting: dict[int, np.ndarray] = {}

    def rows(self, k: int) -> int:
        """Rows of a batch of k segments: batch_size, or fewer where k segments of each exceed batch_tokens
        (facts-only batches, k = 0: by the length band of their stories, TaskTokens.draw_facts_only)."""
        if not k or self.batch_tokens is None:
            return self.B
        return max(1, min(self.B, self.batch_tokens // (k * self.L)))

    def fitting(self, k: int) -> np.ndarray:
        if k not in self._fitting:
            self._fitting[k] = self.tasks.fitting(total=k * self.L)
        return self._fitting[k]

    def __getitem__(self, key: tuple[int, int]) -> dict:
        n, j = key
        rng = np.random.default_rng([self.seed, TRAIN, n, j])
        k = draw_segments(rng, n, self.k_min, self.ratio, self.facts_only_ratio)
        if k == 0:
            idx = self.tasks.draw_facts_only(rng, self.B, self.batch_tokens)
            samples = [make_sample(self.tasks, int(i), self.haystack, rng, length=0) for i in idx]
            return collate(samples, self.pad_id, self.context_loss, n_segments=0, task=self.task)
        idx = rng.choice(self.fitting(k), size=self.rows(k))
        within = [None] * len(idx)
        if self.early_facts_ratio and k >= 2:  # no draw when off: earlier runs keep their batches
            before_last = (k - 1) * self.L - 1  # context tokens before the last segment (after BOS)
            early = (rng.random(len(idx)) < self.early_facts_ratio) & (
                self.tasks.facts_len[idx] <= before_last
            )
            within = [before_last if e else None for e in early]
        samples = [
            make_sample(self.tasks, int(i), self.haystack, rng, total=k * self.L, facts_within=w)
            for i, w in zip(idx, within, strict=True)
        ]
        return collate(samples, self.pad_id, self.context_loss, n_segments=k, task=self.task)


class StageSampler(Sampler):
    """Infinite keys (n, j): local batch k = j0, j0+1, ... of this rank, with the stage in force at k."""

    def __init__(self, datamodule: BabilongDataModule, rank: int = 0, world_size: int = 1):
        self.dm, self.rank, self.world_size = datamodule, rank, world_size

    def __iter__(self):
        k = self.dm.next_batch_index()
        while True:
            self.dm.drawn = k + 1
            yield self.dm.schedule[self.dm.stage_at(k)], k * self.world_size + self.rank
            k += 1


class BabilongDataModule(L.LightningDataModule):
    """BABILong task data: curriculum training batches, validation sets by segment count and length, test grid.

    `callbacks()` hands the trainer `callback` (a `CurriculumCallback`, or None for a fixed schedule) and the heat map
    of the test grid.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        corpus: Corpus,
        task: str = "qa1",
        segment_size: int = 512,
        schedule: Sequence[int] = RMT_SCHEDULE,
        mixed_length_ratio: float = 0.0,
        facts_only_ratio: float = 0.0,
        early_facts_ratio: float = 0.0,
        callback: CurriculumCallback | None = None,
        batch_size: int = 8,
        batch_tokens: int | None = None,
        n_train: int = 10000,
        n_val: int = 100,
        n_test: int = 1000,
        val_segments: Sequence[int] | None = None,
        val_lengths: Sequence[int] = (),
        test_lengths: Sequence[int] = DEFAULT_TEST_LENGTHS,
        test_segments: Sequence[int] = (),
        eval_batch_size: int = 8,
        num_workers: int = 0,
        seed: int = 0,
        eval_seed: int = 0,
        context_loss: bool = False,
        answer_prompt: str = "Answer:",
        official: str | None = None,
        cache_dir: str | None = None,
    ):
        super().__init__()
        self.task = check_task(task)
        self.schedule = tuple(int(n) for n in schedule)
        if not self.schedule or self.schedule[0] < 0 or list(self.schedule) != sorted(set(self.schedule)):
            raise ConfigError(
                f"schedule {list(self.schedule)} must be increasing segment counts >= 1, e.g. [1, 2, 4], "
                "optionally after 0 (facts only, no background): [0, 1, 2]"
            )
        for name, ratio in dict(
            mixed_length_ratio=mixed_length_ratio,
            facts_only_ratio=facts_only_ratio,
            early_facts_ratio=early_facts_ratio,
        ).items():
            if not 0.0 <= ratio <= 1.0:
                raise ConfigError(f"{name} {ratio} must lie in [0, 1]")
        if facts_only_ratio and 0 not in self.schedule:
            raise ConfigError(
                f"facts_only_ratio={facts_only_ratio} repeats stage 0 (the facts alone), but the schedule "
                f"{list(self.schedule)} has none: start it with 0, e.g. [0, 2], or set facts_only_ratio=0."
            )
        counts = dict(segment_size=segment_size, batch_size=batch_size, eval_batch_size=eval_batch_size)
        if batch_tokens is not None:
            counts["batch_tokens"] = batch_tokens
        for name, value in (counts | dict(n_train=n_train, n_val=n_val, n_test=n_test)).items():
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        self.val_segments = tuple(int(k) for k in (self.schedule if val_segments is None else val_segments))
        self.val_lengths, self.test_lengths = tuple(map(int, val_lengths)), tuple(map(int, test_lengths))
        self.test_segments = tuple(int(k) for k in test_segments)
        if (
            min((*self.val_segments, *self.test_segments), default=0) < 0
            or min((*self.val_lengths, *self.test_lengths), default=0) < 0
        ):
            raise ConfigError(
                "Evaluation segment counts must be >= 0 (0 = facts only) and lengths >= 0 tokens."
            )
        if not self.val_segments and not self.val_lengths:
            raise ConfigError("No validation set: give val_segments (null = the schedule) or val_lengths.")
        missing = sorted(set(self.schedule) - set(self.val_segments))
        if callback is not None and "{segments}" in callback.monitor and missing:
            raise ConfigError(
                f"The curriculum monitors each stage's accuracy, but val_segments has no set at {missing} "
                "segments; add them (val_segments=null validates every stage)."
            )
        self.tokenizer, self.corpus, self.callback = tokenizer, corpus, callback
        self.segment_size, self.batch_size, self.batch_tokens = segment_size, batch_size, batch_tokens
        self.mixed_length_ratio, self.facts_only_ratio = mixed_length_ratio, facts_only_ratio
        self.early_facts_ratio = early_facts_ratio
        self.n_train, self.n_val, self.n_test = n_train, n_val, n_test
        self.eval_batch_size, self.num_workers = eval_batch_size, num_workers
        self.seed, self.eval_seed, self.context_loss = seed, eval_seed, context_loss
        self.answer_prompt, self.official, self.cache_dir = answer_prompt, official, cache_dir
        self.stage = 0
        self.stage_starts = [0]  # local batch index at which each stage began
        self.drawn = 0  # local batches the sampler has drawn so far
        self._stores: dict[str, SentenceStore] | None = None
        self._haystacks: dict[str, Haystack] = {}
        self._pools: dict[str, TaskTokens] = {}
        self._train: CurriculumBatches | None = None

    def callbacks(self) -> list[Callback]:
        """The curriculum (if any) and the heat map of the test grid (`train.py test=true`)."""
        from callbacks.babilong_eval import BabilongHeatmap

        return [*([self.callback] if self.callback is not None else []), BabilongHeatmap("test")]

    @property
    def monitor(self) -> tuple[str, str]:
        """Metric and mode for the best checkpoint: accuracy on the last (longest) validation set."""
        return f"val/{self.val_names[-1]}", "max"

    # ---- curriculum state -----------------------------------------------------------------------------
    @property
    def max_segments(self) -> int:
        return self.schedule[self.stage]

    @property
    def last_stage(self) -> bool:
        return self.stage + 1 >= len(self.schedule)

    def stage_at(self, k: int) -> int:
        """The stage of local training batch k."""
        return bisect_right(self.stage_starts, k) - 1

    def advance(self) -> bool:
        """Move to the next stage from the next batch drawn on; False (and no change) in the last stage."""
        if self.last_stage:
            return False
        self.stage += 1
        self.stage_starts.append(max(self.drawn, self.next_batch_index(), self.stage_starts[-1]))
        rank_zero_info(f"Curriculum stage {self.stage}: up to {self.max_segments} segments per sample")
        return True

    def state_dict(self) -> dict:
        return {"stage": self.stage, "stage_starts": list(self.stage_starts), "schedule": list(self.schedule)}

    def load_state_dict(self, state: dict) -> None:
        if list(state["schedule"]) != list(self.schedule):
            raise ConfigError(
                f"The checkpoint's curriculum schedule {state['schedule']} differs from {list(self.schedule)}; "
                "resume with the same curriculum.schedule."
            )
        self.stage, self.stage_starts = int(state["stage"]), [int(k) for k in state["stage_starts"]]

    def next_batch_index(self) -> int:
        """Local index of the next training batch: optimizer steps so far times batches per step."""
        t = self.trainer
        return t.global_step * t.accumulate_grad_batches if t is not None else 0

    # ---- data -----------------------------------------------------------------------------------------
    def haystack(self, split: str) -> Haystack:
        """Background of one split (sentences split, tokenized and cached on first use)."""
        if split not in self._haystacks:
            if self._stores is None:
                self._stores = tokenize_sentences(self.corpus, self.tokenizer, self.cache_dir)
            self._haystacks[split] = Haystack(self._stores[split], split)
        return self._haystacks[split]

    def pool(self, split: str) -> TaskTokens:
        """bAbI samples of the task for one split: `n_train` / `n_val` / `n_test`, each from its own seed."""
        if split not in self._pools:
            tag, seed, n = {
                "train": (TRAIN, self.seed, self.n_train),
                "validation": (VALIDATION, self.eval_seed, self.n_val),
                "test": (TEST, self.eval_seed, self.n_test),
            }[split]
            babi_seed = int(np.random.SeedSequence([seed, tag]).generate_state(1)[0])
            samples = generate_task(self.task, n=n, seed=babi_seed)
            self._pools[split] = TaskTokens(samples, self.tokenizer, self.answer_prompt)
        return self._pools[split]

    def setup(self, stage: str | None = None) -> None:
        if stage not in (None, "fit") or self._train is not None:
            return
        self._train = CurriculumBatches(
            self.pool("train"),
            self.haystack("train"),
            self.segment_size,
            self.batch_size,
            self.mixed_length_ratio,
            self.seed,
            self.tokenizer.pad_id,
            self.context_loss,
            self.task,
            self.batch_tokens,
            self.facts_only_ratio,
            self.early_facts_ratio,
        )
        first = next((n for n in self.schedule if n > 0), None)
        if first is not None and self._train.k_min > first:
            raise ConfigError(
                f"{self.task}: the shortest sample needs {self._train.k_min} segments of {self.segment_size} "
                f"tokens, but the schedule's first background stage has {first}. Start it at "
                f"{self._train.k_min} or raise the segment size."
            )

    def batch(self, n: int, j: int) -> dict:
        """Training batch j of the stage with up to n segments (what the train dataloader yields for key (n, j))."""
        self.setup("fit")
        return self._train[(n, j)]

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        t = self.trainer
        if t is not None and len(self.schedule) > 1 and not isinstance(t.val_check_interval, int):
            raise ConfigError(
                "The curriculum advances after validations of an infinite training stream: set "
                "trainer.val_check_interval to a number of batches and trainer.check_val_every_n_epoch=null."
            )
        rank, world = (t.global_rank, t.world_size) if t is not None else (0, 1)
        sampler = StageSampler(self, rank, world)
        return DataLoader(
            self._train,
            batch_size=None,
            sampler=sampler,
            num_workers=self.num_workers,
            worker_init_fn=release_freed_memory,
        )

    # ---- evaluation -----------------------------------------------------------------------------------
    @property
    def val_names(self) -> list[str]:
        return self._set_names(self.val_segments, self.val_lengths)

    @property
    def test_names(self) -> list[str]:
        return self._set_names(self.test_segments, self.test_lengths)

    def _set_names(self, segments: Sequence[int], lengths: Sequence[int]) -> list[str]:
        """Names of the evaluation sets in loader order: by segment count, then by context length."""
        return [f"{self.task}/acc@{k}seg" for k in segments] + [
            f"{self.task}/acc@{length_name(n)}" for n in lengths
        ]

    def eval_loader(self, dataset: Dataset, **meta) -> DataLoader:
        """Evaluation batches of `dataset` (its samples collated, `meta` added to each batch)."""
        pad, loss = self.tokenizer.pad_id, self.context_loss
        fn = partial(collate, pad_id=pad, context_loss=loss, task=self.task, **meta)
        return DataLoader(
            dataset,
            batch_size=self.eval_batch_size,
            collate_fn=fn,
            num_workers=self.num_workers,
            worker_init_fn=release_freed_memory,
        )

    def _generated(self, split: str, n: int, length: int | None = None, segments: int | None = None):
        """Fixed evaluation set of `split`: sample i is a function of (eval_seed, split, size, i)."""
        key = [self.eval_seed, VALIDATION if split == "validation" else TEST]
        key += [1, length] if segments is None else [0, segments]
        if segments == 0:  # facts only
            segments, length = None, 0
        total = None if segments is None else segments * self.segment_size
        return HaystackSet(self.pool(split), self.haystack(split), key, n, length=length, total=total)

    def _by_segments(self, split: str, n: int, segments: Sequence[int]) -> list[DataLoader]:
        """Loaders of the fixed sets of `split` with exactly k segments, one per k."""
        return [self.eval_loader(self._generated(split, n, segments=k), n_segments=k) for k in segments]

    def val_dataloader(self) -> list[DataLoader]:
        by_segments = self._by_segments("validation", self.n_val, self.val_segments)
        by_length = [
            self.eval_loader(self._generated("validation", self.n_val, length=n), length=n)
            for n in self.val_lengths
        ]
        return by_segments + by_length

    def test_set(self, length: int) -> Dataset:
        """The `n_test` test samples with `length` context tokens: the official rows, or generated ones (a
        `HaystackSet`: sample i is fixed by eval_seed)."""
        if self.official:
            rows = load_official(self.official, self.task, length)
            return OfficialSet(rows, self.tokenizer, self.answer_prompt, self.n_test)
        return self._generated("test", self.n_test, length=length)

    def test_dataloader(self) -> list[DataLoader]:
        by_length = [self.eval_loader(self.test_set(n), length=n) for n in self.test_lengths]
        return self._by_segments("test", self.n_test, self.test_segments) + by_length


class CurriculumCallback(Callback):
    """Advances the datamodule's curriculum after a validation when the monitored metric has not improved for
    `patience` validations, or when the stage has run `max_steps_per_stage` optimizer steps (None: no budget; a list:
    one budget per stage of the schedule).

    With `stage_targets` (a number, or one per stage, null for none) a stage is not left before its monitored metric
    reaches its target (at most the target with mode "min"): neither patience nor the budget moves it on until then,
    and `trainer.max_steps` still ends the run, so a seed that has not yet learned a stage gets longer in it.
    `monitor` may name the stage: "val/{task}/acc@{segments}seg" reads the accuracy at the stage's segment count.
    With `stop_after_last_stage`, training stops when the last stage stops improving (the paper's early stopping).
    With `stage_checkpoints`, the state at the end of each stage but the last (which last.ckpt holds) is kept as
    `stage<i>-<n>seg.ckpt` beside the run's checkpoints, so each stage's model can be evaluated on the length grid.
    Logs `train/curriculum_stage` (index) and `train/curriculum_segments` (the stage's maximum) every step.
    """

    def __init__(
        self,
        monitor: str = "val/{task}/acc@{segments}seg",
        mode: str = "max",
        patience: int | None = 3,
        min_delta: float = 0.0,
        max_steps_per_stage: int | Sequence[int] | None = None,
        stop_after_last_stage: bool = False,
        stage_checkpoints: bool = True,
        stage_targets: float | Sequence[float | None] | None = None,
    ):
        if mode not in ("max", "min"):
            raise ConfigError(f"mode {mode!r} must be 'max' or 'min'")
        if patience is None and max_steps_per_stage is None:
            raise ConfigError(
                "Give patience, max_steps_per_stage or both, else the curriculum never advances."
            )
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, min_delta
        self.max_steps_per_stage, self.stop_after_last_stage = max_steps_per_stage, stop_after_last_stage
        self.stage_checkpoints, self.stage_targets = stage_checkpoints, stage_targets
        self.best: float | None = None
        self.wait = 0
        self.stage_start_step = 0

    @staticmethod
    def _datamodule(trainer: L.Trainer) -> BabilongDataModule:
        dm = trainer.datamodule
        if not isinstance(dm, BabilongDataModule):
            raise TypeError(f"CurriculumCallback needs a BabilongDataModule, got {type(dm).__name__}")
        return dm

    def on_fit_start(self, trainer, pl_module) -> None:
        dm = self._datamodule(trainer)  # lists of budgets or targets that do not fit the schedule fail here
        self._per_stage(self.max_steps_per_stage, "max_steps_per_stage", dm)
        self._per_stage(self.stage_targets, "stage_targets", dm)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        dm = self._datamodule(trainer)
        pl_module.log("train/curriculum_stage", float(dm.stage))
        pl_module.log("train/curriculum_segments", float(dm.max_segments))

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        dm = self._datamodule(trainer)
        sign = 1.0 if self.mode == "max" else -1.0
        stalled = False
        if self.patience is not None:
            value = self._value(trainer, dm)
            if self.best is None or sign * (value - self.best) > self.min_delta:
                self.best, self.wait = value, 0
            else:
                self.wait += 1
            stalled = self.wait >= self.patience
        budget = self._per_stage(self.max_steps_per_stage, "max_steps_per_stage", dm)
        spent = budget is not None and trainer.global_step - self.stage_start_step >= budget
        if not (stalled or spent):
            return
        target = self._per_stage(self.stage_targets, "stage_targets", dm)
        if target is not None and not dm.last_stage:
            value = self._value(trainer, dm)
            if sign * (value - target) < 0:
                rank_zero_info(
                    f"Curriculum stage {dm.stage} ({dm.max_segments} segments) held at step {trainer.global_step}: "
                    f"{self._key(dm)} = {value:.3f} has not reached its target {target}"
                )
                return
        if self.stage_checkpoints and trainer.checkpoint_callback is not None and not dm.last_stage:
            name = f"stage{dm.stage}-{dm.max_segments}seg.ckpt"
            path = Path(trainer.checkpoint_callback.dirpath) / name
            trainer.save_checkpoint(path, weights_only=False)  # the full state: resumable
        if dm.advance():
            self.best, self.wait, self.stage_start_step = None, 0, trainer.global_step
        elif stalled and self.stop_after_last_stage:
            trainer.should_stop = True

    def _key(self, dm: BabilongDataModule) -> str:
        return self.monitor.format(task=dm.task, segments=dm.max_segments)

    def _value(self, trainer: L.Trainer, dm: BabilongDataModule) -> float:
        """The monitored metric of the current stage, as last validated."""
        key = self._key(dm)
        if key not in trainer.callback_metrics:
            raise ConfigError(
                f"Curriculum monitor {key!r} was not logged; logged: {sorted(trainer.callback_metrics)}. "
                "Set curriculum.callback.monitor to one of them."
            )
        return float(trainer.callback_metrics[key])

    @staticmethod
    def _per_stage(values, name: str, dm: BabilongDataModule):
        """The current stage's entry of `values` (None, one number for every stage, or one per stage)."""
        if values is None or isinstance(values, int | float):
            return values
        if len(values) != len(dm.schedule):
            raise ConfigError(
                f"curriculum.callback.{name} {list(values)} has {len(values)} entries for the "
                f"{len(dm.schedule)} stages of the schedule {list(dm.schedule)}: give one per stage, or one number."
            )
        return values[dm.stage]

    def state_dict(self) -> dict:
        return {"best": self.best, "wait": self.wait, "stage_start_step": self.stage_start_step}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.wait, self.stage_start_step = state["best"], state["wait"], state["stage_start_step"]
