"""What a job spec names on disk: datasets and `hf` model directories confined to the data root,
`custom` entrypoint modules to the plugin directory. Checked at submit, so a spec that names
something missing gets a 422 instead of a failed attempt."""

from __future__ import annotations

from pathlib import Path

from api_schemas import JobSpec
from api_schemas.labelled_data import LabelledDataError, read_disk_dataset, read_labelled


class DatasetError(ValueError):
    """`str(error)` says what is wrong; `field` is the spec field that named it."""

    def __init__(self, message: str, field: tuple[str, ...] = ("dataset", "path")):
        super().__init__(message)
        self.field = field


def check_spec_paths(spec: JobSpec, data_root: Path, plugin_dir: Path) -> None:
    """Everything the spec names exists where the worker will look, and the data fits the model."""
    dataset, num_labels = spec.dataset, getattr(spec.model, "num_labels", None)
    if dataset is not None and dataset.kind == "hf_disk":
        check_disk_dataset(data_root, dataset.path, dataset.split, dataset.text_column, dataset.label_column, spec.model.task, num_labels)
    elif dataset is not None:
        try:
            path = resolve_dataset(data_root, dataset.relative_path)
            if dataset.kind != "text":
                check_labelled(path, dataset.kind, dataset.text_column, dataset.label_column, num_labels)
        except DatasetError as exc:
            exc.field = ("dataset", "path" if dataset.path is not None else "upload_id")
            raise
        if dataset.kind == "text" and getattr(spec.model, "block_size", None):
            check_fills_a_step(spec, path)
    if dataset is not None and dataset.tokenizer_file is not None:
        tokenizer_file = resolve_under_root(data_root, dataset.tokenizer_file)
        if not tokenizer_file.is_file():
            raise DatasetError(f"no file {dataset.tokenizer_file!r} under the data root", ("dataset", "tokenizer_file"))
    if spec.model.kind == "hf" and spec.model.path is not None:
        check_model_directory(data_root, spec.model.path)
    if spec.model.kind == "custom":
        check_entrypoint(plugin_dir, spec.model.entrypoint)


def check_fills_a_step(spec: JobSpec, path: Path) -> None:
    """The training split holds at least one optimizer step's windows. Known from the file's size
    alone, without reading it: every tokenizer makes at most one token per byte, so size is an upper
    bound (the worker, which tokenizes, would only fail the attempt, and each retry, saying the same)."""
    if spec.effective_batch_size is None:
        return
    train_tokens = int(path.stat().st_size * (1 - spec.dataset.val_fraction))
    windows = max(0, train_tokens - 1) // spec.model.block_size
    if windows < spec.effective_batch_size:
        raise DatasetError(
            f"the dataset's training split ({train_tokens:,} bytes) makes at most {windows:,} windows of "
            f"{spec.model.block_size} tokens, too few for one optimizer step of {spec.effective_batch_size:,} "
            "(micro_batch_size × gradient_accumulation_steps × processes): lower it, or model.block_size",
            ("training", "micro_batch_size"),
        )


def resolve_under_root(data_root: Path, relative: str) -> Path:
    """`relative` under `data_root`; refuses paths (symlinks included) that resolve outside it."""
    root = data_root.resolve()
    path = (root / relative).resolve()
    if not path.is_relative_to(root):
        raise DatasetError("resolves outside the data root")
    return path


def resolve_dataset(data_root: Path, relative: str) -> Path:
    """The dataset file under `data_root`."""
    path = resolve_under_root(data_root, relative)
    if not path.is_file():
        raise DatasetError(
            f"no dataset file {relative!r} under the data root (`trainyard datasets upload FILE` sends one and names its "
            "upload_id; `trainyard up` keeps its data root in .trainyard/data)"
        )
    if path.stat().st_size == 0:
        raise DatasetError(f"dataset file {relative!r} is empty")
    return path


def check_labelled(path: Path, kind: str, text_column: str, label_column: str, num_labels: int | None) -> None:
    """Refuse what training would fail on: unreadable rows, missing columns, a label count other than
    num_labels (None: a custom loop's data, any count)."""
    try:
        _, labels = read_labelled(path, kind, text_column, label_column)
    except LabelledDataError as exc:
        raise DatasetError(str(exc)) from None
    check_label_count(labels, num_labels)


def check_disk_dataset(
    data_root: Path, relative: str, split: str | None, text_column: str, label_column: str, task: str, num_labels: int | None
) -> None:
    """A `datasets` directory under the data root that load_from_disk reads, with the columns (and
    label count) the model needs; a language model reads no labels."""
    path = resolve_under_root(data_root, relative)
    if not path.is_dir():
        raise DatasetError(f"no dataset directory {relative!r} under the data root")
    try:
        _, labels = read_disk_dataset(path, split, text_column, None if task == "lm" else label_column)
    except LabelledDataError as exc:
        raise DatasetError(str(exc)) from None
    if labels is not None:
        check_label_count(labels, num_labels)


def check_label_count(labels: list[str], num_labels: int | None) -> None:
    found = sorted(set(labels))
    if num_labels is not None and len(found) != num_labels:
        shown = ", ".join(found[:10]) + (" …" if len(found) > 10 else "")
        raise DatasetError(f"holds {len(found)} distinct labels ({shown}) but model.num_labels is {num_labels}")


def check_model_directory(data_root: Path, relative: str) -> None:
    """An `hf` model's directory: under the data root, with a config.json."""
    try:
        directory = resolve_under_root(data_root, relative)
    except DatasetError as exc:
        raise DatasetError(str(exc), ("model", "path")) from None
    if not (directory / "config.json").is_file():
        raise DatasetError(f"no directory {relative!r} with a config.json under the data root", ("model", "path"))


def check_entrypoint(plugin_dir: Path, entrypoint: str) -> None:
    """A `custom` job's module is a file in the plugin directory (the spec allows one name, no path;
    a symlink out of the directory is refused, as the worker refuses to load it)."""
    module = entrypoint.partition(":")[0]
    root = plugin_dir.resolve()
    path = (root / f"{module}.py").resolve()
    if not path.is_relative_to(root) or not path.is_file():
        raise DatasetError(f"no module {module}.py in the plugin directory", ("model", "entrypoint"))
