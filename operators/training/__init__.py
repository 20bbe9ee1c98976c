"""Training: kernels, advantage estimators, losses, batch packing and the FSDP2 trainer."""
