"""lm-evaluation-harness on the training engine itself, at any tp / pp (`threed eval-harness`), no export.

- `tasks.py`: the tasks asked for, found and loaded (stock names, local YAML under --include-path) before any
  engine is built; unknown tasks and data not available offline are one line.
- `lm.py`: `ThreedLM`, lm-eval's `TemplateLM` whose log-likelihoods are the vocab-parallel cross entropy training
  computes, requests split over data-parallel replicas; generation through `threed.generate`.
- `run.py`: the ranks of `threed eval-harness`: engine, `simple_evaluate`, the results JSON.

lm-eval is an optional extra (`pip install threed[eval]`): only these modules import it, and only the commands that
need it import them.
"""
