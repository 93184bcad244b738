"""Dense layers (shared/model/linear.py): weights packed for oneDNN give F.linear's result for any row count —
float32 to rounding, bfloat16 bit for bit where the CPU has native bfloat16 dot products (else a bfloat16 weight
stays plain); float64 is never packed."""
import pytest
import torch
import torch.nn.functional as F

from shared.model.linear import bf16_packs, linear, prepare_weight

packing = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@pytest.mark.skipif(not packing, reason="this torch build has no oneDNN weight packing")
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_packed_weights_give_f_linears_result(rows):
    g = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(200, 96, generator=g), torch.randn(200, generator=g), torch.randn(rows, 96, generator=g)
    packed = prepare_weight(w)
    assert packed.is_mkldnn
    torch.testing.assert_close(linear(x, packed, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    wb, xb = w.bfloat16(), x.bfloat16()
    packed_b = prepare_weight(wb)
    assert packed_b.is_mkldnn == bf16_packs()
    assert torch.equal(linear(xb, packed_b), F.linear(xb, wb))
    assert not prepare_weight(w.double()).is_mkldnn
