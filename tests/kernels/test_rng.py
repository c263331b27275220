"""The sampler's uniforms in one launch: bitwise the reference hash (`minite.ref.rng`)."""

import pytest
import torch

from minite.kernels import available
from minite.kernels import rng as krng
from minite.ref import rng as rrng
from minite.sampler.rng import key_tensor, sample_key
from tests.kernels.helpers import device

pytestmark = pytest.mark.skipif(not available(), reason="Triton kernels unavailable")


def test_uniforms_kernel_equals_the_reference_bitwise():
    """Keys over the whole 64-bit range (high bit set included), steps past 2^32 (reduced mod 2^32)."""
    g = torch.Generator().manual_seed(0)
    keys = [sample_key(s, r, i) for s in (0, 7) for r in range(40) for i in range(8)]
    keys += [0, 1, 2**63, 2**64 - 1, 0xFFFFFFFF, 2**32]
    steps = torch.randint(0, 2**40, (len(keys),), generator=g)
    steps[:6] = torch.tensor([0, 1, 2**32 - 1, 2**32, 2**33 + 5, 511])
    k = key_tensor(keys)
    want = rrng.uniforms(k, steps)
    got = krng.uniforms(k.to(device()), steps.to(device())).cpu()
    assert torch.equal(got, want)
    assert 0.0 <= got.min() and got.max() < 1.0
    assert krng.uniforms(k[:0].to(device()), steps[:0].to(device())).numel() == 0
    with pytest.raises(ValueError, match="int64"):
        krng.uniforms(k.int(), steps)
