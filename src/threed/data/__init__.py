"""The data path: text files -> Megatron indexed datasets (`threed preprocess`), and indexed datasets -> training
micro-batches (`threed train`). Megatron-LM's own file format and sample order, so corpora move both ways.

Preprocessing (`threed preprocess`, plain and --sft):
    (the command line is threed.cli.preprocess: flags, exit policy)
    preprocess      plain text -> PREFIX_{key}_document, one or many worker processes (encode)
    sft, chat       chat / instruction JSONL -> tokens + response-only loss mask
    inputs          the --input files: checks, chunks in input order, records
    formats         the registry of input formats (JSONL, Parquet, text). A new input format goes here: one
                    reader and one entry in FORMATS, and both plain and --sft preprocessing can read it
    chunks          cutting files into pieces a worker reads alone; PreprocessError
    indexed_output  the one atomic writer of .bin/.idx outputs (megatron-core's IndexedDatasetBuilder) and sidecars
    tokenizer       sentencepiece / HF tokenizers, never downloaded
    demo_text       the demo corpus (`threed demo-text`: Python's own reference docs)

Training data (`threed train`):
    splits          Megatron's data flags -> DataSplits (the blend of each split)
    checks          every bad dataset as one ConfigError, before anything is built
    sidecar         PREFIX.threed.json beside each dataset: tokenizer identity, the .bin's fingerprint, the flags
    datasets        megatron-core's dataset builder (GPTDataset; sft_dataset for SFT data)
    loader          micro-batches in Megatron's sample order, token-weighted SFT loss
    prefixes        how datasets are named on disk (PREFIX_{key}_document, the SFT mask beside the tokens)
"""
