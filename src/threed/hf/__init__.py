"""The Hugging Face side of a checkpoint, with no knowledge of our pipeline layout: what an HF Llama directory
holds (`format`), its config.json <-> ModelConfig (`config`), and safetensors read (`read`) and write (`write`).

The mapping from HF tensor names to our pipeline layers' state dicts is not here: that is `threed.convert`.
"""
