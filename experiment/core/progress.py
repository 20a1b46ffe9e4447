"""Events of long commands: one JSON object per line on stdout, or a progress bar on a terminal."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, TextIO

from experiment.core.canonical import JsonLike

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

Emit = Callable[[Mapping[str, JsonLike]], None]


class Events:
    """Context manager. ``emit({"event": ..., "done": n, "total": N, ...})`` advances a bar named by the
    event on a terminal; elsewhere every event is written as one JSON line. Events without ``done`` and
    ``total`` are printed as JSON lines in both cases (the final summary among them)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stdout
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}

    def __enter__(self) -> Events:
        if self._stream.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
            )
            self._progress.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    def emit(self, event: Mapping[str, JsonLike]) -> None:
        done, total = event.get("done"), event.get("total")
        if self._progress is not None and isinstance(done, int | float) and isinstance(total, int | float):
            name = str(event["event"])
            if name not in self._tasks:
                self._tasks[name] = self._progress.add_task(name, total=total)
            self._progress.update(self._tasks[name], completed=done)
            return
        self._stream.write(json.dumps(event, sort_keys=True) + "\n")
        self._stream.flush()
