"""Training utilities: arguments, initialisation, the pretrain loop, checkpointing."""
