"""What a run reports: throughput accounting (`flops`), per-stage pipeline timing (`stages`), the sinks
(`sinks`: stdout, metrics.jsonl, TensorBoard, optional W&B) and the one writer that feeds them (`writer`).

`threed report RUN_DIR` (`threed.metrics.report`) turns a run's metrics.jsonl into plots and a summary.
"""
