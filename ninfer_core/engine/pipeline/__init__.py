"""Pipeline stages across devices (`--devices A,B,...`, `--stage-layers A,B,...`): the split
(split.py), micro-batches (microbatch.py), the stage processes (stage.py) and the runner façade
the engine sees (runner.py)."""
