#!/usr/bin/env bash
# The GPU check: one H200 (Python 3.12, torch with CUDA, transformers, triton, pytest; no Ray,
# omegaconf, msgspec or aiohttp, and no network). Every part runs under `timeout`; the limits add up
# to 650 s (60 + 120 + 240 + 2 x 115), so inside a 15-minute lease run the parts in two calls (PARTS)
# to leave room for a rerun.
#
#   tools/gpu_check.sh --fetch-wheels   # on a machine with PyPI: the missing packages into tools/gpu_wheels/
#   tools/gpu_check.sh                  # on the GPU machine (the wheels travel with the working tree)
#   PARTS=pipelines tools/gpu_check.sh  # only some parts: any of contract,train,pipelines,code
#   PARTS=code tools/gpu_check.sh       # screen pipelines/smollm2_code.yaml recipes (not in the default)
#
# Parts: (1) install the carried wheels, (2) the engine contract tests on CUDA with the embedded engine
# (in-process, and through flowrl's SGLang-compatible server and the SGLang adapter), (3) tools/gpu_check.py:
# an FSDP2 train step, a bucketed weight sync and GRPO steps of a ~0.5B Qwen2-shaped model with random
# weights, in one process (no Ray), (4) both quickstart pipelines through `flowrl run` on CUDA, shortened
# (150 warm-up steps, 40 s of GRPO each): the same YAML as on the CPU, trainer in its own process for
# the async one. Without CUDA the CUDA parts are skipped and gpu_check.py runs on
# the CPU with the tiny model instead, so a dry run still exercises the same code.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
WHEELS=tools/gpu_wheels
NEEDED="msgspec omegaconf antlr4-python3-runtime PyYAML aiohttp multidict yarl propcache frozenlist aiosignal aiohappyeyeballs attrs typing_extensions idna"
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
say() { echo "[gpu_check.sh +$(elapsed)s] $*"; }

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  mkdir -p "$WHEELS"
  # CPython 3.12 manylinux wheels, no dependencies resolved (the list above is the closure we need).
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any -d "$WHEELS" $NEEDED || exit 1
  du -sh "$WHEELS"; ls "$WHEELS"
  exit 0
fi

# 1. Dependencies: install only what is missing, from the carried wheels (no index: no network there).
if ! $PY -c "import msgspec, omegaconf, aiohttp" 2>/dev/null; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    say "FAIL: msgspec/omegaconf/aiohttp are missing and $WHEELS/ holds no wheels;"
    say "      run 'tools/gpu_check.sh --fetch-wheels' where PyPI is reachable, then carry $WHEELS"
    exit 2
  fi
  timeout 60 $PY -m pip install -q --no-index --find-links "$WHEELS" msgspec omegaconf aiohttp || exit 2
fi
# flowrl without installing it: the repo on the path, and operators/ under its import name.
if ! $PY -c "import flowrl, flowrl_operators" 2>/dev/null; then
  SHIM=$(mktemp -d)
  ln -s "$REPO/operators" "$SHIM/flowrl_operators"
  export PYTHONPATH="$REPO:$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
$PY - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"
      + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))
PY
if $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then CUDA=1; else CUDA=0; fi

PARTS=${PARTS:-contract,train,pipelines}
part() { [[ ",$PARTS," == *",$1,"* ]]; }
CONTRACT=skipped
GRPO=skipped
PIPELINES=skipped
CODE=skipped
if [[ $CUDA == 1 ]] && ! part contract; then
  say "2. not asked for (PARTS=$PARTS)"
elif [[ $CUDA == 1 ]]; then
  say "2. engine contract tests on CUDA (embedded in-process + SGLang adapter over loopback), limit 120 s"
  FLOWRL_CONTRACT_DEVICE=cuda timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_engine_contract.py
  rc=$?; CONTRACT=$([[ $rc == 0 ]] && echo passed || echo "failed (rc $rc)")
  say "2. contract tests: $CONTRACT"
fi
if [[ $CUDA == 1 ]] && part train; then
  say "3. FSDP2 step, bucketed sync, GRPO on qwen2-0.5b-shape (bf16), limit 240 s"
  timeout 240 $PY tools/gpu_check.py --budget-s 190
  rc=$?
  GRPO=$([[ $rc == 0 ]] && echo passed || echo "failed (rc $rc)")
elif [[ $CUDA == 0 ]] && part train; then
  say "2. SKIPPED (no CUDA): engine contract tests on CUDA (on CPU they are tests/test_engine_contract.py)"
  say "3. SKIPPED (no CUDA): FSDP2/sync/GRPO on qwen2-0.5b-shape; dry run of the same code on CPU, tiny model"
  timeout 280 $PY tools/gpu_check.py --model builtin:tiny-qwen2 --device cpu --steps 2 --prompts 4 --group 4 --lr 1e-3
  rc=$?
  GRPO=$([[ $rc == 0 ]] && echo passed || echo "failed (rc $rc)")
fi
if [[ $CUDA == 1 ]] && part pipelines; then
  say "4. quickstart and quickstart_async through flowrl run on CUDA (150 warm-up steps, 40 s GRPO each), limit 240 s"
  PIPELINES=passed
  RUNS=$(mktemp -d)
  for name in quickstart quickstart_async; do
    timeout 115 $PY -m flowrl.cli run pipelines/$name.yaml phases.0.steps=150 phases.1.seconds=40 \
      --run-dir "$RUNS/$name" --quiet > "$RUNS/$name.log" 2>&1
    rc=$?
    [[ $rc == 0 ]] || { PIPELINES="failed ($name rc $rc)"; tail -20 "$RUNS/$name.log"; }
    $PY - "$RUNS/$name" <<'SUMMARY'
import statistics, sys
from pathlib import Path
from flowrl.records import RunDir, as_dicts
grpo = RunDir(Path(sys.argv[1]) / "phases/1-grpo")
evals, rows = as_dicts(grpo.evals()), as_dicts(grpo.metrics())
steps = statistics.median(r["step_seconds"] for r in rows[1:]) if len(rows) > 1 else None
print(f"  {Path(sys.argv[1]).name}: {len(rows)} GRPO steps, median {steps} s a step; eval {evals[0]['eval_reward'] if evals else None}"
      f" -> best {max((e['eval_reward'] for e in evals), default=None)}, last {evals[-1]['eval_reward'] if evals else None}")
SUMMARY
  done
  say "4. pipelines: $PIPELINES"
fi
if part code; then
  # (5) Screening, not a claim: pipelines/smollm2_code.yaml (SmolLM2 with the sandboxed code tool) under
  # several recipes at once on screening seeds, each run its own process under CODE_S seconds, to find
  # which recipe learns in a few steps before a held-out run on the CPU. Needs the model folder
  # (tools/get_smollm2.py). CODE_GRID: one run per line, "NAME KEY=VALUE ...".
  say "5. smollm2_code screening runs at once, each under ${CODE_S:=420} s"
  RUNS=${CODE_RUNS_DIR:-$(mktemp -d)}
  GRID=${CODE_GRID:-"base run.seed=0
base-control run.seed=0 nodes.score.control=random"}
  while read -r name overrides; do
    [[ -n $name ]] || continue
    # shellcheck disable=SC2086
    timeout "$CODE_S" $PY -m flowrl.cli run pipelines/smollm2_code.yaml $overrides --run-dir "$RUNS/$name" --quiet \
      > "$RUNS/$name.log" 2>&1 &
  done <<< "$GRID"
  wait
  CODE=done
  $PY - "$RUNS" <<'SUMMARY'
import json, statistics, sys
from pathlib import Path
from flowrl.records import RunDir, as_dicts
for run in sorted(p for p in Path(sys.argv[1]).iterdir() if p.is_dir()):
    try:
        records = RunDir(run)
        evals, rows = as_dicts(records.evals()), as_dicts(records.metrics())
    except Exception as error:  # a run that never started: say so, the others still print
        print(f"  {run.name}: unreadable ({error}); log tail: {(run.parent / (run.name + '.log')).read_text()[-600:]}")
        continue
    curve = [(e.get("version"), e.get("eval_reward"), (e.get("scores") or {}).get("exact")) for e in evals]
    rewards = [round(r.get("reward", 0.0), 3) for r in rows]
    step = statistics.median(r["step_seconds"] for r in rows) if rows else None
    print(f"  {run.name}: {len(rows)} steps, median {step} s a step; eval (version, reward, exact) {curve}")
    print(f"    train reward by step {rewards}")
    print(json.dumps({"run": run.name, "steps": len(rows), "step_s": step, "eval": curve, "reward": rewards}))
SUMMARY
  if [[ -n ${OUT:-} ]]; then
    tar -czf "$OUT/code-runs.tar.gz" -C "$RUNS" --exclude=checkpoints --exclude=export --exclude=rollouts . 2>/dev/null
  fi
fi
say "done in $(elapsed) s: contract $CONTRACT, gpu_check.py $GRPO, pipelines $PIPELINES, code $CODE"
echo "{\"cuda\": $CUDA, \"contract\": \"$CONTRACT\", \"gpu_check\": \"$GRPO\", \"pipelines\": \"$PIPELINES\", \"code\": \"$CODE\", \"seconds\": $(elapsed)}"
[[ $GRPO != failed* && $CONTRACT != failed* && $PIPELINES != failed* ]]
