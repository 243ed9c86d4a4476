"""Datasets that cannot train, refused when the trainer is built, before any model is loaded."""

from __future__ import annotations


def check_prompt_column(dataset, name: str) -> None:
    """Raise `ValueError` if `dataset` (a `Dataset`, or a dict of them) has no `prompt` column."""
    if dataset is None:
        return
    datasets = dataset.items() if isinstance(dataset, dict) else [(None, dataset)]
    for key, ds in datasets:
        columns = getattr(ds, "column_names", None)
        if columns is not None and "prompt" not in columns:
            where = name if key is None else f"{name}[{key!r}]"
            raise ValueError(
                f"{where} has no 'prompt' column; its columns are {list(columns)}. RPPTrainer, like GRPOTrainer, "
                "samples completions for the 'prompt' column: rename your prompt column to 'prompt'."
            )


def check_dataset_not_empty(dataset, name: str) -> None:
    """Raise `ValueError` if `dataset` (a `Dataset`, or a dict of them) has no rows.

    An empty training set would otherwise make `train()` return after 0 steps without a word. Datasets without a
    length (`IterableDataset`) are not checked.
    """
    if dataset is None:
        return
    datasets = dataset.items() if isinstance(dataset, dict) else [(None, dataset)]
    for key, ds in datasets:
        try:
            n = len(ds)
        except TypeError:
            continue
        if n == 0:
            where = name if key is None else f"{name}[{key!r}]"
            raise ValueError(f"{where} is empty; accepted: a dataset with at least one row (a 'prompt' per row).")
