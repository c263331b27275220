import math

import pytest

from minite.rl.lr_schedule import lr_at


def test_schedules():
    assert [lr_at(s, 4, 1.0) for s in range(1, 5)] == [1.0] * 4
    assert [lr_at(s, 4, 1.0, "linear") for s in range(1, 5)] == [1.0, 0.75, 0.5, 0.25]
    assert lr_at(1, 4, 1.0, "cosine") == 1.0 and lr_at(3, 4, 1.0, "cosine") == pytest.approx(0.5)
    assert [lr_at(s, 6, 1.0, "linear", warmup_steps=2) for s in (1, 2, 3, 6)] == [0.5, 1.0, 1.0, 0.25]
    assert all(lr_at(s, 10, 1.0, "cosine") > 0 for s in range(1, 11))
    assert lr_at(10, 10, 1.0, "cosine") == pytest.approx((1 + math.cos(math.pi * 0.9)) / 2)
    with pytest.raises(ValueError, match="schedule"):
        lr_at(1, 4, 1.0, "step")
