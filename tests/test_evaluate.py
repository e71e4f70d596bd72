"""evaluate.py: checkpoints rebuild the trained model, evaluators match reference computations, results and logs land
next to the checkpoint (W&B: the training run itself), export=hf gives a folder transformers loads with equal logits."""

import csv
import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize
from omegaconf import DictConfig, OmegaConf
from test_faults import compose_train, tiny_overrides
from torch import nn

from callbacks.checkpoint import load_checkpoint
from callbacks.fact_distance import distance_bucket as fact_distance_bucket
from callbacks.fact_distance import fact_distance
from callbacks.wrong_answers import KINDS, answer_kind, wrong_answers
from data.corpus import Corpus, Document
from data.curriculum import BabilongDataModule
from data.tokenizer import build_tokenizer
from evaluate import (
    autocast_context,
    babilong,
    early_facts_loader,
    evaluate,
    memory_maps,
    ppl,
    wandb_run_id,
    with_window,
)
from models.backbone import build_llama
from models.builders import auto_precision, build_run
from models.config_errors import ConfigError
from models.lm import CausalLM
from models.outputs import ModelOutput, scored_positions
from models.rmt import RMT
from models.rmt_retrieval import RMTRetrieval
from models.run_config import checkpoint_config
from train import train

WORDS = "red green blue small large old new quiet loud bright".split()
PLACES = "garden kitchen office hallway bedroom bathroom park station".split()


def sentences(doc: int, n: int) -> str:
    """n distinct plain-English sentences (document `doc`)."""
    return " ".join(
        f"The {WORDS[(doc + i) % 10]} {WORDS[(3 * i + doc) % 10]} cat number {doc * 1000 + i} walked to the "
        f"{PLACES[(doc * 7 + i) % 8]}."
        for i in range(n)
    )


def tiny_corpus(n_docs: int = 6, n_sentences: int = 30) -> Corpus:
    docs = [Document(f"doc{i}", sentences(i, n_sentences)) for i in range(n_docs)]
    return Corpus("tiny-eval", {"train": docs[:-2], "validation": docs[-2:-1], "test": docs[-1:]})


def compose_eval(overrides: list[str]) -> DictConfig:
    with initialize(config_path="../configs", version_base="1.3"):
        return compose(config_name="eval", overrides=overrides)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 4-step tiny run: (its folder, the Run with the in-memory trained model)."""
    run_dir = tmp_path_factory.mktemp("run")
    run = build_run(compose_train(tiny_overrides(run_dir, 4, 2)))
    run.trainer.fit(run.module, datamodule=run.datamodule)
    return run_dir, run


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMLM_CACHE", str(tmp_path / "cache"))


def test_ppl_matches_a_full_forward(tmp_path, cache):
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    backbone = build_llama(tokenizer.vocab_size, 32, 2, 4, 2, 64, 256)
    model = CausalLM(backbone, window=256).eval()
    corpus = tiny_corpus()
    max_len = 100
    result = ppl(model, tokenizer, corpus, tmp_path, split="test", max_len=max_len)

    doc = corpus.splits["test"][0].text
    ids = torch.tensor([tokenizer.bos_id, *tokenizer.encode(doc), tokenizer.eos_id][:max_len])[None]
    with torch.no_grad():
        nll = nn.functional.cross_entropy(backbone.logits(ids)[0, :-1], ids[0, 1:])
    torch.testing.assert_close(result["ppl/loss"], nll.item(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result["ppl"], nll.exp().item(), rtol=1e-5, atol=1e-6)
    saved = json.loads((tmp_path / "ppl.json").read_text())
    assert saved["n_tokens"] == max_len - 1 and saved["documents"][0]["document"] == "doc5"


def test_evaluating_a_checkpoint_rebuilds_the_trained_model(trained):
    run_dir, run = trained
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    args = {"max_len": 64, "max_docs": 2}
    metrics = evaluate(
        compose_eval([f"ckpt_path={ckpt}", "logger=csv", *[f"eval.ppl.{k}={v}" for k, v in args.items()]])
    )

    reference = ppl(run.module.model.eval(), run.tokenizer, run.datamodule.corpus, run_dir / "ref", **args)
    assert metrics == pytest.approx({f"eval/{k}": v for k, v in reference.items()}, rel=1e-6)
    results = run_dir / "checkpoints" / "last.ckpt.eval"
    assert json.loads((results / "metrics.json").read_text())["global_step"] == 4
    assert json.loads((results / "ppl" / "ppl.json").read_text())["ppl"] == pytest.approx(reference["ppl"])
    with open(run_dir / "eval" / "version_0" / "metrics.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert int(row["step"]) == 4 and float(row["eval/ppl"]) == pytest.approx(reference["ppl"])


def test_metrics_go_to_the_training_runs_wandb_run(trained, tmp_path):
    from lightning.pytorch.loggers import WandbLogger

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(
        (trained[0] / "checkpoints" / "last.ckpt").read_bytes()
    )
    training_logger = WandbLogger(project="memlm", save_dir=str(run_dir), offline=True)
    run_id = training_logger.experiment.id
    training_logger.experiment.finish()
    assert wandb_run_id(run_dir) == run_id

    evaluate(
        compose_eval(
            [f"ckpt_path={run_dir}/checkpoints/last.ckpt", "eval.ppl.max_len=32", "eval.ppl.max_docs=1"]
        )
    )
    runs = sorted(
        (run_dir / "wandb").glob("offline-run-*")
    )  # `...-<id>-1` when both start in the same second
    assert len(runs) == 2 and all((run / f"run-{run_id}.wandb").is_file() for run in runs)
    assert wandb_run_id(run_dir) == run_id  # the continued run's folder gives the same id
    assert (run_dir / "eval" / "version_0" / "metrics.csv").is_file()  # CSV as well


class Oracle(nn.Module):
    """Predicts every scored target (so exact match is 1), except for the tasks in `wrong` (exact match 0)."""

    def __init__(self, vocab_size: int, wrong: tuple[str, ...] = ()):
        super().__init__()
        self.vocab_size, self.wrong = vocab_size, wrong
        self.anchor = nn.Parameter(torch.zeros(()))  # gives the model a device
        self.seen: list[tuple[str, int]] = []

    def forward(self, batch: dict) -> ModelOutput:
        targets = batch["labels"][scored_positions(batch["labels"])]
        predicted = (targets + 1) % self.vocab_size if batch["task"] in self.wrong else targets
        self.seen.append((batch["task"], int(batch["attention_mask"].sum(1).min())))
        return ModelOutput(nn.functional.one_hot(predicted, self.vocab_size).float(), targets)


def test_window_streams_a_checkpointed_lm_through_a_longer_window(trained, tmp_path):
    """window= evaluates a checkpoint with more context than its training length (32 tokens here); the models
    the papers measure past their training length see it all. Was: model.window= was silently ignored. Its results
    go to <ckpt>.window96.eval beside the plain ones (was: into <ckpt>.eval, over them), and compare= tells them apart."""
    run_dir, run = trained
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    args = {"max_len": 96, "max_docs": 2}
    overrides = [f"ckpt_path={ckpt}", "logger=csv", *[f"eval.ppl.{k}={v}" for k, v in args.items()]]
    curve = [
        "eval.forgetting_curve.max_len=16",
        "eval.forgetting_curve.n_lengths=2",
        "eval.forgetting_curve.n_samples=2",
    ]
    plain = evaluate(compose_eval([*overrides, "eval=[ppl,forgetting_curve]", *curve]))
    metrics = evaluate(compose_eval([*overrides, "eval=[ppl,forgetting_curve]", *curve, "window=96"]))
    full = CausalLM(run.module.model.backbone, window=96).eval()
    reference = ppl(full, run.tokenizer, run.datamodule.corpus, tmp_path / "ref", **args)
    windowed_ppl = {k: v for k, v in metrics.items() if k.startswith("eval/ppl")}
    assert windowed_ppl == pytest.approx({f"eval/{k}": v for k, v in reference.items()}, rel=1e-6)
    windowed = ppl(run.module.model.eval(), run.tokenizer, run.datamodule.corpus, tmp_path / "w32", **args)
    # the training window would have given another number
    assert abs(windowed["ppl"] - reference["ppl"]) > 1e-3
    saved = {
        name: json.loads((ckpt.parent / name / "metrics.json").read_text())["metrics"]
        for name in ("last.ckpt.eval", "last.ckpt.window96.eval")
    }
    assert saved == {"last.ckpt.eval": plain, "last.ckpt.window96.eval": metrics}
    folders = f"[{ckpt}.eval,{ckpt}.window96.eval]"
    evaluate(compose_eval([f"compare={folders}", f"out_dir={tmp_path / 'cmp'}"]))
    rows = json.loads((tmp_path / "cmp" / "comparison.json").read_text())["models"]
    assert [(r["model"], r["ppl"]) for r in rows] == [
        (f"{run_dir.name}@last", plain["eval/ppl"]),
        (f"{run_dir.name}@last+window96", metrics["eval/ppl"]),
    ]
    again = [f"compare=[{ckpt}]", "window=96", "eval=[ppl,forgetting_curve]", *curve, *overrides[1:]]
    # a checkpoint evaluated within compare=
    evaluate(compose_eval([*again, f"out_dir={tmp_path / 'again'}"]))
    rows = json.loads((tmp_path / "again" / "comparison.json").read_text())["models"]
    assert [(r["model"], r["ppl"]) for r in rows] == [(f"{run_dir.name}+window96", metrics["eval/ppl"])]


def test_window_runs_a_llama_xl_checkpoint_without_its_cache(tmp_path):
    """window=W on a Llama-XL checkpoint streams its backbone (key norm and all) as a plain LM: positions below
    segment + cache score exactly as in the XL (its second segment's cache is the first segment, computed without
    a cache), later ones differ by what the cached states carried from further back."""
    run_dir = tmp_path / "xl"
    overrides = tiny_overrides(run_dir, 2, 2, "model=llama_xl", "model.segment_size=16")
    train(compose_train(overrides))
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    by_position = [
        "eval=[ppl_by_position]",
        "eval.ppl_by_position.max_len=96",
        "eval.ppl_by_position.kind=linear",
    ]
    by_position += ["eval.ppl_by_position.n_bins=6", "logger=csv", f"ckpt_path={ckpt}"]
    evaluate(compose_eval(by_position))
    evaluate(compose_eval([*by_position, "window=32"]))
    xl, windowed = (
        json.loads((ckpt.parent / name / "ppl_by_position" / "ppl_by_position.json").read_text())
        for name in ("last.ckpt.eval", "last.ckpt.window32.eval")
    )
    assert xl["edges"][:3] == [1, 17, 33]
    assert windowed["nll_sum"][:2] == pytest.approx(xl["nll_sum"][:2], rel=1e-6)  # positions 1-32
    assert all(abs(a - b) > 1e-4 for a, b in zip(xl["nll_sum"][2:], windowed["nll_sum"][2:], strict=True))
    config = with_window(checkpoint_config(load_checkpoint(ckpt), ckpt), 32, ckpt)
    assert config.model._target_ == "models.lm.build_causal_lm" and config.model.backbone.key_norm is True


def test_window_sets_a_plain_lms_window_and_is_refused_for_a_model_without_one():
    config = OmegaConf.create({"model": {"_target_": "models.rmt.build_rmt", "num_memory": 2}})
    with pytest.raises(
        ConfigError, match=r"window=512 sets a plain LM's .* \(models.rmt.build_rmt\); drop window="
    ):
        with_window(config, 512, "x.ckpt")
    assert with_window(config, None, "x.ckpt") is config
    pretrained = with_window(compose_eval(["backbone=smollm2_135m", "window=64"]), 64, "the pretrained model")
    assert (pretrained.model.window, pretrained.model.stride) == (64, None)  # evaluate.py's own model too


def test_babilong_grid_scores_each_task_and_length(tmp_path, cache):
    tokenizer = build_tokenizer()
    model = Oracle(tokenizer.vocab_size, wrong=("qa2",))
    lengths = (0, 200)
    metrics = babilong(
        model, tokenizer, tiny_corpus(), tmp_path, tasks=("qa1", "qa2"), lengths=lengths, n=3, batch_size=2
    )
    assert metrics == {
        "babilong/qa1/acc@0k": 1.0,
        "babilong/qa1/acc@200": 1.0,
        "babilong/qa2/acc@0k": 0.0,
        "babilong/qa2/acc@200": 0.0,
        "babilong/acc": 0.5,
    }
    assert min(n for task, n in model.seen[2:4]) > 200  # qa1 at length 200: context of 200 tokens + question
    saved = json.loads((tmp_path / "babilong.json").read_text())
    assert saved["accuracy"] == {"qa1": {"0k": 1.0, "200": 1.0}, "qa2": {"0k": 0.0, "200": 0.0}}
    assert (tmp_path / "heatmap.png").stat().st_size > 0


def test_babilong_memory_reset_runs_the_ablation_and_refuses_models_without_memory(tmp_path, cache):
    tokenizer = build_tokenizer()
    model = RMT(build_llama(tokenizer.vocab_size, 32, 1, 2, 2, 64, 512), num_memory=2, segment_size=64).eval()
    kwargs = dict(tasks=("qa1",), lengths=(0, 200), n=4, batch_size=2)
    reset = babilong(model, tokenizer, tiny_corpus(), tmp_path, memory="reset", **kwargs)
    assert set(reset) == {"babilong_reset/qa1/acc@0k", "babilong_reset/qa1/acc@200", "babilong_reset/acc"}
    assert json.loads((tmp_path / "babilong_reset.json").read_text())["memory"] == "reset"
    assert (tmp_path / "heatmap_reset.png").is_file() and not (tmp_path / "babilong.json").exists()
    with pytest.raises(ConfigError, match="Oracle has no memory to reset"):
        babilong(Oracle(tokenizer.vocab_size), tokenizer, tiny_corpus(), tmp_path, memory="reset", **kwargs)
    with pytest.raises(ConfigError, match="memory=forgetful: use carried"):
        babilong(model, tokenizer, tiny_corpus(), tmp_path, memory="forgetful", **kwargs)


def test_babilong_memory_latest_retrieves_from_rmt_rs_latest_state_alone_and_refuses_rmt(tmp_path, cache):
    """eval.babilong.memory=latest: RMT-R's retrieval sees one state (m bank entries) at every segment, the scores go
    to babilong_latest; RMT, which does not retrieve, is refused."""
    tokenizer = build_tokenizer()
    bb = build_llama(tokenizer.vocab_size, 32, 1, 2, 2, 64, 512)
    model = RMTRetrieval(bb, num_memory=2, segment_size=64).eval()
    banks = []
    model.retrieval.register_forward_pre_hook(lambda mod, args: banks.append(args[1].states.shape[1]))
    kwargs = dict(tasks=("qa1",), lengths=(200,), n=2, batch_size=2)
    latest = babilong(model, tokenizer, tiny_corpus(), tmp_path, memory="latest", **kwargs)
    assert set(latest) == {"babilong_latest/qa1/acc@200", "babilong_latest/acc"} and not model.latest_only
    assert len(banks) >= 4 and set(banks) == {2}  # 200 context tokens and the question: 4 segments
    assert json.loads((tmp_path / "babilong_latest.json").read_text())["memory"] == "latest"
    banks.clear()
    babilong(model, tokenizer, tiny_corpus(), tmp_path, **kwargs)
    assert banks[:4] == [2, 4, 6, 8]  # carried: every past state
    rmt = RMT(bb, num_memory=2, segment_size=64)
    with pytest.raises(ConfigError, match="memory=latest limits RMT-R's retrieval .* RMT does not retrieve"):
        babilong(rmt, tokenizer, tiny_corpus(), tmp_path, memory="latest", **kwargs)


def test_babilong_adds_cells_to_an_earlier_evaluation_of_the_same_weights_only(tmp_path, cache):
    """A later run of the same checkpoint and settings adds its lengths to babilong.json, with their own sample
    counts (the 1M column can come later, with fewer samples); other weights, or other settings, start afresh."""
    tokenizer = build_tokenizer()
    model = RMT(build_llama(tokenizer.vocab_size, 32, 1, 2, 2, 64, 512), num_memory=2, segment_size=64).eval()
    kwargs = dict(tasks=("qa1",), batch_size=2)
    read = lambda: json.loads((tmp_path / "babilong.json").read_text())  # noqa: E731
    saved = lambda: read()["accuracy"]  # noqa: E731
    first = babilong(model, tokenizer, tiny_corpus(), tmp_path, lengths=(0,), n=4, **kwargs)
    later = babilong(model, tokenizer, tiny_corpus(), tmp_path, lengths=(200,), n=2, **kwargs)
    assert set(later) == {"babilong/qa1/acc@200", "babilong/acc"}  # this run's cells are the metrics
    assert saved() == {"qa1": {"0k": first["babilong/qa1/acc@0k"], "200": later["babilong/qa1/acc@200"]}}
    assert read()["samples"] == {"qa1": {"0k": 4, "200": 2}}
    kwargs["n"] = 2
    babilong(model, tokenizer, tiny_corpus(), tmp_path, lengths=(200,), seed=1, **kwargs)
    assert set(saved()["qa1"]) == {"200"}
    babilong(model, tokenizer, tiny_corpus(), tmp_path, lengths=(0,), seed=1, **kwargs)
    with torch.no_grad():
        model.memory.add_(1.0)
    babilong(model, tokenizer, tiny_corpus(), tmp_path, lengths=(200,), seed=1, **kwargs)
    assert set(saved()["qa1"]) == {"200"}


def test_early_facts_keeps_only_samples_whose_facts_precede_the_last_segment(tmp_path, cache):
    """eval.babilong.early_facts: every kept row holds each of its facts whole before its last segment (brute-force
    search over the row), the scores go to babilong_early_facts; models without segments are refused."""
    tokenizer = build_tokenizer()
    model = RMT(build_llama(tokenizer.vocab_size, 32, 1, 2, 2, 64, 512), num_memory=2, segment_size=64).eval()
    data = BabilongDataModule(tokenizer, tiny_corpus(), task="qa1", n_test=400, eval_seed=0)
    loader = early_facts_loader(data, model, 300, n=6)
    pool = data.pool("test")
    for i in loader.dataset.indices:
        sample = loader.dataset.dataset[i]
        ids, facts = sample.input_ids, pool.facts[loader.dataset.dataset.indices[i]]
        last_segment = len(ids) - 64
        for fact in facts:
            ends = [j + len(fact) for j in range(len(ids)) if np.array_equal(ids[j : j + len(fact)], fact)]
            assert ends and min(ends) <= last_segment
    assert sum(len(b["input_ids"]) for b in loader) == 6
    metrics = babilong(
        model, tokenizer, tiny_corpus(), tmp_path, tasks=("qa1",), lengths=(300,), n=4, early_facts=True
    )
    assert set(metrics) == {"babilong_early_facts/qa1/acc@300", "babilong_early_facts/acc"}
    with pytest.raises(ConfigError, match="early_facts=true needs a memory model"):
        babilong(Oracle(tokenizer.vocab_size), tokenizer, tiny_corpus(), tmp_path, early_facts=True)
    with pytest.raises(ConfigError, match="Drop 0 from eval.babilong.lengths"):
        babilong(
            model, tokenizer, tiny_corpus(), tmp_path, tasks=("qa1",), lengths=(0, 300), n=4, early_facts=True
        )


def test_memory_maps_draws_figure_10_of_a_memory_model(tmp_path, cache):
    tokenizer = build_tokenizer()
    model = RMT(build_llama(tokenizer.vocab_size, 32, 1, 2, 2, 64, 512), num_memory=2, segment_size=64).eval()
    metrics = memory_maps(model, tokenizer, tiny_corpus(), tmp_path, length=256, n_samples=2, n_stats=4)
    assert metrics["memory_maps/segments"] >= 256 // 64 and (tmp_path / "memory_maps.png").stat().st_size > 0
    assert (
        metrics["memory_maps/move_ratio_at_facts"] > 0 and 0 <= metrics["memory_maps/top_move_at_fact"] <= 1
    )
    assert 0 < metrics["memory_maps/fact_segment_share"] < 1
    assert json.loads((tmp_path / "memory_maps.json").read_text())["length"] == 256
    with pytest.raises(ConfigError, match="got Oracle"):
        memory_maps(Oracle(tokenizer.vocab_size), tokenizer, tiny_corpus(), tmp_path)


def write_folder_corpus(folder: Path) -> Path:
    folder.mkdir()
    for i in range(6):
        (folder / f"doc{i}.txt").write_text(sentences(i, 20))
    return folder


def test_export_hf_loads_in_transformers_with_the_same_logits(trained, tmp_path, cache):
    from transformers import AutoTokenizer, LlamaForCausalLM

    run_dir, run = trained
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    out = evaluate(compose_eval(["export=hf", f"ckpt_path={ckpt}", f"export_dir={tmp_path / 'hf'}"]))
    hf = LlamaForCausalLM.from_pretrained(out["export_dir"]).eval()
    ids = torch.randint(0, run.tokenizer.vocab_size, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(
            hf(ids).logits, run.module.model.backbone.logits(ids), rtol=1e-4, atol=1e-4
        )
    text = sentences(0, 3)
    assert AutoTokenizer.from_pretrained(out["export_dir"])(text, add_special_tokens=False)["input_ids"] == (
        run.tokenizer.encode(text)
    )

    # The exported folder evaluated as a pretrained HF model gives the checkpoint's perplexity.
    corpus = ["corpus=folder", f"corpus.path={write_folder_corpus(tmp_path / 'texts')}", "logger=csv"]
    from_ckpt = evaluate(compose_eval([f"ckpt_path={ckpt}", *corpus]))
    pretrained = evaluate(
        compose_eval(
            [
                "backbone=hf",
                f"backbone.name={tmp_path / 'hf'}",
                "model.window=32",
                f"out_dir={tmp_path / 'o'}",
                *corpus,
            ]
        )
    )
    assert pretrained == pytest.approx(from_ckpt, rel=1e-4)
    assert json.loads((tmp_path / "o" / "metrics.json").read_text())["metrics"] == pytest.approx(pretrained)


def test_bad_inputs_are_refused_with_a_clear_message(tmp_path):
    with pytest.raises(ValueError, match="Nothing to evaluate: give ckpt_path="):
        evaluate(compose_eval([]))
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {"model.w": torch.zeros(1)}, "global_step": 1}, foreign)
    with pytest.raises(ValueError, match="holds no training config"):
        evaluate(compose_eval([f"ckpt_path={foreign}", "logger=csv"]))
    with pytest.raises(ValueError, match="Unknown export='onnx'; valid: hf"):
        evaluate(compose_eval(["export=onnx", f"ckpt_path={foreign}"]))


def test_precision_null_reads_a_checkpoint_as_it_trained():
    """precision=null: a checkpoint trained in fp32 (the tiny recipe, on any device) is evaluated in fp32 on a GPU
    too, as its validation ran; a mixed-precision one takes the device's autocast (bf16 on CUDA, none on a CPU);
    an explicit precision wins; an unknown one is refused."""

    def dtype(precision, device, trained_in=None):
        trained = OmegaConf.create({"trainer": {"precision": trained_in}}) if trained_in else None
        with warnings.catch_warnings():  # torch.autocast("cuda") on a machine without CUDA warns, and is off
            warnings.simplefilter("ignore")
            context = autocast_context(precision, torch.device(device), trained)()
        return context.fast_dtype if isinstance(context, torch.autocast) else None

    assert dtype(None, "cuda", "32-true") is None and dtype(None, "cuda", "32") is None
    assert dtype(None, "cuda", "bf16-mixed") == dtype(None, "cuda") == auto_dtype("cuda")
    assert dtype(None, "cpu", "bf16-mixed") is None and dtype(None, "cpu") is None
    assert dtype("bf16-mixed", "cuda", "32-true") == torch.bfloat16 and dtype("32-true", "cuda") is None
    with pytest.raises(ConfigError, match="precision=bf17 is not one of bf16-mixed"):
        autocast_context("bf17", torch.device("cpu"))


def auto_dtype(device: str):
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(auto_precision(device))


class EvenRowReader(Oracle):
    """A segment model (segments of 64) right on every other test sample with its memory carried, never with it
    reset: the per-sample pairing of outcomes with distances is then known."""

    segment_size = 64
    segment_bounds = RMT.segment_bounds

    def __init__(self, vocab_size: int):
        super().__init__(vocab_size)
        self.rows = 0

    def forward(self, batch: dict, recurrent: bool = True) -> ModelOutput:
        out = super().forward(batch)
        rows = scored_positions(batch["labels"]).nonzero()[:, 0]  # row of each scored target
        right = (self.rows + rows) % 2 == 0 if recurrent else torch.zeros_like(rows, dtype=torch.bool)
        self.rows += len(batch["input_ids"]) if recurrent else 0
        predicted = torch.where(right, out.targets, (out.targets + 1) % self.vocab_size)
        return ModelOutput(nn.functional.one_hot(predicted, self.vocab_size).float(), out.targets)


def test_fact_distance_buckets_each_sample_by_its_supporting_facts_segment(tmp_path, cache):
    """eval=[fact_distance]: each sample's distance is the number of segments between the segment where its
    earliest supporting fact ends (brute-force search) and the question's, and its facts after the number of story
    facts after its last supporting one; accuracy per bucket of each, carried and reset."""
    tokenizer = build_tokenizer()
    model = EvenRowReader(tokenizer.vocab_size)
    data = BabilongDataModule(tokenizer, tiny_corpus(), task="qa2", n_test=12, eval_seed=0)
    dataset, pool = data.test_set(400), data.pool("test")
    expected: dict[str, list[float]] = {}
    expected_after: dict[str, list[float]] = {}
    for i in range(len(dataset)):
        ids, k = dataset[i].input_ids, dataset.indices[i]
        fact = pool.facts[k][min(pool.supporting[k])]
        end = min(j + len(fact) for j in range(len(ids)) if np.array_equal(ids[j : j + len(fact)], fact))
        # whole segments from the fact's last token to the end, split from the right
        d = (len(ids) - end) // 64
        expected.setdefault(str(fact_distance_bucket(d)), []).append(float(i % 2 == 0))
        after = len(pool.facts[k]) - 1 - max(pool.supporting[k])
        expected_after.setdefault(str(fact_distance_bucket(after)), []).append(float(i % 2 == 0))
    metrics = fact_distance(
        model, tokenizer, tiny_corpus(), tmp_path, task="qa2", lengths=(400,), n=12, batch_size=5
    )
    saved = json.loads((tmp_path / "fact_distance.json").read_text())
    for key, want in (("accuracy", expected), ("accuracy_by_facts_after", expected_after)):
        got = saved[key]["400"]
        assert {b: (c["carried"][0], c["carried"][1], c["reset"][0]) for b, c in got.items()} == {
            b: (np.mean(v), len(v), 0.0) for b, v in want.items()
        }
    assert (
        len(expected_after) > 1 and metrics[f"fact_distance/qa2/acc@400/reset/f{min(expected_after)}"] == 0.0
    )
    saved = saved["accuracy"]["400"]
    assert (
        len(expected) > 1
        and metrics[f"fact_distance/qa2/acc@400/d{next(iter(saved))}"]
        == next(iter(saved.values()))["carried"][0]
    )
    assert (tmp_path / "fact_distance.png").stat().st_size > 0
    assert [fact_distance_bucket(d) for d in (0, 1, 2, 3, 4, 7, 8, 100)] == [0, 1, 2, 2, 4, 4, 8, 64]
    with pytest.raises(ConfigError, match="has no segments"):
        fact_distance(Oracle(tokenizer.vocab_size), tokenizer, tiny_corpus(), tmp_path)


def test_wrong_answers_names_what_each_qa1_answer_points_at(tmp_path, cache):
    """eval=[wrong_answers]: a wrong qa1 answer is another person's current location, an earlier location of the
    story, or none of the story's; right answers are counted per memory setting (carried / reset), shares sum to 1."""
    story = ["Mary moved to the garden.", "John went to the office.", "Mary journeyed to the kitchen."]
    assert [answer_kind(story, 2, "kitchen", p) for p in ("kitchen", "office", "garden", "hallway", "")] == [
        "right",
        "other_person",
        "earlier",
        "not_in_story",
        "not_in_story",
    ]
    # the asked person's own earlier location is stale, not another person's
    assert (
        answer_kind(["John went to the office.", "John went to the hallway."], 1, "hallway", "office")
        == "earlier"
    )
    tokenizer = build_tokenizer()
    metrics = wrong_answers(
        EvenRowReader(tokenizer.vocab_size),
        tokenizer,
        tiny_corpus(),
        tmp_path,
        lengths=(400,),
        n=12,
        batch_size=5,
    )
    share = json.loads((tmp_path / "wrong_answers.json").read_text())["share"]["400"]
    assert share["carried"]["right"] == 0.5 and share["reset"]["right"] == 0.0 and share["reset"]["n"] == 12
    assert all(abs(sum(s[k] for k in KINDS) - 1) < 1e-9 for s in share.values())
    assert metrics["wrong_answers/400/carried/right"] == 0.5
    # random_person: the accuracy of a random person's current location, here from the stories' text by a regex
    data = BabilongDataModule(tokenizer, tiny_corpus(), task="qa1", n_test=12, eval_seed=0)
    dataset, chance = data.test_set(400), []
    for k in dataset.indices:
        story = " ".join(tokenizer.decode(f.tolist()) for f in dataset.tasks.facts[k])
        now = dict(re.findall(r"(\w+) \w+(?: back)? to the (\w+)\.", story))  # later facts overwrite earlier
        answer = tokenizer.decode(dataset.tasks.answer[k].tolist()).strip()
        chance.append(np.mean([loc == answer for loc in now.values()]))
    assert 0 < np.mean(chance) < 1 and metrics["wrong_answers/400/random_person"] == pytest.approx(
        np.mean(chance)
    )
    assert (tmp_path / "wrong_answers.png").stat().st_size > 0
    oracle = wrong_answers(
        Oracle(tokenizer.vocab_size), tokenizer, tiny_corpus(), tmp_path, lengths=(400,), n=12
    )
    assert oracle["wrong_answers/400/carried/right"] == 1.0 and not any("reset" in k for k in oracle)
