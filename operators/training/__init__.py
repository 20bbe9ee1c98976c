"""Training: kernels, advantage estimators, losses, batch packing and the FSDP2 trainer.

One training step, as the train node runs it on each rank (all calls are collective over ranks):

    from flowrl_operators.training.advantages import compute_advantages
    from flowrl_operators.training.batch import pack, shard
    from flowrl_operators.training.losses import apply_kl_penalty, needs_proximal, policy_loss, set_behaviour_weights
    from flowrl_operators.training.objective import advantage_config, loss_config
    from flowrl_operators.training.trainer import Trainer, TrainerConfig

    loss = loss_config({"kind": "cispo", "clip_high": 4.0})      # YAML keys -> the entry's config
    advantage = advantage_config("grpo")

    trainer = Trainer("builtin:tiny-qwen2", TrainerConfig(lr=1e-5))   # after init_process_group if N > 1
    batch = pack(trajectories)                        # the whole step's batch, same on every rank
    apply_kl_penalty(batch, loss)                     # only with kl apply_as: reward
    compute_advantages(batch, advantage)              # needs batch.values for gae (Critic.compute_values)
    mine = shard(batch, trainer.rank, trainer.world_size, trainer.shared)
    if needs_proximal(loss):
        mine.proximal_logprobs = trainer.compute_logprobs(mine)
        set_behaviour_weights(mine, loss, trainer.all_reduce)
    metrics = trainer.forward_backward(mine, policy_loss(loss)) | trainer.step()
    for bucket in trainer.named_weights(64 << 20): ...   # weight sync; every rank iterates

Modules: `registry` (the algorithm registries: losses, advantage estimators, KL estimators,
corrections, aggregations, each an entry-point group), `objective` (the train node's loss and
estimator resolved and checked), `kernels` (chunked token logprobs and entropy), `advantages` and
`advantages_outcome` (estimators), `losses` (the policy loss built from the registries, value
loss; `losses.ppo`, `losses.reinforce` the per-token losses), `kl`, `corrections`, `aggregations`,
`batch` (`Batch`, `pack`, `shard`, micro-batches, global `Normaliser`), `trainer` (`Trainer`,
`Reference`, `Critic`), `checkpoint` (DCP save/load, Hugging Face export).
"""
