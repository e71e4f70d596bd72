"""Write generated bAbI tasks in the v1.2 text format.

    python -m data.babi --task qa1 --n 10000 --seed 0 --split train --out DIR

writes DIR/qa1_single-supporting-fact_train.txt (one story per question). Make the test split with
`--split test` and another seed. `--task all` writes every task.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from data.babi.io import write_babi
from data.babi.registry import LONG_NAMES, TASKS, generate_task, task_name


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(
        prog="python -m data.babi",
        description="Generate bAbI tasks into DIR/<long task name>_<split>.txt (bAbI v1.2 format, one story per "
        "question). Use different seeds for the train and test splits.",
    )
    parser.add_argument(
        "--task",
        required=True,
        help=f"'all', {', '.join(TASKS)}, or a long name like qa1_single-supporting-fact",
    )
    parser.add_argument("--n", type=int, required=True, help="samples (questions) per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", default="train", help="split name for the file name (default: train)")
    parser.add_argument("--out", type=Path, required=True, help="output folder (created if missing)")
    args = parser.parse_args(argv)
    if args.n < 0:
        parser.error(f"--n {args.n}: pass a number of samples >= 0")
    if args.task == "all":
        names = list(TASKS)
    else:
        try:
            names = [task_name(args.task)]
        except ValueError as error:
            parser.error(str(error))
    args.out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in names:
        path = args.out / f"{LONG_NAMES[name]}_{args.split}.txt"
        write_babi(generate_task(name, args.n, args.seed), path)
        print(f"wrote {args.n} samples to {path}")
        paths.append(path)
    return paths


if __name__ == "__main__":
    main()
