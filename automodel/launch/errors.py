"""Launch errors, importable without torch."""


class LaunchError(RuntimeError):
    """A rank failed; the message names it."""


class TrainingStopped(Exception):
    """A stop signal (SIGTERM, SIGUSR1, SIGUSR2) ended the run early after a checkpoint."""

    def __init__(self, signum: int, step: int | None, checkpoint: str | None):
        super().__init__(signum, step, checkpoint)
        self.signum, self.step, self.checkpoint = signum, step, checkpoint

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        import signal

        after = f" after step {self.step}" if self.step is not None else ""
        saved = (f"checkpoint saved: {self.checkpoint}" if self.checkpoint else
                 "no checkpoint was written")
        return (f"stopped by {signal.Signals(self.signum).name}{after}; {saved}. To continue, "
                "run again with checkpoint.resume=auto (a requeued SLURM job does so itself)")
