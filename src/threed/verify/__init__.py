"""`threed verify`: an HF Llama and a DeepSpeed pipeline checkpoint give the same logits.

Above training in the house (layer 8), not inside threed.convert: its ranks build the training engine and load the
checkpoint the way `threed train --init-from` does. `parity` runs HF and compares; `worker` is one engine rank.
"""
