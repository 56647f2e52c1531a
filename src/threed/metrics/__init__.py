"""What a run reports: throughput accounting (`flops`), per-stage pipeline timing (`stages`), the sinks
(`sinks`: stdout, metrics.jsonl, TensorBoard, optional W&B) and the one writer that feeds them (`writer`).

`threed report RUN_DIR` (`threed.report`) turns a run's metrics.jsonl into plots and a summary.
"""
from threed.metrics.flops import flops_per_token, peak_tflops_per_device, throughput

__all__ = ["flops_per_token", "peak_tflops_per_device", "throughput", "RunMetrics"]


def __getattr__(name: str):
    # The writer pulls in torch.distributed and the sinks; keep `import threed.metrics` as light as the old module.
    if name == "RunMetrics":
        from threed.metrics.writer import RunMetrics

        return RunMetrics
    raise AttributeError(name)
