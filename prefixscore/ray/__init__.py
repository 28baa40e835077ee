"""prefixscore on Ray (`pip install 'prefixscore[ray]'`): the one home for Ray in prefixscore.

- data.py: Ray Data batch classification: a pool of actors, one Classifier each;
  `classify_dataset(ds)` adds a label, the scores and an error column to any Ray Dataset.
- files.py: `classify_files(inputs, output)` is `prefixscore classify --ray`: one output file per
  input file, the rows the in-process command writes.
- The Ray Serve deployment of the online server is to live here too.

Importing this package imports no Ray: its functions import it when first asked for, and without it
raise ConfigError naming the extra to install. No library module imports this package (only the
command line does), so Ray is never a dependency of classifying in-process."""

__all__ = ["classify_dataset", "classify_files"]


def __getattr__(name):
    if name == "classify_dataset":
        from .data import classify_dataset

        return classify_dataset
    if name == "classify_files":
        from .files import classify_files

        return classify_files
    raise AttributeError(f"module 'prefixscore.ray' has no attribute {name!r}")
