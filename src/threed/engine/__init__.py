"""The engine wing: a DeepSpeed pipeline engine built from a run, the one page that applies parallelism in order.

    build.py      build_engine: process groups -> megatron-core layers with TP / SP / CP -> pipeline stages ->
                  recompute -> schedule -> ZeRO; deepspeed_config (the one writer of DeepSpeed's JSON), AdamW +
                  warmup / cosine, loading weights or a full checkpoint

Training (threed.train), generation (threed.generate), lm-eval scores (threed.harness) and verification
(threed.verify) all build their engine here; none of them is below another for it.
"""
