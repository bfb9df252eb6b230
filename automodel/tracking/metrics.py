"""``metrics.jsonl``: one JSON object per logged step, written by rank 0 only."""

from __future__ import annotations

import json
import os

from automodel.errors import FileWriteError


class MetricsWriter:
    def __init__(self, output_dir: str, enabled: bool, filename: str = "metrics.jsonl"):
        self.path = os.path.join(output_dir, filename)
        self.enabled = enabled
        self._file = None
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._file is not None:
            try:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
            except OSError as err:
                raise FileWriteError(f"cannot write {self.path}: {type(err).__name__}: "
                                     f"{err}") from err

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
