"""The Azure LLM inference trace 2023 (Splitwise, CC-BY 4.0): read at run time from the data
folder (never copied into the repository). Columns: TIMESTAMP, ContextTokens, GeneratedTokens."""

from __future__ import annotations

import csv
import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FILES = {"conv": "azure_llm_2023_conv.csv", "code": "azure_llm_2023_code.csv"}


@dataclass(frozen=True)
class AzureTrace:
    """One Azure trace file, in file order."""

    path: Path
    """Where it was read from."""
    times_s: np.ndarray
    """Arrival times, seconds from the first row."""
    prompt_lens: np.ndarray
    """ContextTokens per request."""
    output_lens: np.ndarray
    """GeneratedTokens per request (at least 1)."""

    def __len__(self) -> int:
        return len(self.times_s)

    @property
    def mean_gap_s(self) -> float:
        """Mean inter-arrival gap, seconds."""
        return float(self.times_s[-1] - self.times_s[0]) / max(1, len(self) - 1)


def trace_path(data_dir: Path, kind: str = "conv") -> Path:
    """The trace file in `data_dir`; ValueError with what to do when it is missing."""
    path = Path(data_dir) / FILES[kind]
    if not path.is_file():
        raise ValueError(
            f"Azure trace not found: {path} (point --data-dir at the folder "
            f"holding {FILES[kind]}; the repository ships it in bench/data)"
        )
    return path


def load_trace(path: Path) -> AzureTrace:
    """Reads and checks an Azure trace CSV; ValueError naming the file and row on bad data."""
    times: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    try:
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(
                reader.fieldnames or ()
            )
            if missing:
                raise ValueError(f"{path}: missing column(s) {', '.join(sorted(missing))}")
            for row_no, row in enumerate(reader, start=2):
                try:
                    times.append(dt.datetime.fromisoformat(row["TIMESTAMP"]).timestamp())
                    prompts.append(int(row["ContextTokens"]))
                    outputs.append(int(row["GeneratedTokens"]))
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{path}:{row_no}: bad row ({exc})") from None
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    if not times:
        raise ValueError(f"{path}: no rows")
    t = np.array(times)
    order = np.argsort(t, kind="stable")
    return AzureTrace(
        path=Path(path),
        times_s=t[order] - t[order][0],
        prompt_lens=np.maximum(1, np.array(prompts, dtype=np.int64)[order]),
        output_lens=np.maximum(1, np.array(outputs, dtype=np.int64)[order]),
    )
