"""`moembed.model.kernels`: every C loop checks its arguments before a pointer crosses into C. Each kernel is called
wrongly (dtype, contiguity, shape, device, index ranges) and must raise MoembedError naming the argument, leaving
the inputs untouched; called rightly it gives the torch ops' result. (The builds: tests/test_native.py.)"""

from __future__ import annotations

import pytest
import torch

from moembed.errors import MoembedError
from moembed.model import kernels

needs = {name: pytest.mark.skipif(not kernels.available(name), reason=f"{name}.c not built: {kernels.why_not(name)}")
         for name in ("rowquant", "combine", "attention")}


def _refused(call, *words: str) -> None:
    with pytest.raises(MoembedError) as e:
        call()
    for w in words:
        assert w in str(e.value), str(e.value)


@needs["rowquant"]
def test_quantize_rows_refuses_wrong_arguments():
    x, keep, outliers = torch.randn(4, 16), torch.ones(16), torch.tensor([1, 3])
    kernels.quantize_rows(x, keep, outliers, 127.0, 128.0)  # the right call runs
    q = lambda **kw: (lambda: kernels.quantize_rows(**{"x": x, "keep": keep, "outliers": outliers,  # noqa: E731
                                                        "inv_step": 127.0, "zero": 128.0, **kw}))
    _refused(q(x=x.double()), "quantize_rows: x", "float32", "float64")
    _refused(q(x=torch.randn(16, 4).t()), "quantize_rows: x", "contiguous")
    _refused(q(x=torch.randn(4, 16, 1)), "quantize_rows: x", "shape")
    _refused(q(keep=torch.ones(15)), "quantize_rows: keep", "shape (16)")
    _refused(q(keep=torch.ones(16, dtype=torch.int32)), "quantize_rows: keep", "float32")
    _refused(q(outliers=torch.tensor([1, 3], dtype=torch.int32)), "quantize_rows: outliers", "int64")
    _refused(q(outliers=torch.tensor([1, 16])), "quantize_rows: outliers", "outside")  # channel 16 of 16
    _refused(q(outliers=torch.tensor([-1])), "quantize_rows: outliers", "outside")
    _refused(q(x=torch.randn(4, 16, device="meta")), "quantize_rows: x", "CPU")


@needs["rowquant"]
def test_rescale_rows_refuses_wrong_arguments_and_leaves_y_alone():
    y, m, bias = torch.randn(5, 8), torch.rand(5, 1), torch.randn(8)
    before = y.clone()
    r = lambda **kw: (lambda: kernels.rescale_rows(**{"y": y, "m": m, "bias": bias, "gelu": False, **kw}))  # noqa: E731
    _refused(r(m=torch.rand(4, 1)), "rescale_rows: m", "shape (5, 1)")
    _refused(r(m=torch.rand(5)), "rescale_rows: m", "shape")
    _refused(r(bias=torch.randn(9)), "rescale_rows: bias", "shape (8)")
    _refused(r(bias=torch.randn(8).bfloat16()), "rescale_rows: bias", "float32")
    _refused(r(y=torch.randn(8, 5).t()), "rescale_rows: y", "contiguous")
    _refused(r(y=y.half()), "rescale_rows: y", "float32")
    assert torch.equal(y, before)  # nothing was written
    torch.testing.assert_close(kernels.rescale_rows(y, m, bias, False), before * m + bias)


@needs["combine"]
def test_combine_rows_refuses_wrong_arguments():
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(3, 8, generator=g), None, torch.randn(2, 8, generator=g)]
    expert = torch.tensor([0, 2, 2, 0])  # N = 2 tokens, k = 2
    row = torch.tensor([0, 1, 0, 2])
    gates = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    want = torch.stack([0.75 * parts[0][0] + 0.25 * parts[2][1], 0.5 * parts[2][0] + 0.5 * parts[0][2]])
    torch.testing.assert_close(kernels.combine_rows(parts, expert, row, gates), want)
    c = lambda **kw: (lambda: kernels.combine_rows(**{"parts": parts, "expert": expert, "row": row,  # noqa: E731
                                                      "gates": gates, **kw}))
    _refused(c(row=torch.tensor([0, 2, 0, 2])), "combine_rows: row", "outside")  # expert 2 has 2 rows
    _refused(c(expert=torch.tensor([0, 1, 2, 0])), "combine_rows: row", "outside")  # expert 1 has no buffer
    _refused(c(expert=torch.tensor([0, 3, 2, 0])), "combine_rows: expert", "outside")
    _refused(c(expert=torch.tensor([0, 2, 2])), "combine_rows: expert", "shape (4)")
    _refused(c(row=row.int()), "combine_rows: row", "int64")
    _refused(c(gates=gates.double()), "combine_rows: gates", "float32")
    _refused(c(gates=gates.t()), "combine_rows: gates", "contiguous")
    _refused(c(parts=[parts[0], None, parts[2].bfloat16()]), "combine_rows: parts[2]", "float32", "bfloat16")
    _refused(c(parts=[parts[0], None, torch.randn(2, 7)]), "combine_rows: parts[2]", "shape (·, 8)")
    _refused(c(parts=[torch.randn(8, 3).t(), None, parts[2]]), "combine_rows: parts[0]", "contiguous")
    _refused(c(parts=[parts[0].half(), None, parts[2].half()]), "combine_rows: parts[0]", "float32 or bfloat16")
    _refused(c(bias=torch.zeros(7)), "combine_rows: bias", "shape (8)")
    _refused(c(parts=[None, None, None]), "combine_rows: parts", "missing")


@needs["attention"]
def test_attention_refuses_wrong_arguments():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 32, generator=g) for _ in range(3))
    lengths = torch.tensor([5, 3])
    assert kernels.attention(q, k, v, lengths).shape == q.shape
    a = lambda **kw: (lambda: kernels.attention(**{"q": q, "k": k, "v": v, "lengths": lengths, **kw}))  # noqa: E731
    _refused(a(q=q.double(), k=k.double(), v=v.double()), "attention: q", "float32 or bfloat16")
    _refused(a(k=k.bfloat16()), "attention: k", "float32")  # one dtype for all three
    _refused(a(v=v[:, :, :4]), "attention: v", "shape (2, 2, 5, 32)")
    _refused(a(q=q[..., :16], k=k[..., :16], v=v[..., :16]), "heads of 16")
    _refused(a(k=k.transpose(2, 3).contiguous().transpose(2, 3)), "attention: k", "unit stride")
    _refused(a(lengths=torch.tensor([6, 3])), "attention: lengths", "outside")  # longer than T = 5
    _refused(a(lengths=torch.tensor([5, 3], dtype=torch.int32)), "attention: lengths", "int64")
    _refused(a(lengths=torch.tensor([5])), "attention: lengths", "shape (2)")


@needs["attention"]
def test_packed_attention_refuses_rows_outside_qkv():
    qkv = torch.randn(7, 3 * 64)
    starts, lengths = torch.tensor([0, 4]), torch.tensor([4, 3])
    assert kernels.packed_attention(qkv, starts, lengths, 2).shape == (7, 64)
    p = lambda **kw: (lambda: kernels.packed_attention(**{"qkv": qkv, "starts": starts,  # noqa: E731
                                                          "lengths": lengths, "heads": 2, **kw}))
    _refused(p(starts=torch.tensor([0, 5])), "packed_attention: starts", "outside")  # rows 5..7 of 7
    _refused(p(lengths=torch.tensor([4, 8])), "packed_attention: lengths", "outside")
    _refused(p(starts=torch.tensor([0])), "packed_attention: lengths", "shape (1)")
    _refused(p(heads=5), "packed_attention: qkv", "3 x 5 heads")
    _refused(p(qkv=torch.randn(3 * 64, 7).t()), "packed_attention: qkv", "contiguous")
