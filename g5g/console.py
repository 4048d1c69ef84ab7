"""Printing what a person or a script copies from (image tags, digests, commands): whole, never cut to "…".

In a terminal, table cells fold at its width; in a pipe or a CI log (no terminal, nothing to fit) a table prints at
its natural width and lines are never wrapped, so every reference stays on one line.
"""
from __future__ import annotations

from rich.console import Console
from rich.table import Table


def print_table(console: Console, table: Table) -> None:
    for col in table.columns:
        col.overflow = "fold"
    if console.is_terminal:
        console.print(table)
        return
    width = console.width
    console.width = max(width, console.measure(table, options=console.options.update_width(10**6)).maximum)
    try:
        console.print(table)
    finally:
        console.width = width
