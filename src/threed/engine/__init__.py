"""The engine wing: a run's configuration resolved once, and the DeepSpeed pipeline engine built from it (the one
page that applies parallelism, in order). Training (threed.train), generation (threed.generate), lm-eval scores
(threed.harness) and verification (threed.verify) all build their engine here; none sits below another for it.

    resolved.py   resolve(cfg, world) -> ResolvedRun: validated once; the run's dimensions (threed.parallel.dims)
                  and its DeepSpeed config, frozen and handed down (pure: no torch)
    ds_config.py  deepspeed_config: the one writer of DeepSpeed's JSON (ZeRO-1, bf16 with fp32 accumulation and
                  reduction); engine_config: what an engine is built with (universal load, ZeRO off to score)
    build.py      build_engine: process groups -> layers with TP / SP / CP -> stages -> recompute -> ZeRO ->
                  schedule -> what the run starts from
    optimizer.py  AdamW with warmup and cosine decay (client objects), optimizer state placed after a load
    load.py       a full resume, weights at this layout, or weights sliced from another tp / pp
"""
