"""FSDP2 over 2 gloo ranks (two spawned processes) against one rank, checkpoint resume, weights.

One spawn runs every 2-rank scenario (process start and model load dominate the time):
3 steps -> parameters equal the 1-rank run's (1e-5); save at step 2, resume in a fresh Trainer,
run to step 4 -> bit-identical to the uninterrupted run; named_weights (rank 0) equal the full
state dict; export_hf loads with from_pretrained; a NaN on one rank makes both ranks skip; a rank
without rows still takes part in the step.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flowrl.data.trajectory import Trajectory
from flowrl_operators.training.advantages import AdvantageConfig, compute_advantages
from flowrl_operators.training.batch import pack, shard
from flowrl_operators.training.losses import loss_config, policy_loss
from flowrl_operators.training.trainer import Critic, Trainer, TrainerConfig

MODEL = "builtin:tiny-qwen2"
CONFIG = TrainerConfig(lr=1e-3, warmup_steps=2, schedule="cosine", total_steps=10, micro_batch_tokens=40, seed=3)
LOSS = loss_config({"clip_high": 0.28})


def step_batch(step: int):
    """Seven trajectories of uneven lengths in three groups, each group's rows sharing its prompt (so
    the trainer's forward and the ranks' shards keep them together), different for every step."""
    g = torch.Generator().manual_seed(100 + step)
    prompts = [torch.randint(5, 60, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(3)]
    trajectories = []
    for i in range(7):
        n = int(torch.randint(2, 9, (1,), generator=g))
        trajectories.append(Trajectory(
            id=f"{step}-{i}", group_id=f"g{i % 3}", sample_id="s",
            prompt_ids=prompts[i % 3],
            response_ids=torch.randint(5, 60, (n,), generator=g).tolist(),
            loss_mask=[1] * n, versions=[0] * n,
            behaviour_logprobs=(-4 + torch.rand(n, generator=g)).tolist(),
            reward=float(torch.rand(1, generator=g)),
        ))
    return compute_advantages(pack(trajectories), AdvantageConfig())


def train_step(trainer: Trainer, step: int) -> dict:
    batch = shard(step_batch(step), trainer.rank, trainer.world_size, trainer.shared)
    metrics = trainer.forward_backward(batch, policy_loss(LOSS))
    return metrics | trainer.step()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {}
        trainer = Trainer(MODEL, CONFIG)
        result["sharded"] = trainer.sharded
        for step in range(2):
            train_step(trainer, step)
        trainer.save(f"{out}/ckpt")
        result["metrics3"] = train_step(trainer, 2)
        result["after3"] = trainer.state_dict_full()
        train_step(trainer, 3)
        result["uninterrupted4"] = trainer.state_dict_full()
        result["weights"] = [pair for bucket in trainer.named_weights(bucket_bytes=50_000) for pair in bucket]
        trainer.export_hf(f"{out}/hf")

        resumed = Trainer(MODEL, CONFIG)
        resumed.load(f"{out}/ckpt")
        result["resumed_step"] = (resumed.step_count, resumed.policy_version)
        train_step(resumed, 2)
        train_step(resumed, 3)
        result["resumed4"] = resumed.state_dict_full()

        # A NaN advantage on rank 1 only: both ranks must skip the step and keep their weights.
        batch = shard(step_batch(4), rank, world)
        if rank == 1:
            batch.advantages[0, :] = float("nan")
        resumed.forward_backward(batch, policy_loss(LOSS))
        result["nan_step"] = resumed.step()
        result["after_nan"] = resumed.state_dict_full()

        # One row for two ranks: rank 1 holds nothing and joins with zero-weight micro-batches.
        one = step_batch(5).select([0])
        mine = shard(one, rank, world)
        result["rows_on_rank1"] = shard(one, 1, world).size
        mine.behaviour_logprobs = resumed.compute_logprobs(mine)  # on-policy: ratio 1, nothing clipped
        result["logprobs_one_row"] = mine.behaviour_logprobs
        result["one_row"] = resumed.forward_backward(mine, policy_loss(LOSS)) | resumed.step()

        # The critic shards the same way; its fresh value head is the same in every process.
        critic = Critic(MODEL, CONFIG)
        result["values"] = critic.compute_values(step_batch(0))
        if rank == 0:
            torch.save(result, f"{out}/rank0.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    mp.start_processes(worker, args=(2, free_port(), str(out)), nprocs=2, start_method="spawn", join=True)
    return out, torch.load(out / "rank0.pt", weights_only=False)


def assert_same(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if atol == 0:
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)


def test_two_ranks_match_one_rank_after_three_steps(two_ranks):
    """Same data, global loss normaliser: FSDP2 over 2 ranks == plain module, to 1e-5."""
    _, result = two_ranks
    assert result["sharded"]
    single = Trainer(MODEL, CONFIG)
    assert not single.sharded
    initial = {k: v.clone() for k, v in single.state_dict_full().items()}
    for step in range(3):
        metrics = train_step(single, step)
    assert_same(result["after3"], single.state_dict_full(), atol=1e-5)
    # The run moved the weights (the comparison above is not of two untouched models).
    assert any(not torch.equal(initial[k], result["after3"][k]) for k in initial)
    assert abs(metrics["loss"] - result["metrics3"]["loss"]) < 1e-5
    # Means add up over micro-batches and ranks; `*_max` metrics take the largest (a sum would double).
    for key in ("mismatch_logprob_mean", "mismatch_logprob_max", "mismatch_out_of_clip", "clip_fraction"):
        assert abs(metrics[key] - result["metrics3"][key]) < 1e-5, key
    assert metrics["mismatch_logprob_max"] > metrics["mismatch_logprob_mean"] > 1.0


def test_resume_from_step_two_is_bit_identical(two_ranks):
    _, result = two_ranks
    assert result["resumed_step"] == (2, 2)
    assert_same(result["resumed4"], result["uninterrupted4"], atol=0)


def test_named_weights_equal_state_dict(two_ranks):
    """Every parameter once (a tied lm_head under the embedding's name), equal to the full state."""
    _, result = two_ranks
    names = [name for name, _ in result["weights"]]
    assert len(names) == len(set(names))
    full = result["uninterrupted4"]
    assert set(names) == set(full) - {"lm_head.weight"}
    for name, tensor in result["weights"]:
        assert torch.equal(tensor, full[name]), name


def test_export_loads_with_from_pretrained(two_ranks):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, result = two_ranks
    model = AutoModelForCausalLM.from_pretrained(str(out / "hf"), local_files_only=True)
    state = model.state_dict()
    for name, tensor in result["uninterrupted4"].items():
        assert torch.equal(state[name], tensor), name
    assert AutoTokenizer.from_pretrained(str(out / "hf"), local_files_only=True).encode("12")


def test_a_rank_without_rows_still_trains(two_ranks):
    _, result = two_ranks
    assert result["rows_on_rank1"] == 0
    assert result["one_row"]["skipped"] == 0.0 and result["one_row"]["grad_norm"] > 0
    # On-policy (behaviour = the trainer's own logprobs); rank 1's placeholder adds nothing to the max.
    assert 0.0 <= result["one_row"]["mismatch_logprob_max"] < 1e-5
    assert result["logprobs_one_row"].shape[0] == 1 and (result["logprobs_one_row"] < 0).any()


def test_sharded_critic_values_equal_one_rank(two_ranks):
    _, result = two_ranks
    torch.testing.assert_close(result["values"], Critic(MODEL, CONFIG).compute_values(step_batch(0)), atol=1e-6, rtol=0)
    assert result["values"].abs().sum() > 0


def test_nan_on_one_rank_is_skipped_on_both(two_ranks):
    _, result = two_ranks
    assert result["nan_step"]["skipped"] == 1.0 and result["nan_step"]["skipped_steps"] == 1.0
    assert_same(result["after_nan"], result["resumed4"], atol=0)
