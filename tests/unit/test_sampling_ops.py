"""The C++ row argmax (kernels/cpu_sampling_ops.cpp) against torch.argmax: random rows in float32 and bfloat16
(where ties are common), ties resolved to the lowest index, NaN rows, all -inf rows, the maximum at either end,
rows read through a stride; the fallbacks; malformed input refused."""
import pytest
import torch

from kernels import cpu_paged_attention, sampling_ops

kernel = cpu_paged_attention.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ compiler: the engine uses torch.argmax")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 49152, 151936])
def test_argmax_equals_torch_on_random_rows(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(33, vocab, generator=g).mul(8).to(dtype)
    out = sampling_ops.argmax(x)
    assert out.dtype == torch.int64 and torch.equal(out, x.argmax(-1))
    ties = torch.randint(-50, 50, (33, vocab), generator=g).to(dtype)  # integer logits: repeated maxima
    assert torch.equal(sampling_ops.argmax(ties), ties.argmax(-1))
    if vocab > 1000:
        assert all((row == row.max()).sum() > 1 for row in ties)


def test_ties_nan_infinities_and_the_ends_of_a_row():
    x = torch.zeros(6, 100)
    x[0, [17, 3, 90]] = 5.0                      # tie: lowest index
    x[1, [40, 60]] = float("nan")                # NaN: the first NaN, as torch
    x[1, 10] = float("inf")
    x[2] = float("-inf")                         # every token banned: index 0, as torch
    x[3, 99] = 1.0                               # the last element
    x[4, 0] = 1.0                                # the first
    x[5, [20, 70]] = float("inf")
    assert torch.equal(sampling_ops.argmax(x), x.argmax(-1))
    assert sampling_ops.argmax(x).tolist() == [3, 40, 0, 99, 0, 20]


def test_strided_rows_and_other_inputs():
    base = torch.randn(8, 300)
    view = base[:, :200]                         # rows strided by 300: read in place
    assert torch.equal(sampling_ops.argmax(view), view.argmax(-1))
    for other in (base.double(), base.half(), base.t(), base[:, :0]):  # the torch path
        assert torch.equal(sampling_ops.argmax(other), other.argmax(-1)) if other.shape[-1] else True
    with pytest.raises(RuntimeError):
        kernel.argmax_rows(base.double())
    with pytest.raises(RuntimeError):
        kernel.argmax_rows(base[:, :0])
