"""What the entry points (train.py, evaluate.py, models.pretrain_babi) do around their work: an expected mistake
prints one message that names the problem and the fix, and exits 1 without a traceback.

    @hydra.main(version_base="1.3", config_path="configs", config_name="train")
    def main(cfg):
        with cli.user_errors(cfg):
            ...

    if __name__ == "__main__":
        cli.run(main, "train")

Expected mistakes: a `UserError` (models/errors.py), a command line Hydra cannot compose (an unknown key gets the
closest valid one, an unknown option the closest choice), Lightning's `MisconfigurationException`. `debug=true` or
`HYDRA_FULL_ERROR=1` shows the traceback instead. A run that fails before writing anything but Hydra's config and
log leaves no folder behind.
"""

from __future__ import annotations

import difflib
import logging
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, ListConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, InterpolationResolutionError

from models.errors import UserError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
UNKNOWN_KEY = (ConfigKeyError, ConfigAttributeError)  # what OmegaConf raises for a key the config lacks
EXPECTED = (UserError, MisconfigurationException)
STARTED = time.time()  # files older than this were not written by this process
log = logging.getLogger("memlm")


def run(main: Callable[[], None], config_name: str) -> None:
    """Call an entry point (a `@hydra.main` function, or one that composes `config_name` itself); a command line
    that does not compose, or an expected error raised outside a Hydra job, exits with its message alone."""
    debug = os.environ.get("HYDRA_FULL_ERROR") == "1" or any(
        a.lstrip("+").lower() == "debug=true" for a in sys.argv[1:]
    )
    os.environ.setdefault("MEMLM_DEBUG", "1" if debug else "0")  # child processes (DDP) inherit the choice
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises composition errors: they are reported here
    quiet_lightning()
    try:
        main()
    except (ConfigCompositionException, OverrideParseException, *EXPECTED) as e:
        if os.environ["MEMLM_DEBUG"] == "1":
            raise
        raise SystemExit(f"Error: {describe(e, config_name, overrides(sys.argv[1:]))}") from None
    finally:
        finish_wandb()


def finish_wandb() -> None:
    """Close a W&B run still open now, not at interpreter exit (where W&B writes colour codes into log files)."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish()


@contextmanager
def user_errors(cfg: DictConfig) -> Iterator[None]:
    """Inside a Hydra job: an expected error exits with its message alone (Hydra would print it after a
    traceback); a failed run's folder is removed if it holds nothing but what Hydra wrote at the start."""
    try:
        yield
    except BaseException as e:
        if HydraConfig.initialized():
            remove_if_unused(Path(HydraConfig.get().runtime.output_dir))
        if isinstance(e, InterpolationResolutionError) and isinstance(e.__context__, EXPECTED):
            e = e.__context__  # raised by a resolver (`${required:...}`), which OmegaConf wraps
        if not isinstance(e, EXPECTED) or cfg.get("debug") or os.environ.get("MEMLM_DEBUG") == "1":
            raise
        raise SystemExit(f"Error: {describe(e)}") from None


def quiet_lightning() -> None:
    """Drop Lightning's advertising tips and the deprecation warning about torch internals that it triggers."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(lambda record: "Tip:" not in record.getMessage())
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")


def remove_if_unused(folder: Path) -> None:
    """Delete `folder` if this process created everything in it and that is only what a run writes at its start:
    Hydra's `.hydra/` and log, a CSV logger's `hparams.yaml` (no metrics, no checkpoint)."""
    folder = folder.resolve()
    if not folder.is_dir() or folder in (Path.cwd().resolve(), *Path.cwd().resolve().parents):
        return
    files = [p for p in folder.rglob("*") if p.is_file()]
    startup = all(
        p.suffix == ".log" or p.name == "hparams.yaml" or p.relative_to(folder).parts[0] == ".hydra"
        for p in files
    )
    if startup and all(fresh(p) for p in files):
        shutil.rmtree(folder, ignore_errors=True)


@rank_zero_only
def report_outputs(folder: str | Path) -> None:
    """Log what this process wrote under `folder`: checkpoints, metrics CSVs, plots and JSON, the W&B run folder
    (with its `wandb sync` command when offline), the config and log; a folder of many files as its count."""
    folder = Path(folder).resolve()
    files = [p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".") and fresh(p)]
    groups: dict[str, list[str]] = {}
    wandb_runs = set()
    for p in sorted(files):
        parts = p.relative_to(folder).parts
        if parts[0] == "wandb":
            if len(parts) > 2 and "run-" in parts[1]:
                wandb_runs.add(parts[1])
            continue
        groups.setdefault(str(Path(*parts[:-1])), []).append(parts[-1])
    lines = []
    for sub, names in sorted(groups.items()):
        where = "" if sub == "." else f"{sub}/: "
        if len(names) > 4:
            names = [f"{len(names)} files ({', '.join(sorted({Path(n).suffix or n for n in names}))})"]
        lines.append(f"  {where}{', '.join(names)}")
    for run in sorted(wandb_runs):
        sync = f": upload with `wandb sync {folder / 'wandb' / run}`" if run.startswith("offline-") else ""
        lines.append(f"  wandb/{run}{sync}")
    if lines:
        log.info("Written under %s:\n%s", folder, "\n".join(lines))


def fresh(path: Path) -> bool:
    """Whether this process wrote the file (its modification time is after the process started)."""
    return path.stat().st_mtime >= STARTED - 1


# ---- messages -------------------------------------------------------------------------------------------
def describe(e: BaseException, config_name: str | None = None, args: list[str] | None = None) -> str:
    """One message for an expected error: a composition error gets the closest valid key or option."""
    if isinstance(e, MisconfigurationException):
        return f"{e} (Lightning)"
    if isinstance(e, MissingConfigException) and e.missing_cfg_file:
        group, _, name = e.missing_cfg_file.rpartition("/")
        options = e.options or sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
        hint = f"did you mean {group}={close[0]}? " if close else ""
        return f"{group}={name}: no such option; {hint}Valid {group} options: {', '.join(options)}."
    if isinstance(e, OverrideParseException):
        bad = next((a for a in args or [] if not parses(a)), None)
        first = str(e).splitlines()[0]
        return f"Cannot read the override {bad!r}: {first}" if bad else str(e)
    if isinstance(e, ConfigCompositionException) and isinstance(e.__cause__, UNKNOWN_KEY) and config_name:
        return unknown_keys_message(config_name, args or [])
    return str(e).split("\nConfig search path")[0].strip()


def parses(override: str) -> bool:
    try:
        OverridesParser.create().parse_overrides([override])
        return True
    except OverrideParseException:
        return False


def overrides(argv: list[str]) -> list[str]:
    """The Hydra overrides of a command line (not its flags)."""
    return [a for a in argv if "=" in a and not a.startswith("-")]


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def unknown_keys_message(config_name: str, args: list[str]) -> str:
    """Each override whose key the composed config lacks, with the closest valid key (from composing the rest)."""
    unknown: list[str] = []
    cfg = None
    for _ in range(len(args) + 1):
        rest = [a for a in args if not under(override_key(a), unknown)]
        try:
            with initialize_config_dir(str(CONFIGS), version_base="1.3"):
                cfg = compose(config_name, overrides=rest)
            break
        except ConfigCompositionException as e:
            key = getattr(e.__cause__, "full_key", None)
            if not isinstance(e.__cause__, UNKNOWN_KEY) or not key or key in unknown:
                break
            unknown.append(key)
    keys = sorted(config_keys(cfg)) if cfg is not None else []
    lines = []
    for key, value in (a.split("=", 1) for a in args if under(override_key(a), unknown)):
        key = key.lstrip("+~")
        close = closest_key(key, keys)
        evaluator = ".".join(key.split(".")[:2])
        if config_name == "eval" and key.startswith("eval.") and evaluator not in keys:
            fix = f"it configures the evaluator {evaluator[5:]!r}, which eval=[...] does not list."
        elif close:
            fix = f"did you mean {close}={value}?"
        else:
            fix = f"it is not in the config (python {'evaluate' if config_name == 'eval' else 'train'}.py --cfg job)."
        lines.append(f"{key}={value}: unknown key; {fix}")
    return "\n".join(lines) or "An override names a key the config lacks."


def under(key: str, parents: list[str]) -> bool:
    """`key` is one of `parents` or lies below one (a missing `eval.ppl` makes `eval.ppl.max_len` unknown too)."""
    return any(key == p or key.startswith(f"{p}.") for p in parents)


def config_keys(node, prefix: str = "") -> Iterator[str]:
    """Dotted paths of every key of a config, Hydra's own settings excluded."""
    items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else []
    for k, v in items:
        path = f"{prefix}{k}"
        if path == "hydra":
            continue
        yield path
        if isinstance(v, DictConfig) and not isinstance(v, ListConfig):
            yield from config_keys(v, path + ".")


def closest_key(key: str, keys: list[str]) -> str | None:
    """The key's closest sibling (same parent), else the closest key anywhere, else one with the same last part."""
    parent = key.rpartition(".")[0]
    siblings = [k for k in keys if k.rpartition(".")[0] == parent]
    for pool in (siblings, keys):
        close = difflib.get_close_matches(key, pool, n=1, cutoff=0.6)
        if close:
            return close[0]
    same_leaf = [k for k in keys if k.rpartition(".")[2] == key.rpartition(".")[2]]
    return same_leaf[0] if same_leaf else None
