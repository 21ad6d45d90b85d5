"""Engines over parameter groups: a group reduced over a subgroup of the data-parallel ranks, with the whole
group's divisor, trains as one process does (the seam experts plug into)."""
import functools

import pytest
import torch

import dist_fns
from dp_cases import ATOL, MODES, RTOL
from shardlm.testing.distributed import run_distributed


@functools.cache
def _reference():
    return dist_fns.subgroup_reduction(0, 1, {})


@pytest.mark.parametrize("mode", ["ddp", "zero1", "zero2", "zero3"])
def test_subgroup_reduction_equals_one_process(mode):
    ref = _reference()
    results = run_distributed(dist_fns.subgroup_reduction, 4, MODES[mode], timeout=240)
    for r in results:
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=RTOL, atol=0)
        torch.testing.assert_close(r["grad_norms"], ref["grad_norms"], rtol=RTOL, atol=0)
        assert r["masters"].keys() == ref["masters"].keys()
        for name, value in ref["masters"].items():
            torch.testing.assert_close(r["masters"][name], value, rtol=RTOL, atol=ATOL, msg=name)
