"""prefixscore on Ray (`pip install 'prefixscore[ray]'`): the one home for Ray in prefixscore.

- data.py: Ray Data batch classification: a pool of actors, one Classifier each;
  `classify_dataset(ds)` adds a label, the scores and an error column to any Ray Dataset.
- file_jobs.py: `classify_files(inputs, output)` is `prefixscore classify --ray`: one output file per
  input file, the rows the in-process command writes.
- serve.py: Ray Serve: `app(model, template, labels, ...)` is the online server as a Serve
  application (a replica per GPU, each the single-process server); `serve run
  prefixscore.ray.serve:app_builder model=... template=... labels=...` builds it from arguments.

Importing this package imports no Ray: its functions import it when first asked for, and without it
raise ConfigError naming the extra to install. No library module imports this package (only the
command line does), so Ray is never a dependency of classifying in-process."""

__all__ = ["app", "app_builder", "classify_dataset", "classify_files"]


def __getattr__(name):
    if name == "classify_dataset":
        from .data import classify_dataset

        return classify_dataset
    if name == "classify_files":
        from .file_jobs import classify_files

        return classify_files
    if name in ("app", "app_builder"):  # ray.serve only when asked for: Ray Data does without it
        from . import serve

        return getattr(serve, name)
    raise AttributeError(f"module 'prefixscore.ray' has no attribute {name!r}")
