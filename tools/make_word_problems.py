"""Write the arithmetic word-problem dataset that pipelines/smollm2_math.yaml trains on.

    python tools/make_word_problems.py            # pipelines/data/word_problems_{train,eval}.parquet
    python tools/make_word_problems.py --task sums --train 4000 --eval 256   # pipelines/data/sums_*.parquet

Rows: `messages` (one user turn), `answer` (text) and `kind`; the eval file holds problems whose text
never occurs in the train file.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from flowrl_operators.tasks.word_problems import make_problem, make_sum

TASKS = {"word_problems": make_problem, "sums": make_sum}


def rows(rng: random.Random, n: int, avoid: set[str], make=make_problem) -> list[dict]:
    out: list[dict] = []
    while len(out) < n:
        row = make(rng)
        key = row["messages"][0]["content"]
        if key not in avoid:
            avoid.add(key)
            out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("pipelines/data"))
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--eval", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", choices=sorted(TASKS), default="word_problems")
    args = parser.parse_args()
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng, seen = random.Random(args.seed), set()
    evals = rows(rng, args.eval, seen, TASKS[args.task])
    train = rows(rng, args.train, seen, TASKS[args.task])
    args.out.mkdir(parents=True, exist_ok=True)
    for split, data in (("train", train), ("eval", evals)):
        path = args.out / f"{args.task}_{split}.parquet"
        pq.write_table(pa.Table.from_pylist(data), path)
        print(json.dumps({"file": str(path), "rows": len(data), "bytes": path.stat().st_size}))


if __name__ == "__main__":
    main()
