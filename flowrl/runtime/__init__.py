"""The runtime: a compiled `Plan` runs as stages joined by channels.

    from flowrl.runtime import run
    result = run(plan, run_dir, executor="inprocess" | "ray", resume=False, progress=True, max_steps=None)

Pieces (each file is short; read them in this order):
- channel.py      Record (the envelope around an operator's value), Work, Channel (one edge's queue)
- coordinator.py  channels, version clock, admission control, staleness, ledger; the rules are in
                  its docstring
- stage.py        one replica of one node: take work, call the operator, complete it (both executors)
- clock.py        what time it is and the loop waits run on: the wall clock, or a virtual one that
                  jumps to the next timer (flowrl plan, the simulation tests)
- run.py          run(): run directory, resume, SIGINT/SIGTERM, max_seconds
- failures.py     StageFailed, TrainerLost: how a run fails (run.py and the executors raise them)
- targets.py      run.stop_when: the metrics that end a run once they reach a value
- observe.py      trace.json, metrics.jsonl, samples.jsonl;  progress.py  the live view
- tracking.py     run.trackers (TensorBoard, wandb, mlflow, plugins: flowrl/trackers/) and the sample rows
- executors/      what runs the stages (its __init__ lists them):
    inprocess.py      every stage an asyncio task in this process (debugging, tests); `simulate`:
                      a plan on a virtual clock, without a run directory
    ray_executor.py   every stage replica a Ray actor, the coordinator an async actor
    ray_stage.py      the stage actor, and the coordinator proxy that passes policies as object refs
    ray_placement.py  a placement group per node (custom resources, labels, strategy); placement.json
    ray_local.py      the cluster: the user's (run.ray_address, RAY_ADDRESS), or a loopback one of its own
    executor.py       the Executor protocol both meet
- durability/     what a run leaves on disk to be checked and resumed (its __init__ lists them):
    checkpoints.py    when checkpoints are taken, their atomic write, disk space
    snapshot.py       the coordinator's state in a checkpoint, and what a resume restores
    streams.py        the record files as they grow, cut back to a checkpoint on resume
    rollouts.py       the rollout store `flowrl replay` trains on again
    resume.py         a resumed run's checkpoint verified and its record files cut back
    ledger.py         ledger.jsonl and check(run_dir)
    faults.py         FLOWRL_FAULT=<point>:<n>: kill -9 at a chosen point (durability tests)

Operators implement the methods of their kind, documented on `flowrl.operator.Operator`.

Run keys read from `plan.run`: `steps` (train steps, default 10), `executor` (inprocess | ray),
`seed` (also `plan.seed`, handed to the data source and operators), `max_seconds` (end the run,
with a checkpoint, after this long, counted from when every stage has set up: status "done",
stopped_by "max_seconds"), `stop_when` (the same once a metric reaches a value: stopped_by
"stop_when", targets.py), `max_restarts` (under Ray, default 3: restarts of a dead generate
actor, and restarts of the whole run from its last checkpoint after a train actor's process died; run.py), `checkpoint_every` / `checkpoint_seconds` / `keep_checkpoints` (durability/checkpoints.py),
`trackers` (default [tensorboard]), `samples_per_step` (default 4; tracking.py) and
`ray_address` (attach to a running Ray cluster; executors/ray_local.py). `data`: `source` (module:attr, builtin:<task>, or a dataset file: flowrl/data/files.py), `batch_size`, `options` (see flowrl/data/source.py). Node
`resources` place the stage (Ray: one actor per replica; `replicas: N` of a train node are the
ranks of one sharded model, see flowrl/runtime/executors/ray_executor.py; `custom`, `labels` and
`placement` choose Ray nodes, executors/ray_placement.py). How many calls a stage keeps in
flight and whether a generate stage updates weights mid-generation come from the operator's
`knobs(config)` (flowrl.operator.Knobs), never from config keys read by name.
Checkpoints are written periodically, at the end, on interrupt (SIGINT, SIGTERM) and at `max_steps`.

Run directory layout (all written by the coordinator or by run()):

    plan.json          the Plan (msgspec JSON); `load_plan(run_dir)` reads it for `--resume`
    meta.json          {"name", "origin" (epoch seconds; trace timestamps count from it),
                        "executor", "steps", "format": 3 (3: checkpoints hold manifest.json),
                        "health": 1 (its rows carry the health events),
                        "metric_roles": {train node: what its metrics mean, as it declared
                        (flowrl.operator.MetricRoles); absent in a run from before declarations}}
    ledger.jsonl       one event per line, see durability/ledger.py; `ledger.check(run_dir)` verifies it
                       (this file, metrics.jsonl, trace.json and tensorboard/ are appended at
                       least every 2 s while the run goes on, and with each train step)
    trace.json         Chrome trace-event JSON, see observe.py (valid after every append)
    metrics.jsonl      one object per train step:
                         step, version (published), node, time (s since origin), step_seconds,
                         groups, samples_per_s, trajectories_per_s, reward (mean trajectory
                         reward, or null), queues {edge label: records waiting},
                         staleness {lag: count} (lag = train version - record version),
                         dropped (this step), dropped_total, stale_kept_total, rejected_total,
                         filtered_total, idle {node: fraction of the step's wall time it was idle},
                         coordinator_weight_bytes (tensor bytes of policy / weights values handed
                         to the coordinator since the previous row: in-process the policy's size,
                         passed by reference and never copied; under Ray 0, the policy travels as
                         an object ref, executors/ray_stage.py), train {the train operator's metrics},
                         health [the learning-health events this step found, flowrl/health.py;
                         only on such rows]
    samples.jsonl      `samples_per_step` trajectories of each trained batch: step, node, id, version
                         (the policy that generated it), reward, prompt, response (text the records
                         carry; prompt_ids / response_ids where they carry none), tracking.py
    tensorboard/       the same numbers as TensorBoard scalars; staleness as a histogram; the
                       samples as a text table (tracker `tensorboard`, the default)
    wandb/, mlruns/    the wandb and mlflow trackers' files, when run.trackers names them
    placement.json     Ray executor: the Ray node (id, address, custom resources, labels) and
                       process each stage replica runs on; ray_placement.py
    trackers.json      each tracker's run id and last step sent (not cut back on resume: tracking.py)
    errors.jsonl       the first 20 failures of user code each node isolated (node, replica, time,
                       error), from Operator.errors(); untrained.py
    error.txt          what stopped a run that failed (the message on screen)
    earlier-<n>/       the records of an attempt that stopped before its first checkpoint, kept
                       when `--resume` starts the run again from step 0 (durability/resume.py)
    checkpoints/latest names the newest checkpoints/step-<version>/, which holds
                       coordinator.pkl (channels with their waiting records, versions, sample
                       cursor, samples to re-issue; durability/snapshot.py), streams.json (the size of each
                       record file above at that moment) and <node>/r<replica>/ (state.pkl with
                       the operator's state_dict, plus whatever Operator.save wrote) and
                       manifest.json (size and sha256 of every other file, checked on resume)
    train-*.jsonl, ... files operators write themselves (`OperatorContext.run_dir`)

Edge labels are `EdgePlan.label` ("src.port -> dst.port"); samples are on "data -> <node>".
Record ids: "<step>:<index>" for everything derived from sample <index> of <step> (one group per
sample), "v<n>" for policy and weights records of version n.
"""

from flowrl.runtime.durability.ledger import LedgerReport, check
from flowrl.runtime.run import RunResult, StageFailed, latest_checkpoint, load_plan, run

__all__ = ["LedgerReport", "RunResult", "StageFailed", "check", "latest_checkpoint", "load_plan", "run"]
