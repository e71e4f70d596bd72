"""Curriculum datamodule: segment-count distribution, same-k unpadded batches, batches as pure functions of
(seed, stage, j) across re-creation and worker counts, stage changes on patience and step budget (held below a
target) inside one fit, exact continuation after resuming from a checkpoint, and every task/curriculum config
composing."""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint

from callbacks.memory_maps import fact_segments
from data.babilong import TASKS, make_sample
from data.curriculum import BabilongDataModule, CurriculumCallback, StageSampler, draw_segments
from data.heap import keep_freed_memory
from data.tokenizer import build_tokenizer
from models.config_errors import ConfigError
from tests.test_babilong import tiny_corpus

L_SEG = 64


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def make_dm(tok, cache, **kw) -> BabilongDataModule:
    args = dict(segment_size=L_SEG, schedule=(1, 2, 4), batch_size=3, n_train=60, n_val=2, n_test=2)
    return BabilongDataModule(tok, tiny_corpus(), cache_dir=cache, **(args | kw))


def fingerprint(batch: dict) -> tuple:
    return batch["n_segments"], tuple(batch["input_ids"].flatten().tolist())


@pytest.mark.parametrize("ratio,k_min", [(0.0, 1), (0.5, 1), (0.3, 2)])
def test_segment_counts_follow_uniform_with_mixed_share(ratio, k_min):
    n, draws = 6, 40000
    rng = np.random.default_rng(0)
    counts = np.bincount([draw_segments(rng, n, k_min, ratio) for _ in range(draws)], minlength=n + 1)
    expected = np.zeros(n + 1)
    expected[k_min:] = (1 - ratio) / (n - k_min + 1)
    expected[n] += ratio
    np.testing.assert_allclose(counts / draws, expected, atol=0.01)


def test_facts_only_share_takes_its_batches_first_and_draws_nothing_when_off():
    """facts_only_ratio r: 0 with probability r, the other batches as before; r = 0 draws the same k as a
    sampler without it (earlier runs keep their batches)."""
    rng, draws = np.random.default_rng(0), 40000
    counts = np.bincount([draw_segments(rng, 4, 1, 0.5, 0.25) for _ in range(draws)], minlength=5)
    np.testing.assert_allclose(counts / draws, [0.25, 0.75 / 8, 0.75 / 8, 0.75 / 8, 0.75 * 5 / 8], atol=0.01)
    a, b = np.random.default_rng(1), np.random.default_rng(1)
    assert [draw_segments(a, 4, 1, 0.3) for _ in range(50)] == [
        draw_segments(b, 4, 1, 0.3, 0.0) for _ in range(50)
    ]


def test_facts_only_share_repeats_stage_zero_and_needs_it(tok, cache):
    dm = make_dm(tok, cache, schedule=(0, 2), facts_only_ratio=0.5)
    ks = [dm.batch(2, j)["n_segments"] for j in range(40)]
    assert set(ks) == {0, 1, 2} and 10 <= ks.count(0) <= 30
    zero = next(j for j, k in enumerate(ks) if k == 0)
    assert not bool(dm.batch(2, zero)["attention_mask"].all())  # left-padded facts alone, as stage 0's
    with pytest.raises(ConfigError, match="has none: start it with 0"):
        make_dm(tok, cache, schedule=(1, 2), facts_only_ratio=0.5)
    with pytest.raises(ConfigError, match="facts_only_ratio 1.5 must lie in"):
        make_dm(tok, cache, schedule=(0, 2), facts_only_ratio=1.5)


def facts_in_last_segment(dm: BabilongDataModule, batch: dict) -> int:
    """Rows of a training batch whose last segment holds a whole fact of the training pool."""
    facts = {tuple(f.tolist()) for story in dm.pool("train").facts for f in story}
    rows = batch["input_ids"][:, -dm.segment_size :].numpy()
    return sum(
        any(tuple(row[a : a + len(f)].tolist()) == f for f in facts for a in range(len(row) - len(f) + 1))
        for row in rows
    )


def test_early_facts_rows_hold_every_fact_before_the_question_segment(tok, cache):
    """early_facts_ratio 1: no row of >= 2 segments has a fact in its last segment (the question's), where 0 puts
    one there in many rows; 0 draws the batches of a datamodule without it (earlier runs keep their data)."""
    args = dict(segment_size=128, schedule=(2, 3), batch_size=4)  # qa1's facts (<= 71 tokens) fit one segment
    early, plain = (make_dm(tok, cache, **args, early_facts_ratio=r) for r in (1.0, 0.0))
    long = [j for j in range(16) if early.batch(3, j)["n_segments"] >= 2]  # one segment: nowhere else to go
    assert len(long) >= 8
    assert sum(facts_in_last_segment(early, early.batch(3, j)) for j in long) == 0
    assert sum(facts_in_last_segment(plain, plain.batch(3, j)) for j in long) >= len(long)
    before = make_dm(tok, cache, **args)
    assert all(fingerprint(plain.batch(3, j)) == fingerprint(before.batch(3, j)) for j in range(12))
    with pytest.raises(ConfigError, match="early_facts_ratio -0.5 must lie in"):
        make_dm(tok, cache, early_facts_ratio=-0.5)


def test_facts_within_ends_every_fact_in_time_and_refuses_what_cannot_fit(tok, cache):
    """make_sample(facts_within=w): the last fact ends within the first w context tokens, whatever the draw."""
    dm = make_dm(tok, cache)
    tasks, haystack = dm.pool("train"), dm.haystack("train")
    for i in range(20):
        w = int(tasks.facts_len[i]) + 5
        for seed in range(5):
            ids = make_sample(
                tasks, i, haystack, np.random.default_rng(seed), length=300, facts_within=w
            ).input_ids
            first_w = [(0, 1 + w), (1 + w, len(ids))]  # BOS and the first w context tokens, then the rest
            assert fact_segments(ids, tasks.facts[i], first_w)[-1] == 1
    with pytest.raises(ValueError, match="cannot all end within the first 3 tokens"):
        make_sample(tasks, 0, haystack, np.random.default_rng(0), length=300, facts_within=3)


def test_batches_are_same_k_unpadded_and_exactly_k_segments(tok, cache):
    dm = make_dm(tok, cache, mixed_length_ratio=0.25)
    ks = []
    for j in range(60):
        b = dm.batch(4, j)
        k = b["n_segments"]
        ks.append(k)
        assert b["input_ids"].shape == (3, k * L_SEG) and bool(b["attention_mask"].all())
        assert (b["answer_mask"].sum(1) >= 2).all() and b["task"] == "qa1"
    assert set(ks) == {1, 2, 3, 4} and ks.count(4) > ks.count(1)


def test_a_token_budget_gives_long_batches_fewer_rows(tok, cache):
    """batch_tokens: rows = min(batch_size, budget // (k * segment_size)), at least one, each of k whole segments;
    still a function of the key; facts-only batches (qa1: one band of stories up to 128 tokens) get
    budget // 128 rows; a budget < 1 is refused."""
    dm = make_dm(tok, cache, schedule=(0, 4), batch_size=4, batch_tokens=2 * L_SEG)
    rows = {}
    for j in range(40):
        b = dm.batch(4, j)
        k = b["n_segments"]
        rows[k] = len(b["input_ids"])
        assert b["input_ids"].shape[1] == k * L_SEG and fingerprint(b) == fingerprint(dm.batch(4, j))
    assert rows == {1: 2, 2: 1, 3: 1, 4: 1}
    assert len(dm.batch(0, 0)["input_ids"]) == max(1, 2 * L_SEG // 128)
    assert (
        len(make_dm(tok, cache, schedule=(0, 4), batch_size=4, batch_tokens=3 * 128).batch(0, 0)["input_ids"])
        == 3
    )
    with pytest.raises(ConfigError, match="batch_tokens must be >= 1"):
        make_dm(tok, cache, batch_tokens=0)


def test_facts_only_stage_has_no_background_and_validates_on_facts_only(tok, cache):
    dm = make_dm(tok, cache, schedule=(0, 1, 2))
    pool = dm.pool("train")
    for j in range(5):
        b = dm.batch(0, j)
        assert b["n_segments"] == 0 and b["input_ids"].shape[0] == 3
        lengths = b["attention_mask"].sum(1).numpy()
        # each row is [bos] facts question prompt answer [eos] of some pool sample, and nothing else
        assert set(lengths) <= set((pool.facts_len + pool.extra_len).tolist())
        assert not bool(b["attention_mask"][:, -1].eq(0).any())  # left-padded
    assert dm.val_names[0] == "qa1/acc@0seg"
    val, pool_val = dm.val_dataloader()[0].dataset, dm.pool("validation")
    assert all(
        s.context_len == pool_len for s, pool_len in zip(val, pool_val.facts_len[: len(val)], strict=True)
    )
    assert dm.batch(1, 0)["input_ids"].shape == (3, L_SEG)
    with pytest.raises(ValueError, match="optionally after 0"):
        make_dm(tok, cache, schedule=(-1, 1))


def test_test_sets_by_segment_count_are_the_test_stories_at_exactly_k_segments(tok, cache):
    """test_segments (the recipe: its training lengths) adds test sets of exactly k segments, named as the
    validation ones, over the test stories and the corpus' test split, before the length grid; negative counts
    are refused."""
    dm = make_dm(tok, cache, n_val=4, n_test=4, test_segments=(0, 2), test_lengths=(1024,))
    assert dm.test_names == ["qa1/acc@0seg", "qa1/acc@2seg", "qa1/acc@1k"]
    facts, two, grid = dm.test_dataloader()
    test_pool = dm.pool("test")
    assert [s.context_len for s in facts.dataset] == test_pool.facts_len[: len(facts.dataset)].tolist()
    batch = next(iter(two))
    assert batch["n_segments"] == 2 and batch["input_ids"].shape == (4, 2 * L_SEG)
    val = next(iter(dm.val_dataloader()[1]))  # the validation set at 2 segments: other stories, other text
    assert val["n_segments"] == 2 and not torch.equal(val["input_ids"], batch["input_ids"])
    assert len(grid.dataset) == 4 and grid.dataset[0].context_len >= 1024
    with pytest.raises(ConfigError, match="segment counts must be >= 0"):
        make_dm(tok, cache, test_segments=(-1,))


def test_batch_j_is_a_function_of_seed_stage_and_j(tok, cache):
    a, b = make_dm(tok, cache), make_dm(tok, cache)
    assert fingerprint(a.batch(4, 7)) == fingerprint(b.batch(4, 7))
    seen = {fingerprint(a.batch(n, j)) for n in (2, 4) for j in range(10)}
    assert len(seen) == 20
    assert fingerprint(make_dm(tok, cache, seed=1).batch(4, 7)) != fingerprint(a.batch(4, 7))


def test_loader_gives_the_same_distinct_batches_with_and_without_workers(tok, cache):
    streams = []
    for workers in (0, 2):
        dm = make_dm(tok, cache, num_workers=workers)
        streams.append([fingerprint(b) for b in itertools.islice(dm.train_dataloader(), 8)])
    assert streams[0] == streams[1]
    assert len(set(streams[0])) == 8
    assert streams[0][5] == fingerprint(make_dm(tok, cache).batch(1, 5))


class WorkerRSS(torch.utils.data.Dataset):
    """One item: the resident memory (bytes) of the process that makes it."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker_rss(worker_init_fn) -> int:
    loader = torch.utils.data.DataLoader(
        WorkerRSS(), batch_size=None, num_workers=1, worker_init_fn=worker_init_fn
    )
    return next(iter(loader))


def test_loader_workers_do_not_hold_the_parents_freed_memory(tok, cache):
    """A forked worker shares the parent's freed-but-kept heap (keep_freed_memory); the datamodule's workers give
    it back, else a long stage's run holds its peak twice (two 2,048-segment runs side by side ran out of memory)."""
    if not Path("/proc/self/statm").exists() or not keep_freed_memory():
        pytest.skip("needs Linux with glibc")
    dm = make_dm(tok, cache, num_workers=1)
    x = torch.ones(128 << 20)  # 512 MB, freed into the parent's heap, which keeps it
    del x
    plain = worker_rss(None)
    for loader in (dm.train_dataloader(), *dm.val_dataloader()):
        assert plain - worker_rss(loader.worker_init_fn) > 400 << 20


def test_new_stage_starts_at_the_next_drawn_batch_and_replays_after_restore(tok, cache):
    dm = make_dm(tok, cache)
    keys = iter(StageSampler(dm))
    first = [next(keys) for _ in range(3)]
    assert dm.advance() and dm.max_segments == 2
    first += [next(keys) for _ in range(2)]
    assert first == [(1, 0), (1, 1), (1, 2), (2, 3), (2, 4)]
    restored = make_dm(tok, cache)
    restored.load_state_dict(dm.state_dict())
    assert restored.stage == 1 and list(itertools.islice(StageSampler(restored), 5)) == first
    assert dm.advance() and not dm.advance() and dm.stage == 2
    with pytest.raises(ValueError, match="schedule"):
        make_dm(tok, cache, schedule=(2, 4)).load_state_dict(dm.state_dict())


class Probe(L.LightningModule):
    """Records every training batch; logs a scripted validation accuracy (a function of the step)."""

    def __init__(self, score):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.score, self.seen = score, []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.global_step, fingerprint(batch)))
        return (self.w * batch["input_ids"].float().mean()).sum()

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        pass

    def on_validation_epoch_end(self):
        for name in self.trainer.datamodule.val_names:
            self.log(f"val/{name}", self.score(self.global_step), add_dataloader_idx=False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(dm, probe, max_steps, root, ckpt_path=None, checkpoint=False):
    callbacks = dm.callbacks() + ([ModelCheckpoint(root, "{step}", save_top_k=-1)] if checkpoint else [])
    trainer = L.Trainer(
        max_steps=max_steps, val_check_interval=2, check_val_every_n_epoch=None, limit_val_batches=1,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=checkpoint, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(probe, datamodule=dm, ckpt_path=ckpt_path)
    return trainer


def check_replay(dm, seen):
    """Every recorded batch is exactly batch j of the stage in force at j."""
    for step, fp in seen:
        assert fp == fingerprint(dm.batch(dm.schedule[dm.stage_at(step)], step))


def test_stage_advances_on_patience_inside_one_fit(tok, cache, tmp_path):
    dm = make_dm(tok, cache, callback=CurriculumCallback(patience=1))
    probe = Probe(lambda step: 0.5)  # never improves: each stage lasts patience + 1 = 2 validations
    trainer = fit(dm, probe, 12, tmp_path)
    assert dm.stage == 2 and len(dm.stage_starts) == 3
    # advanced after the validations at steps 4 and 8; batches already drawn (prefetched) keep the old stage
    assert 4 <= dm.stage_starts[1] <= 8 and 8 <= dm.stage_starts[2] <= 12
    assert trainer.callback_metrics["train/curriculum_segments"] == 4
    check_replay(dm, probe.seen)
    assert {k for _, (k, _) in probe.seen[: dm.stage_starts[1]]} == {1}


def test_each_finished_stage_leaves_a_checkpoint_of_its_end(tok, cache, tmp_path, caplog):
    dm = make_dm(tok, cache, callback=CurriculumCallback(patience=1))
    with caplog.at_level(logging.INFO):  # stages end at the validations of 4, 8
        fit(dm, Probe(lambda step: 0.5), 12, tmp_path, checkpoint=True)
    assert "weights_only" not in caplog.text  # saved as a full state on purpose, without Lightning's note
    names = sorted(p.name for p in tmp_path.glob("stage*.ckpt"))  # not the last stage: last.ckpt holds it
    assert names == [f"stage0-{dm.schedule[0]}seg.ckpt", f"stage1-{dm.schedule[1]}seg.ckpt"]
    for i, (name, step) in enumerate(zip(names, (4, 8), strict=True)):
        ckpt = torch.load(tmp_path / name, weights_only=False)
        assert ckpt["global_step"] == step
        assert ckpt["BabilongDataModule"]["stage"] == i  # saved before the stage advanced: resumes in it
        assert ckpt["optimizer_states"]  # the full state: a run resumes from it


def test_stage_advances_on_step_budget(tok, cache, tmp_path):
    dm = make_dm(tok, cache, callback=CurriculumCallback(patience=None, max_steps_per_stage=4))
    fit(dm, Probe(lambda step: step), 10, tmp_path)  # always improving: only the budget moves on
    assert dm.stage == 2 and 4 <= dm.stage_starts[1] <= 8 and 8 <= dm.stage_starts[2] <= 12


def test_stage_advances_on_its_own_budget(tok, cache, tmp_path):
    callback = CurriculumCallback(patience=None, max_steps_per_stage=[2, 6, 2])
    dm = make_dm(tok, cache, callback=callback)
    fit(dm, Probe(lambda step: step), 12, tmp_path)  # validations every 2 steps: stages end at steps 2 and 8
    assert dm.stage == 2 and callback.stage_start_step == 8
    assert 2 <= dm.stage_starts[1] <= 3 and 8 <= dm.stage_starts[2] <= 9  # + the batch fetched ahead


@pytest.mark.parametrize("name", ["max_steps_per_stage", "stage_targets"])
def test_budgets_or_targets_that_do_not_fit_the_schedule_are_refused(tok, cache, tmp_path, name):
    callback = CurriculumCallback(**{"patience": None, "max_steps_per_stage": 2, name: [2, 6]})
    dm = make_dm(tok, cache, callback=callback)
    with pytest.raises(
        ConfigError, match=rf"{name} \[2, 6\] has 2 entries for the 3 stages of the schedule \[1, 2, 4\]"
    ):
        fit(dm, Probe(lambda step: step), 4, tmp_path)


def test_a_stage_below_its_target_is_held_past_its_budget_and_patience(tok, cache, tmp_path, caplog):
    callback = CurriculumCallback(patience=1, max_steps_per_stage=2, stage_targets=[None, 0.8, 0.9])
    dm = make_dm(tok, cache, callback=callback)
    # validations every 2 steps; stage 1 (from step 2) spends its budget at step 4 and reaches 0.8 at step 8
    with caplog.at_level(logging.INFO):
        fit(dm, Probe(lambda step: step / 10), 12, tmp_path)
    assert dm.stage == 2 and callback.stage_start_step == 8  # the last stage's target has nothing to hold
    assert 2 <= dm.stage_starts[1] <= 3 and 8 <= dm.stage_starts[2] <= 9
    held = [line for line in caplog.messages if "held" in line]
    assert len(held) == 2 and "stage 1 (2 segments) held at step 6: val/qa1/acc@2seg = 0.600" in held[1]


def test_a_stage_that_never_reaches_its_target_lasts_to_max_steps(tok, cache, tmp_path):
    callback = CurriculumCallback(mode="min", patience=1, max_steps_per_stage=2, stage_targets=0.4)
    dm = make_dm(tok, cache, callback=callback)
    fit(dm, Probe(lambda step: 0.5), 10, tmp_path)  # mode min: at most 0.4, never reached
    assert dm.stage == 0 and dm.stage_starts == [0]


def test_resume_continues_stage_and_data_exactly(tok, cache, tmp_path):
    score = {2: 0.1, 4: 0.2, 6: 0.2, 8: 0.2, 10: 0.3, 12: 0.3, 14: 0.3, 16: 0.3}.get
    full_dm = make_dm(tok, cache, num_workers=2, callback=CurriculumCallback(patience=1))
    full = Probe(score)
    fit(full_dm, full, 16, tmp_path / "full", checkpoint=True)
    # stage 1 began after the validation at step 6, but the batches the workers had prefetched (up to after
    # the checkpoint at step 8) keep stage 0: the resumed run must replay them with stage 0 too
    assert full_dm.stage == 2 and full_dm.stage_starts[1] > 8

    resumed_dm = make_dm(tok, cache, num_workers=2, callback=CurriculumCallback(patience=1))
    resumed = Probe(score)
    fit(resumed_dm, resumed, 16, tmp_path / "resumed", ckpt_path=str(tmp_path / "full" / "step=8.ckpt"))
    assert resumed.seen[0][0] == 8 and resumed.seen == full.seen[8:]
    assert resumed_dm.state_dict() == full_dm.state_dict()


CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def build_from_config(tok, task: str, curriculum: str) -> BabilongDataModule:
    cfg = compose("train", overrides=[f"task={task}", f"curriculum={curriculum}", "backbone=tiny"])
    return instantiate(cfg.task)(tokenizer=tok, corpus=tiny_corpus())


def test_every_task_and_curriculum_config_builds_a_datamodule(tok):
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        for task in TASKS:
            dm = build_from_config(tok, task, "rmt")
            assert dm.task == task and dm.segment_size == 512 and dm.test_names[-1] == f"{task}/acc@128k"
        for curriculum, schedule in [
            ("rmt", (1, 2, 4, 6, 8, 16, 32)),
            ("rmt_r", (2, 4, 6, 8, 16, 32)),
            ("armt", (1, 2, 4, 6, 8, 16, 32)),
            ("fixed", (4,)),
            ("llama", (4,)),
            ("llama_xl", (4,)),
        ]:
            dm = build_from_config(tok, "qa1", curriculum)
            staged = curriculum in ("rmt", "rmt_r", "armt")
            assert dm.schedule == schedule and dm.val_names[-1] == f"qa1/acc@{schedule[-1]}seg"
            assert dm.mixed_length_ratio == (0.0 if staged else 1.0)
            callbacks = [type(c).__name__ for c in dm.callbacks()]
            assert callbacks == (["CurriculumCallback"] if staged else []) + ["BabilongHeatmap"]
