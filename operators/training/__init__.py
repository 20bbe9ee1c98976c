"""Training: kernels, advantage estimators, losses, batch packing and the FSDP2 trainer.

One training step, as the train node runs it on each rank (all calls are collective over ranks):

    from flowrl_operators.training.advantages import AdvantageConfig, compute_advantages
    from flowrl_operators.training.batch import pack, shard
    from flowrl_operators.training.losses import LossConfig, apply_kl_penalty, needs_proximal, policy_loss
    from flowrl_operators.training.trainer import Trainer, TrainerConfig

    trainer = Trainer("builtin:tiny-qwen2", TrainerConfig(lr=1e-5))   # after init_process_group if N > 1
    batch = pack(trajectories)                        # the whole step's batch, same on every rank
    apply_kl_penalty(batch, loss_config)              # only with kl.mode == "reward"
    compute_advantages(batch, advantage_config)       # needs batch.values for gae (Critic.compute_values)
    mine = shard(batch, trainer.rank, trainer.world_size)
    if needs_proximal(loss_config):
        mine.proximal_logprobs = trainer.compute_logprobs(mine)
    metrics = trainer.forward_backward(mine, policy_loss(loss_config)) | trainer.step()
    for bucket in trainer.named_weights(64 << 20): ...   # weight sync; every rank iterates

Modules: `kernels` (chunked token logprobs and entropy), `advantages` (estimator registry and
`AdvantageConfig`), `losses` (policy loss registry, `LossConfig`, value loss),
`batch` (`Batch`, `pack`, `shard`, micro-batches, global `Normaliser`), `trainer` (`Trainer`,
`Reference`, `Critic`), `checkpoint` (DCP save/load, Hugging Face export).
"""
