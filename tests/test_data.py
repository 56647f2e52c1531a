"""The data path: tokenizer training, tokenizing with BOS/EOS, and deterministic, disjoint, resumable batches."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import sentencepiece as spm

from helpers import write_tokens
from threed.data.flat import TokenDataset, micro_batches, tokenize_files
from threed.data.tokenizer import train_tokenizer
from threed.demo_text import write_demo_text


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    text = write_demo_text(str(d / "corpus.txt"))
    model = train_tokenizer([text], 512, str(d / "tok"))
    n = tokenize_files([text], model, str(d / "tokens.bin"))
    return d, model, n


def test_tokenize_adds_bos_and_eos_per_document(tokenized):
    d, model, n = tokenized
    sp = spm.SentencePieceProcessor(model_file=model)
    ds = TokenDataset(str(d / "tokens.bin"), 64, vocab_size=512)
    assert len(ds.tokens) == n > 50_000
    assert ds.tokens[0] == sp.bos_id()
    assert (ds.tokens == sp.bos_id()).sum() == (ds.tokens == sp.eos_id()).sum() > 100
    assert not (d / "tokens.bin.tmp").exists()


def test_vocab_mismatch_is_refused(tokenized):
    d, _, _ = tokenized
    with pytest.raises(ValueError, match="tokenizer of 512 pieces, more than the model's vocab_size 500"):
        TokenDataset(str(d / "tokens.bin"), 64, vocab_size=500)


def _ids(it, count):
    return [tuple(x[:, 0].tolist()) for x, _ in itertools.islice(it, count)]


def test_batches_are_disjoint_across_dp_and_match_a_dp1_run(tmp_path):
    ds = TokenDataset(write_tokens(tmp_path / "t.bin", np.arange(20_000) % 60_000, 60_000), 16)
    micro, gas, dp, steps = 2, 3, 2, 4
    per_rank = [_ids(micro_batches(ds, micro, gas, dp, r, 0, seed=7), gas * steps) for r in range(dp)]
    single = _ids(micro_batches(ds, micro, gas * dp, 1, 0, 0, seed=7), gas * dp * steps)
    for step in range(steps):
        ranks = [set(itertools.chain(*per_rank[r][step * gas:(step + 1) * gas])) for r in range(dp)]
        assert not ranks[0] & ranks[1], "data-parallel replicas must read disjoint samples"
        assert ranks[0] | ranks[1] == set(itertools.chain(*single[step * gas * dp:(step + 1) * gas * dp]))


def test_resume_continues_the_same_stream(tmp_path):
    ds = TokenDataset(write_tokens(tmp_path / "t.bin", np.arange(5_000) % 1000, 1000), 8)
    full = _ids(micro_batches(ds, 2, 2, 1, 0, 0, seed=3), 2 * 300)  # 600 micro-batches: several epochs
    resumed = _ids(micro_batches(ds, 2, 2, 1, 0, 120, seed=3), 2 * 180)
    assert resumed == full[240:]
    labels_shift = next(micro_batches(ds, 2, 1, 1, 0, 0, seed=3))
    assert (labels_shift[0][:, 1:] == labels_shift[1][:, :-1]).all()


def test_hf_tokenizer_json_is_accepted(tmp_path):
    """Llama 3 ships a tokenizer.json (tiktoken BPE), not a sentencepiece model: a local HF tokenizer works too."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    hf.save(str(tmp_path / "tok" / "tokenizer.json"))
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok" / "tokenizer.json"), bos_token="<s>",
                            eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path / "tok")
    (tmp_path / "t.txt").write_text("a b a\n\nb b")
    assert tokenize_files([str(tmp_path / "t.txt")], str(tmp_path / "tok"), str(tmp_path / "t.bin")) == 9
    assert np.fromfile(tmp_path / "t.bin", dtype=np.uint16).tolist() == [1, 3, 4, 3, 2, 1, 4, 4, 2]
