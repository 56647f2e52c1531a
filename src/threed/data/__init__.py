"""The data path: tokenizers, datasets, preprocessing."""
