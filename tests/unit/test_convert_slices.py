"""The converter's streaming per-rank path (threed.convert.slices) equals the reference mapping
`layer_from_hf` bit for bit, for every layer kind, tp, dtype and source reader.

    .venv/bin/python -m pytest -q tests/unit/test_convert_slices.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from convert_fixtures import GQA4, GQA8, hf_model, save_hf
from threed.convert.from_hf import convert_rank
from threed.convert.mapping import layer_from_hf
from threed.hf.names import hf_shapes
from threed.convert.slices import DictReader, Piece, ShardReader
from threed.hf.config import from_hf_config
from threed.hf.read import HFSource
from threed.model.spec import pipeline_layers

MHA = dict(GQA4, num_key_value_heads=8, vocab_size=333)  # no GQA; a vocab far from any padding multiple


@pytest.mark.parametrize("config,tps", [(GQA8, (1, 2, 4, 8)), (GQA4, (1, 2, 4)), (MHA, (1, 2, 4, 8))])
@pytest.mark.parametrize("source", ["dict", "safetensors", "bin"])
def test_rank_slices_equal_layer_from_hf(tmp_path, config, tps, source):
    dtype = torch.bfloat16 if source == "bin" else torch.float32
    model = hf_model(config, seed=1, dtype=dtype)
    hf = model.state_dict()
    if source == "dict":
        reader = DictReader(hf)
    else:
        reader = HFSource(save_hf(tmp_path / "m", config, fmt=source, shard_kb=40, seed=1, dtype=dtype))
    cfg = dataclasses.replace(from_hf_config(model.config.to_dict()), make_vocab_size_divisible_by=16)
    for tp in tps:
        for layer in pipeline_layers(cfg):
            ref = layer_from_hf(cfg, layer, hf, tp)
            for rank in range(tp):
                got = {k: v for k, v in convert_rank(cfg, layer, reader, tp, rank).items() if v is not None}
                assert got.keys() == ref[rank].keys()
                for k in got:
                    assert got[k].dtype == ref[rank][k].dtype and torch.equal(got[k], ref[rank][k]), (
                        tp,
                        rank,
                        layer,
                        k,
                    )
                    assert got[k].untyped_storage().nbytes() == got[k].numel() * got[k].element_size()


def test_shard_reader_inverts_rank_slices():
    """Reading HF slices back out of TP shards (export / reshard) gives the HF tensors, and re-sharding through
    it gives layer_from_hf at the new tp, for every pair of tp."""
    model = hf_model(GQA8, seed=2)
    hf = model.state_dict()
    cfg = dataclasses.replace(from_hf_config(model.config.to_dict()), make_vocab_size_divisible_by=16)
    for layer in pipeline_layers(cfg):
        for old in (1, 2, 4, 8):
            shards = layer_from_hf(cfg, layer, hf, old)
            reader = ShardReader(cfg, layer, old, lambda rank: shards[rank])
            for name, shape in hf_shapes(cfg, layer).items():
                dim = reader.split_dim(name)
                out = torch.empty(shape)
                reader.read_into(Piece(name, dim, 0, shape[dim]), out)
                assert torch.equal(out, hf[name]), (layer, old, name)
            for new in (1, 2, 4, 8):
                ref = layer_from_hf(cfg, layer, hf, new)
                for rank in range(new):
                    got = convert_rank(cfg, layer, reader, new, rank)
                    assert all(torch.equal(got[k], ref[rank][k]) for k in ref[rank]), (layer, old, new, rank)
