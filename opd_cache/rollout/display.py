"""The rollout worker's progress: a rich bar on a terminal, a plain line every ~10 s otherwise."""

from __future__ import annotations

from rich.console import Console

from opd_cache.observe.progress import Every


class ProgressDisplay:
    """Samples, tokens/s, version, backlog on `console`: a rich progress bar on a terminal, a plain line every
    ~10 s otherwise (the log file of `opd run`, a redirected stderr). Silent without a console (library use)."""

    def __init__(self, console: Console | None, total: int | None, done: int, label: str = "rollout"):
        self.console = console
        self.progress = None
        self.plain = None
        self.label = label
        self.total = total
        self.fields = dict(completed=done, tps=0.0, version=0, backlog=0, state="")
        if console is None:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        if not console.is_terminal:
            self.plain = Every()
            return
        self.progress = Progress(
            TextColumn(label),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("samples"),
            TextColumn(
                "{task.fields[tps]:.0f} tok/s  v{task.fields[version]}  backlog {task.fields[backlog]}"
                "  {task.fields[state]}"
            ),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.task = self.progress.add_task("rollout", total=total, **self.fields)
        self.progress.start()

    def update(self, **fields) -> None:
        self.fields.update(fields)
        if self.progress is not None:
            self.progress.update(self.task, **fields)
        elif self.plain is not None and self.plain.due():
            f = self.fields
            of_total = f"/{self.total}" if self.total else ""
            print(
                f"{self.label}: {f['completed']}{of_total} samples, {f['tps']:.0f} tok/s, policy v{f['version']}, "
                f"backlog {f['backlog']}" + (f" ({f['state']})" if f["state"] else ""),
                file=self.console.file,
                flush=True,
            )

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
