"""Pipeline parallelism: the layers split over stages, the schedules, and the transfers between
stages (Megatron-core's `megatron.core.pipeline_parallel`)."""
