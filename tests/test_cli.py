"""Bad input at the command line: one message that names the problem and the fix, exit status 1, no traceback
(`debug=true` or HYDRA_FULL_ERROR=1 show it); a run that fails at startup leaves no folder behind."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import evaluate
import train
from models import cli
from models.config_errors import ConfigError
from models.pretrain_babi import main as pretrain_main
from tests.test_faults import compose_train, tiny_overrides

ROOT = Path(__file__).parents[1]
TINY = ["experiment=tiny_lm", "backbone.hidden_size=32", "backbone.ffn_size=64", "task.seq_len=32"]
QUIET = ["hydra/job_logging=none", "hydra/hydra_logging=none"]  # leave the test process's logging alone


def run_cli(monkeypatch, main, config: str, *args: str) -> str:
    """Run an entry point in this process as the command line would; returns the message it exits with."""
    monkeypatch.setattr(sys, "argv", ["prog", *args])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    monkeypatch.setenv("MEMLM_DEBUG", "0")
    with pytest.raises(SystemExit) as e:
        cli.run(main, config)
    assert e.value.code != 0
    return str(e.value.code)


@pytest.fixture(scope="module")
def rmt_checkpoint(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("rmt")
    train.train(compose_train(tiny_overrides(run_dir, 1, 1, "model=rmt")))
    return run_dir / "checkpoints" / "last.ckpt"


@pytest.mark.parametrize(
    "args,message",
    [
        # expected user errors (item 8)
        (
            ["corpus=folder", "corpus.path=/no/such/folder"],
            "Corpus folder not found: /no/such/folder. Set corpus.path",
        ),
        (["ckpt_path=/no/such.ckpt"], "Checkpoint not found: /no/such.ckpt. Give an existing .ckpt file"),
        # values checked before Lightning / torch see them (item 9)
        (
            ["trainer.max_steps=abc"],
            "trainer.max_steps=abc is not a valid value: lightning.pytorch.Trainer takes max_steps: int",
        ),
        (["trainer.precision=bf17"], "trainer.precision=bf17 is not a valid value"),
        (["task.batch_size=0"], "task.batch_size must be >= 1, got 0."),
        (["task.seq_len=-5"], "task.seq_len must be >= 1, got -5."),
        (
            ["optim.lr=fast"],
            "optim.lr=fast is not a valid value: models.lit_module.LitModule takes lr: float",
        ),
        # unknown keys and options get the closest valid one (item 10)
        (["trainer.max_step=3"], "trainer.max_step=3: unknown key; did you mean trainer.max_steps=3?"),
        (["optim.lrr=1"], "optim.lrr=1: unknown key; did you mean optim.lr=1?"),
        (["max_steps=3"], "max_steps=3: unknown key; did you mean trainer.max_steps=3?"),
        (
            ["+trainer.max_step=3"],
            "trainer.max_step: lightning.pytorch.Trainer has no argument 'max_step'; did you mean trainer.max_steps?",
        ),
        (["task.seq_lenn=3"], "task.seq_lenn=3: unknown key; did you mean task.seq_len=3?"),
        (
            ["model=rmtt"],
            "model=rmtt: no such option; did you mean model=rmt? Valid model options: armt, llama, llama_xl, rmt, rmt_r.",
        ),
        (["trainer.max_steps=["], "Cannot read the override 'trainer.max_steps=['"),
        (  # an experiment's callbacks.forgetting_curve.* left behind by callbacks=default
            ["+callbacks.forgetting_curve.every_n_val=2"],
            "callbacks.forgetting_curve sets options of a callback that the chosen callbacks group does not have; "
            "drop them with ~callbacks.forgetting_curve",
        ),
    ],
)
def test_train_bad_input_exits_with_one_message(monkeypatch, tmp_path, args, message):
    got = run_cli(monkeypatch, train.main, "train", *TINY, *args, f"run_dir={tmp_path / 'run'}", *QUIET)
    assert got.startswith("Error: ") and message in got, got
    assert not (tmp_path / "run").exists()  # a run that failed at startup leaves no folder (item 15)


def test_an_experiment_without_its_required_value_names_it(monkeypatch, tmp_path):
    run_dir = f"run_dir={tmp_path / 'run'}"
    got = run_cli(monkeypatch, train.main, "train", "experiment=curriculum32_from", run_dir, *QUIET)
    assert got == (
        "Error: this experiment needs init_from=runs/<run>/checkpoints/last.ckpt (the run trained as typed) "
        "on the command line"
    ), got
    assert not (tmp_path / "run").exists()


def test_several_unknown_keys_are_all_named(monkeypatch, tmp_path):
    got = run_cli(monkeypatch, train.main, "train", "trainer.max_step=3", "optim.lrr=1", *QUIET)
    assert got.splitlines()[1:] == ["optim.lrr=1: unknown key; did you mean optim.lr=1?"], got


def test_options_of_an_evaluator_not_in_eval_are_named(monkeypatch):
    """Was: an internal StopIteration (the missing key was `eval.ppl`, the override `eval.ppl.max_len`)."""
    args = ["eval=[forgetting_curve]", "eval.ppl.max_len=5", "eval.forgetting_curve.max_le=3", *QUIET]
    got = run_cli(monkeypatch, evaluate.main, "eval", *args)
    assert got.splitlines() == [
        "Error: eval.ppl.max_len=5: unknown key; it configures the evaluator 'ppl', which eval=[...] does not list.",
        "eval.forgetting_curve.max_le=3: unknown key; did you mean eval.forgetting_curve.max_len=3?",
    ], got


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_accelerator_without_a_gpu_is_refused_before_lightning(monkeypatch, tmp_path):
    got = run_cli(
        monkeypatch, train.main, "train", *TINY, "trainer.accelerator=gpu", f"run_dir={tmp_path}/r", *QUIET
    )
    assert "trainer.accelerator=gpu, but torch" in got and "sees no CUDA GPU" in got
    assert "use trainer.accelerator=cpu" in got


def test_corrupt_checkpoint(monkeypatch, tmp_path):
    bad = tmp_path / "broken.ckpt"
    bad.write_bytes(b"PK\x03\x04 not really a checkpoint")
    got = run_cli(
        monkeypatch, train.main, "train", *TINY, f"ckpt_path={bad}", f"run_dir={tmp_path}/r", *QUIET
    )
    assert f"Error: Checkpoint {bad} is corrupt or truncated" in got and "Use another checkpoint" in got


def test_checkpoint_of_another_model_names_both(monkeypatch, tmp_path, rmt_checkpoint):
    """Was: `Unexpected key(s) in state_dict: "model.memory"` deep inside Lightning."""
    args = tiny_overrides(tmp_path, 2, 1, "model=llama_xl", f"ckpt_path={rmt_checkpoint}")
    got = run_cli(monkeypatch, train.main, "train", *args, *QUIET)
    assert "This checkpoint is a model=rmt checkpoint; you asked for model=llama_xl" in got, got
    args = tiny_overrides(tmp_path, 2, 1, "model=rmt", "backbone.n_layers=3", f"ckpt_path={rmt_checkpoint}")
    got = run_cli(monkeypatch, train.main, "train", *args, *QUIET)
    assert "backbone.n_layers: 2 in the checkpoint, 3 now" in got, got


@pytest.mark.parametrize(
    "args,message",
    [
        ([], "Nothing to evaluate: give ckpt_path=/path/to/x.ckpt (or watch=RUN_DIR)"),
        (["evall=[ppl]"], "evall=[ppl]: unknown key; did you mean eval=[ppl]?"),
        (["eval=[ppl,babylong]"], "eval=babylong: no such option; did you mean eval=babilong?"),
        (["device=cuda"] if not torch.cuda.is_available() else ["device=mps"], "sees no"),
        (["ckpt_path=/no/such.ckpt"], "Checkpoint not found: /no/such.ckpt"),
    ],
)
def test_evaluate_bad_input_exits_with_one_message(monkeypatch, args, message):
    if args == ["device=mps"]:
        pytest.skip("this machine has a GPU")
    got = run_cli(monkeypatch, evaluate.main, "eval", *args, *QUIET)
    assert got.startswith("Error: ") and message in got, got


def test_pretrain_bad_input_exits_with_one_message(monkeypatch):
    got = run_cli(monkeypatch, pretrain_main, "train", "model=rmt_r", "task=qa1", "trainer.max_step=3")
    assert got == "Error: trainer.max_step=3: unknown key; did you mean trainer.max_steps=3?"
    got = run_cli(monkeypatch, pretrain_main, "train", "experiment=tiny_lm", "backbone_init=warm_start")
    assert got.startswith(
        "Error: backbone_init=warm_start pretrains the backbone on a BABILong task's stories"
    )


def subprocess_run(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "MEMLM_DEBUG")}
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**environ, "WANDB_MODE": "offline", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_real_process_prints_only_the_message(tmp_path):
    res = subprocess_run(
        "train.py", *TINY, "corpus=folder", "corpus.path=/no/such/folder", f"run_dir={tmp_path}/r"
    )
    assert res.returncode == 1 and "Traceback" not in res.stdout + res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error")]
    assert errors == [
        "Error: Corpus folder not found: /no/such/folder. Set corpus.path to a folder of .txt files."
    ]
    assert res.stderr.endswith(errors[0] + "\n") and not (tmp_path / "r").exists()
    res = subprocess_run("evaluate.py", "evall=[ppl]")
    assert (res.returncode, res.stderr) == (1, "Error: evall=[ppl]: unknown key; did you mean eval=[ppl]?\n")


@pytest.mark.parametrize("flag,env", [("debug=true", "0"), ("debug=false", "1")])
def test_debug_or_hydra_full_error_raises_the_error_itself(monkeypatch, tmp_path, flag, env):
    """The traceback is one flag away: the error propagates instead of the one-line exit."""
    monkeypatch.setattr(
        sys, "argv", ["prog", *TINY, "task.batch_size=0", flag, f"run_dir={tmp_path}", *QUIET]
    )
    monkeypatch.setenv("HYDRA_FULL_ERROR", env)
    monkeypatch.setenv("MEMLM_DEBUG", "0")  # recorded first: the test ends with the variable as it was
    monkeypatch.delenv("MEMLM_DEBUG")  # cli.run decides
    with pytest.raises(ConfigError, match="task.batch_size must be >= 1, got 0."):
        cli.run(train.main, "train")
