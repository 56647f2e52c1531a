"""Every torch feature threed uses that some supported torch releases lack, checked at its boundary on CPU by
faking the release that lacks it (docs/torch-versions.md lists them). The pinned torch (2.13) has them all; the
lent GPU machine's 2.11 lacks varlen_attn's `enable_gqa` and torchrun's `--shutdown-timeout`, and each cost a
whole run there before it was guarded by capability.

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/unit/test_torch_versions.py
"""

from __future__ import annotations

import argparse
import sys

import pytest
import torch
import torch.nn.attention.varlen  # noqa: F401  (the module the fakes replace a function of)
import torch.nn.functional as F

import threed.model.attention as attention
from threed.model.attention import SDPACoreAttention, document_segments

HEADS, KV_HEADS, D, S, B = 4, 2, 8, 12, 2


def _per_document(q, k, v, cu, scale):
    """Causal attention on each document of the flat [tokens, heads, d] batch: what varlen_attn computes."""
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [heads, n, d]
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outs)


class FakeVarlen:
    """A CPU stand-in for torch.nn.attention.varlen.varlen_attn (CUDA only), recording its calls; `gqa`: whether
    it takes `enable_gqa` (2.13) or not (2.11: a TypeError for the keyword, as torch's own would raise)."""

    def __init__(self, gqa: bool):
        self.calls: list[dict] = []
        self.fn = self._with_gqa if gqa else self._without_gqa

    def _without_gqa(self, q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        self.calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), window_size=window_size, gqa=None))
        assert k.shape[1] == q.shape[1], "a kernel without enable_gqa needs as many K/V heads as query heads"
        return _per_document(q, k, v, cu_q, scale)

    def _with_gqa(
        self, q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False
    ):
        self.calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), window_size=window_size, gqa=enable_gqa))
        if enable_gqa:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return _per_document(q, k, v, cu_q, scale)


def _packed_inputs():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(S, B, HEADS, D, generator=gen, requires_grad=True)
    k, v = (torch.randn(S, B, KV_HEADS, D, generator=gen, requires_grad=True) for _ in range(2))
    docs = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [7] * 8 + [3] * 4])
    return q, k, v, document_segments(docs)


def _run(monkeypatch, fake) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The packed forward + backward with `fake` as torch's varlen_attn and the varlen path taken on CPU (its only
    other conditions are CUDA and half precision; the capability checks stay in play)."""
    if fake is not None:
        monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", fake)
    monkeypatch.setattr(attention, "_varlen_usable", lambda query: attention.varlen_kernel() is not None)
    attention._PER_TENSOR.clear()
    q, k, v, segments = _packed_inputs()
    out = SDPACoreAttention(None, 1)(q, k, v, attention_mask=segments)
    out.sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]


def _mask_path() -> tuple[torch.Tensor, list[torch.Tensor]]:
    attention._PER_TENSOR.clear()
    q, k, v, segments = _packed_inputs()
    out = SDPACoreAttention(None, 1)(q, k, v, attention_mask=segments)
    out.sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("gqa", [False, True], ids=["torch-2.11-no-enable_gqa", "torch-2.13-enable_gqa"])
def test_varlen_gqa_by_capability(monkeypatch, gqa) -> None:
    """Without `enable_gqa` (torch 2.11) the K/V heads are repeated to the query heads before the call; with it
    (2.13) they go as they are. Either way: the numbers of the SDPA mask path, forward and backward."""
    fake = FakeVarlen(gqa)
    out, grads = _run(monkeypatch, fake.fn)
    (call,) = fake.calls
    assert call["q"] == (B * S, HEADS, D) and call["window_size"] == (-1, 0)
    assert call["k"] == ((B * S, KV_HEADS, D) if gqa else (B * S, HEADS, D))
    assert call["gqa"] == (True if gqa else None)
    want, want_grads = _mask_path()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_varlen_without_window_size_takes_the_mask_path(monkeypatch) -> None:
    """A varlen_attn that says causal as `is_causal` (older releases) is not used: the SDPA mask path runs."""
    calls = []

    def older(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, return_aux=None, scale=None):
        calls.append(1)
        raise AssertionError("not to be called")

    out, _ = _run(monkeypatch, older)
    assert not calls
    torch.testing.assert_close(out, _mask_path()[0])


def test_no_varlen_module_takes_the_mask_path(monkeypatch) -> None:
    """torch without torch.nn.attention.varlen (before 2.9): the import fails and the mask path runs."""
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)  # `import` raises ImportError
    assert attention.varlen_kernel() is None
    out, _ = _run(monkeypatch, None)
    torch.testing.assert_close(out, _mask_path()[0])


def _torchrun_parser(parser: argparse.ArgumentParser, with_option: bool) -> argparse.ArgumentParser:
    """torchrun's parser as torch 2.13 (`with_option`) or 2.11 has it, made from the running torch's: the option
    added as 2.13 declares it, or removed as argparse's own conflict handling removes one."""
    action = parser._option_string_actions.get("--shutdown-timeout")
    if with_option and action is None:
        parser.add_argument("--shutdown-timeout", "--shutdown_timeout", type=int, default=None)
    elif not with_option and action is not None:
        for option in action.option_strings:
            del parser._option_string_actions[option]
        action.container._remove_action(action)
    return parser


@pytest.mark.parametrize("has_option", [False, True], ids=["torch-2.11-torchrun", "torch-2.13-torchrun"])
def test_shutdown_timeout_only_where_torchrun_takes_it(monkeypatch, has_option) -> None:
    """torch 2.11's torchrun exits 2 on --shutdown-timeout before any rank starts (`threed train --nproc-per-node`,
    recipes/launch.sh): the launcher passes it only where torchrun's parser knows it, and torchrun then parses
    what it is given."""
    import torch.distributed.run as torchrun

    from threed.parallel import launch

    if not has_option:
        with pytest.raises(SystemExit):  # what torch 2.11's torchrun does with the option
            _torchrun_parser(torchrun.get_args_parser(), False).parse_args(["--shutdown-timeout=9", "x.py"])
    parser = _torchrun_parser(torchrun.get_args_parser(), has_option)
    monkeypatch.setattr(torchrun, "get_args_parser", lambda: parser)
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    parsed = []
    monkeypatch.setattr(torchrun, "parse_args", lambda argv: parsed.append(torchrun.get_args_parser().parse_args(argv)))
    monkeypatch.setattr(torchrun, "run", lambda args: None)
    argv = ["--nproc-per-node=2", "--standalone", "-m", "threed.cli", "train"]
    assert launch.torchrun_takes("--shutdown-timeout") == has_option
    assert launch.torchrun_main(argv) == 0  # the fake 2.11 parser exits 2 on the option, as the real one did
    (args,) = parsed
    if has_option:
        assert args.shutdown_timeout == launch.SHUTDOWN_TIMEOUT_S
    else:
        assert not hasattr(args, "shutdown_timeout")
    # Said explicitly (or through torch's environment variable), the user's choice is left as it is.
    assert launch.with_shutdown_timeout(["--shutdown-timeout=5", *argv]) == ["--shutdown-timeout=5", *argv]
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "60")
    assert launch.with_shutdown_timeout(argv) == argv


@pytest.mark.parametrize(
    "version,refused",
    [
        ("2.10.1+cu128", True),
        ("1.13.1", True),
        ("2.11.0", False),
        ("2.11.0+cu130", False),
        ("2.12.0a0+git1234567", False),
        ("2.13.0+cpu", False),
        ("3.0.0.dev20270101", False),
        ("custom", False),
    ],
)
def test_the_floor_is_one_version(version, refused) -> None:
    from threed.parallel.distributed import MIN_TORCH, torch_too_old

    assert MIN_TORCH == (2, 11)
    line = torch_too_old(version)
    assert (line is not None) == refused
    if refused:
        assert "\n" not in line and version in line and ">= 2.11" in line and "docs/torch-versions.md" in line


def test_a_torch_below_the_floor_is_refused_before_anything_starts(monkeypatch) -> None:
    """`init_distributed` (every rank of `threed train`, `threed verify`, `threed profile-layers`) refuses it in one
    line (a ConfigError: exit 2, rank 0 speaks) before DeepSpeed is imported or a process group is made."""
    from threed.config import ConfigError
    from threed.parallel import distributed

    monkeypatch.setattr(torch, "__version__", "2.10.0+cu126")
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # importing it would raise ImportError, not ConfigError
    with pytest.raises(ConfigError, match=r"torch 2\.10\.0\+cu126 is older than threed supports"):
        distributed.init_distributed()
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("has_single", [False, True], ids=["torch-2.11", "torch-2.13"])
def test_all_gather_under_the_name_torch_has(monkeypatch, has_single) -> None:
    """The per-stage metrics gather: all_gather_single where torch has it (2.13, which deprecates the old name),
    all_gather_into_tensor where it does not (2.11); both fill the same output."""
    import torch.distributed as dist

    from threed.metrics.stages import all_gather_into

    if not has_single:
        monkeypatch.delattr(dist, "all_gather_single", raising=False)
    elif not hasattr(dist, "all_gather_single"):  # running on a torch without it: the new name, as 2.13 has it
        monkeypatch.setattr(dist, "all_gather_single", dist.all_gather_into_tensor, raising=False)
    fn = all_gather_into()
    assert fn is (dist.all_gather_single if has_single else dist.all_gather_into_tensor)
    if dist.is_initialized():
        return  # another test's process group: not ours to make a world of one in
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out = torch.empty(3, dtype=torch.float64)
        fn(out, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
        assert out.tolist() == [1.0, 2.0, 3.0]
    finally:
        dist.destroy_process_group()
