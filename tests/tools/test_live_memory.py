"""trl_ext.tools.live_memory on known allocations: the counter measures what the planner is validated with."""

import torch

from trl_ext.tools.live_memory import LiveTensorBytes, PhasePeaks


def test_counts_new_storages_once_and_frees_them_with_their_last_tensor():
    with LiveTensorBytes() as live:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 B
        b = torch.empty(10, 100, dtype=torch.bfloat16)  # 2000 B
        view = a[10:20].view(2, 5)  # a view: no new storage
        assert live.current == 6000 and live.peak == 6000
        del a
        assert live.current == 6000  # the view keeps a's storage alive
        del view
        assert live.current == 2000
        c = b.float()  # a new fp32 copy: 4000 B
        assert live.current == 6000
        del b, c
        assert live.current == 0 and live.peak == 6000
        live.reset_peak()
        assert live.peak == 0


def test_in_place_resize_autograd_saved_tensors_and_gradients():
    with LiveTensorBytes() as live:
        x = torch.empty(0)
        x.resize_(250)  # 1000 B, grown in place
        assert live.current == 1000
        del x
        w = torch.randn(64, 32, requires_grad=True)  # 8192 B
        inp = torch.randn(16, 64)  # 4096 B
        y = (inp @ w).relu()  # (16, 32) out 2048 B; matmul out 2048 B saved for relu's backward? relu saves its out
        start = live.current
        y.sum().backward()
        assert w.grad is not None and w.grad.untyped_storage().nbytes() == 8192
        del y
        assert live.current < start + 8192 + 1  # the graph's saved tensors are freed, the gradient stays
        assert live.peak >= start + 8192  # the gradient coexisted with the graph at its peak
        del w, inp
        assert live.current == 0


def test_tensors_made_before_the_mode_are_not_counted():
    before = torch.empty(1000)
    with LiveTensorBytes() as live:
        before.add_(1.0)  # in place on an outside storage: counted from now on
        assert live.current == 4000
    del before


def test_phase_peaks_per_outermost_phase_and_iteration():
    with LiveTensorBytes() as live:
        peaks = PhasePeaks(live)
        for iteration in range(2):
            peaks.start("generation")
            tmp = torch.empty(100 * (iteration + 1))  # 400, 800 B
            del tmp
            peaks.stop("generation")
            peaks.start("update")
            peaks.start("reference")  # nested: belongs to "update"
            tmp = torch.empty(1000)
            del tmp
            peaks.stop("reference")
            peaks.stop("update")
    assert peaks.peaks == [{"generation": 400, "update": 4000}, {"generation": 800, "update": 4000}]
