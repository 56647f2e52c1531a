"""Checkpoints: DeepSpeed pipeline checkpoint directories, what they hold and how a run starts from and saves to them.

- `format`: what a checkpoint directory holds (file names, tags, the recorded model, reading layer files) and
  whether a run can load it (layout and model checks). Shared with threed.convert; it needs nothing above the
  config and the model's shape table.
- `manifest`: crash safety: the manifest of every file with its size, the newest complete checkpoint, pruning.
- `start`: where a run starts (resume, weights only, fresh; refusals naming the fix), decided on rank 0 before
  the model is built, and the save-directory checks.
- `universal`: resuming at another tp / pp / dp / dtype through DeepSpeed's universal checkpoint.
- `save`: a crash-safe save on every rank (DeepSpeed's files, then the manifest, then `latest`).

    decision = threed.checkpoint.start.start(cfg, dims, rank)      # before the model is built
    saved = threed.checkpoint.save.save(engine, cfg, rank, {"consumed_samples": n})

This file imports nothing, so importing `threed.checkpoint.format` does not drag in the rest of the package.
"""
