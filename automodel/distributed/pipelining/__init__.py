"""Pipeline parallelism: stage split, schedules, the pipeline training step."""
