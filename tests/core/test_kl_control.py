"""Tests for trl_ext.core.kl_control: hand-worked sequences, a plain-python reference loop, bounds, state round trips
and bad input.

kl_control.py imports only `typing`, so it is loaded straight from its file: `import trl_ext.core` would run
trl_ext/__init__.py, which imports trl (~8 s), and even torch alone takes ~2 s; this file must run in well under 2 s.
"""
import ast
import importlib.util
import json
import math
import pathlib
import random

import pytest

CORE_DIR = pathlib.Path(__file__).resolve().parents[2] / "trl_ext" / "core"
_spec = importlib.util.spec_from_file_location("_kl_control_under_test", CORE_DIR / "kl_control.py")
kc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kc)

FixedKLController = kc.FixedKLController
AdaptiveKLController = kc.AdaptiveKLController
make_kl_controller = kc.make_kl_controller
KL_CONTROLLERS = kc.KL_CONTROLLERS

SEEDS = [0, 1, 2, 3, 4]


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Overrides conftest's fixture of the same name: nothing here builds an Accelerator, and importing accelerate
    (which imports torch) would cost ~2 s."""
    yield


def reference_adaptive(beta0, target, horizon, updates):
    """Ziegler et al. 2019 sec. 2.2 written out with python floats: returns β after each (kl, n) update."""
    beta, out = beta0, []
    for kl, n in updates:
        e = (kl - target) / target
        if e > 0.2:
            e = 0.2
        if e < -0.2:
            e = -0.2
        beta = beta * (1 + e * n / horizon)
        out.append(beta)
    return out


def random_updates(rng, count, horizon, kl_scale=20.0):
    # KLs from far below (including negative, possible with the k1 estimator) to far above the target
    return [(rng.uniform(-2.0, kl_scale), rng.randint(1, horizon)) for _ in range(count)]


# ---------------------------------------------------------------- hand-worked numbers


def test_adaptive_hand_computed_sequence():
    # β0 = 0.1, target = 6, horizon = 10000, n = 64 rollouts per batch, so n/horizon = 0.0064
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # KL = 12:  e = (12 − 6)/6 = 1.0 → clip 0.2;   factor 1 + 0.2·0.0064 = 1.00128
    #           β = 0.1 · 1.00128 = 0.100128
    assert ctl.update(12.0, 64) == pytest.approx(0.100128, rel=1e-12)
    assert ctl.value == pytest.approx(0.100128, rel=1e-12)
    # KL = 3:   e = (3 − 6)/6 = −0.5 → clip −0.2;  factor 1 − 0.00128 = 0.99872
    #           β = 0.100128 · 0.99872 = 0.100128 − 0.00012816384 = 0.09999983616
    ctl.update(3.0, 64)
    assert ctl.value == pytest.approx(0.09999983616, rel=1e-12)
    # KL = 6.6: e = 0.6/6 = 0.1 (inside the clip);  factor 1 + 0.1·0.0064 = 1.00064
    #           β = 0.09999983616 · 1.00064 = 0.09999983616 + 0.0000639998951424 = 0.1000638360551424
    ctl.update(6.6, 64)
    assert ctl.value == pytest.approx(0.1000638360551424, rel=1e-12)
    # KL = 6:   e = 0, factor 1: β unchanged
    ctl.update(6.0, 64)
    assert ctl.value == pytest.approx(0.1000638360551424, rel=1e-12)
    # KL = 5.7: e = −0.3/6 = −0.05;  factor 1 − 0.05·0.0064 = 0.99968
    #           β = 0.1000638360551424 · 0.99968 = 0.1000638360551424 − 0.0000320204275376 = 0.1000318156276048
    ctl.update(5.7, 64)
    assert ctl.value == pytest.approx(0.1000318156276048, rel=1e-12)


def test_adaptive_clip_applies_to_proportional_error_not_kl():
    # n = horizon makes the factor 1 + e exactly: KL = 100 (e = 15.67) and KL = 7.2 (e = 0.2) give the same ×1.2;
    # KL = 0 (e = −1) and KL = 4.8 (e = −0.2) the same ×0.8; KL = 6.3 (e = 0.05) gives ×1.05
    for kl, factor in [(100.0, 1.2), (7.2, 1.2), (0.0, 0.8), (-50.0, 0.8), (4.8, 0.8), (6.3, 1.05), (6.0, 1.0)]:
        ctl = AdaptiveKLController(0.5, target=6.0, horizon=8)
        ctl.update(kl, 8)
        assert ctl.value == pytest.approx(0.5 * factor, rel=1e-12), kl


# ---------------------------------------------------------------- direction and bounds


@pytest.mark.parametrize("n", [1, 64, 512])
def test_adaptive_direction(n):
    for kl, expect in [(6.01, "up"), (9.0, "up"), (1e6, "up"), (5.99, "down"), (0.0, "down"), (-3.0, "down"),
                       (6.0, "same")]:
        ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000)
        ctl.update(kl, n)
        if expect == "up":
            assert ctl.value > 0.2, kl
        elif expect == "down":
            assert 0 < ctl.value < 0.2, kl
        else:
            assert ctl.value == 0.2


@pytest.mark.parametrize("seed", SEEDS)
def test_adaptive_moves_at_most_20_percent_times_n_over_horizon(seed):
    rng = random.Random(seed)
    horizon = rng.choice([16, 1000, 10000])
    ctl = AdaptiveKLController(rng.uniform(0.01, 1.0), target=rng.uniform(0.5, 10.0), horizon=horizon)
    for kl, n in random_updates(rng, 1000, horizon):
        before = ctl.value
        after = ctl.update(kl, n)
        assert after == ctl.value
        ratio = after / before
        bound = 0.2 * n / horizon
        assert 1 - bound - 1e-12 <= ratio <= 1 + bound + 1e-12, (kl, n, ratio, bound)
        assert 0.8 - 1e-12 <= ratio <= 1.2 + 1e-12
        assert 0 < after < math.inf


def test_adaptive_converges_in_the_right_direction_over_many_updates():
    # KL stuck at 2× target for 100 batches with n = horizon/10: β grows by exactly 1.02^100
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=640)
    for _ in range(100):
        ctl.update(12.0, 64)
    assert ctl.value == pytest.approx(0.1 * 1.02 ** 100, rel=1e-10)
    # then stuck at 0: falls by 0.98^100
    for _ in range(100):
        ctl.update(0.0, 64)
    assert ctl.value == pytest.approx(0.1 * 1.02 ** 100 * 0.98 ** 100, rel=1e-10)


# ---------------------------------------------------------------- reference loop and state


@pytest.mark.parametrize("seed", SEEDS)
def test_adaptive_matches_reference_loop(seed):
    rng = random.Random(seed)
    beta0, target, horizon = rng.uniform(0.01, 0.5), rng.uniform(1.0, 12.0), rng.choice([64, 1000, 10000])
    updates = random_updates(rng, 100, horizon, kl_scale=3 * target)
    ctl = AdaptiveKLController(beta0, target, horizon)
    got = [ctl.update(kl, n) for kl, n in updates]
    want = reference_adaptive(beta0, target, horizon, updates)
    assert got == pytest.approx(want, rel=1e-12)
    assert got[-1] != pytest.approx(beta0, rel=1e-6)  # the sequence actually moved β


@pytest.mark.parametrize("seed", SEEDS)
def test_adaptive_state_dict_round_trip_reproduces_future(seed):
    rng = random.Random(seed)
    ctl = AdaptiveKLController(0.05, target=6.0, horizon=10000)
    for kl, n in random_updates(rng, 30, 512):
        ctl.update(kl, n)
    state = ctl.state_dict()
    assert set(state) == {"value", "target", "horizon"}
    assert state["value"] == ctl.value and state["target"] == 6.0 and state["horizon"] == 10000
    state = json.loads(json.dumps(state))  # checkpoint-friendly: plain python numbers

    resumed = AdaptiveKLController(0.9, target=1.0, horizon=77)  # different everything, all overwritten
    resumed.load_state_dict(state)
    assert (resumed.value, resumed.target, resumed.horizon) == (ctl.value, ctl.target, ctl.horizon)
    future = random_updates(rng, 50, 512)
    assert [resumed.update(kl, n) for kl, n in future] == [ctl.update(kl, n) for kl, n in future]


def test_state_dict_is_a_copy():
    ctl = AdaptiveKLController(0.1, 6.0, 10000)
    ctl.state_dict()["value"] = 123.0
    assert ctl.value == 0.1
    fixed = FixedKLController(0.1)
    fixed.state_dict()["value"] = 123.0
    assert fixed.value == 0.1


def test_value_is_read_only():
    with pytest.raises(AttributeError):
        AdaptiveKLController(0.1, 6.0, 10000).value = 1.0
    with pytest.raises(AttributeError):
        FixedKLController(0.1).value = 1.0


# ---------------------------------------------------------------- fixed controller and factory


@pytest.mark.parametrize("seed", SEEDS)
def test_fixed_never_changes(seed):
    rng = random.Random(seed)
    ctl = FixedKLController(0.07)
    for kl, n in random_updates(rng, 200, 10000, kl_scale=1e6):
        assert ctl.update(kl, n) == 0.07
    assert ctl.value == 0.07
    state = ctl.state_dict()
    assert state == {"value": 0.07}
    other = FixedKLController(0.3)
    other.load_state_dict(state)
    assert other.value == 0.07
    assert FixedKLController(0.0).value == 0.0


def test_make_kl_controller():
    assert KL_CONTROLLERS == ("fixed", "adaptive")
    fixed = make_kl_controller("fixed", 0.1)
    assert type(fixed) is FixedKLController and fixed.value == 0.1
    # target/horizon are ignored for "fixed" (a config may carry defaults for them)
    assert make_kl_controller("fixed", 0.1, target=6.0, horizon=10000).value == 0.1
    ada = make_kl_controller("adaptive", 0.2, target=6.0, horizon=10000)
    assert type(ada) is AdaptiveKLController
    assert (ada.value, ada.target, ada.horizon) == (0.2, 6.0, 10000)


def test_repr():
    assert repr(FixedKLController(0.1)) == "FixedKLController(kl_coef=0.1)"
    assert repr(AdaptiveKLController(0.1, 6, 10000)) == "AdaptiveKLController(value=0.1, target=6.0, horizon=10000.0)"


def test_kl_accepts_scalar_like_objects():
    class Scalar:  # stands in for a 0-d tensor / numpy scalar: anything float() accepts
        def __float__(self):
            return 12.0

    class Index:  # stands in for a numpy / torch integer: anything with __index__
        def __index__(self):
            return 64

    a, b = AdaptiveKLController(0.1, 6.0, 10000), AdaptiveKLController(0.1, 6.0, 10000)
    assert a.update(Scalar(), Index()) == b.update(12.0, 64)


def test_exported_from_core_package():
    # checked on the source (importing trl_ext.core would import trl and torch, ~8 s)
    tree = ast.parse((CORE_DIR / "__init__.py").read_text())
    imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "kl_control"
                for a in node.names}
    all_names = next(ast.literal_eval(node.value) for node in tree.body
                     if isinstance(node, ast.Assign) and node.targets[0].id == "__all__")
    wanted = {"FixedKLController", "AdaptiveKLController", "make_kl_controller", "KL_CONTROLLERS"}
    assert wanted <= imported and wanted <= set(all_names)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(init_kl_coef=-0.1, target=6.0, horizon=10000), r"init_kl_coef=-0\.1 must be a finite number >= 0"),
        (dict(init_kl_coef=math.nan, target=6.0, horizon=10000), r"init_kl_coef=nan must be a finite number >= 0"),
        (dict(init_kl_coef=math.inf, target=6.0, horizon=10000), r"init_kl_coef=inf must be a finite number >= 0"),
        (dict(init_kl_coef="0.1", target=6.0, horizon=10000), r"init_kl_coef='0\.1' is not a scalar number"),
        (dict(init_kl_coef=True, target=6.0, horizon=10000), r"init_kl_coef=True is a bool"),
        (dict(init_kl_coef=0.1, target=0.0, horizon=10000), r"target=0\.0 must be a finite number > 0.*e\.g\. 6\.0"),
        (dict(init_kl_coef=0.1, target=-6.0, horizon=10000), r"target=-6\.0 must be a finite number > 0"),
        (dict(init_kl_coef=0.1, target=math.nan, horizon=10000), r"target=nan must be a finite number > 0"),
        (dict(init_kl_coef=0.1, target=math.inf, horizon=10000), r"target=inf must be a finite number > 0"),
        (dict(init_kl_coef=0.1, target=6.0, horizon=0), r"horizon=0 must be a finite number > 0.*e\.g\. 10000"),
        (dict(init_kl_coef=0.1, target=6.0, horizon=-5), r"horizon=-5 must be a finite number > 0"),
        (dict(init_kl_coef=0.1, target=6.0, horizon=math.inf), r"horizon=inf must be a finite number > 0"),
        (dict(init_kl_coef=0.1, target=6.0, horizon=math.nan), r"horizon=nan must be a finite number > 0"),
    ],
)
def test_adaptive_rejects_bad_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveKLController(**kwargs)


@pytest.mark.parametrize("kl_coef, match", [(-1.0, r"kl_coef=-1\.0 must be a finite number >= 0"),
                                            (math.nan, r"kl_coef=nan must be a finite number >= 0"),
                                            (math.inf, r"kl_coef=inf must be a finite number >= 0")])
def test_fixed_rejects_bad_kl_coef(kl_coef, match):
    with pytest.raises(ValueError, match=match):
        FixedKLController(kl_coef)


@pytest.mark.parametrize(
    "kl, n_steps, match",
    [
        (math.nan, 64, r"kl=nan is not finite.*Fix the rollout"),
        (math.inf, 64, r"kl=inf is not finite"),
        (-math.inf, 64, r"kl=-inf is not finite"),
        ([1.0, 2.0], 64, r"kl=\[1\.0, 2\.0\] is not a scalar number"),
        (6.0, 0, r"n_steps=0 must be >= 1"),
        (6.0, -3, r"n_steps=-3 must be >= 1"),
        (6.0, 64.0, r"n_steps=64\.0 must be an int"),
        (6.0, True, r"n_steps=True must be an int"),
        (6.0, 10001, r"n_steps=10001 exceeds horizon=10000\.0: horizon must be at least the rollouts per batch.*"
                     r"typical 10000"),
    ],
)
def test_adaptive_update_rejects_bad_input_and_keeps_beta(kl, n_steps, match):
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(12.0, 64)
    before = ctl.state_dict()
    with pytest.raises(ValueError, match=match):
        ctl.update(kl, n_steps)
    assert ctl.state_dict() == before  # NaN/inf never poisons β


def test_adaptive_update_at_horizon_is_allowed():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=64)
    assert ctl.update(12.0, 64) == pytest.approx(0.12, rel=1e-12)  # n = horizon: factor 1.2, the largest allowed


def test_adaptive_overflow_raises_instead_of_going_infinite():
    ctl = AdaptiveKLController(1.7e308, target=1.0, horizon=1)
    with pytest.raises(ValueError, match=r"KL coefficient overflowed"):
        ctl.update(100.0, 1)  # 1.7e308 · 1.2 > float max
    assert ctl.value == 1.7e308


@pytest.mark.parametrize(
    "state, match",
    [
        ({"value": 0.1, "target": 6.0}, r"missing keys \['horizon'\], unexpected keys \[\]"),
        ({"value": 0.1, "target": 6.0, "horizon": 10000, "kl": 3.0}, r"missing keys \[\], unexpected keys \['kl'\]"),
        ({"kl_coef": 0.1, "target": 6.0, "horizon": 10000}, r"missing keys \['value'\], unexpected keys \['kl_coef'\]"),
        ({"value": -0.1, "target": 6.0, "horizon": 10000}, r"value=-0\.1 must be a finite number >= 0"),
        ({"value": 0.1, "target": math.nan, "horizon": 10000}, r"target=nan must be a finite number > 0"),
        ({"value": 0.1, "target": 6.0, "horizon": 0}, r"horizon=0 must be a finite number > 0"),
        ([("value", 0.1)], r"expects a dict from state_dict\(\), got list"),
    ],
)
def test_adaptive_load_state_dict_validates_and_changes_nothing_on_error(state, match):
    ctl = AdaptiveKLController(0.3, target=2.0, horizon=500)
    with pytest.raises(ValueError, match=match):
        ctl.load_state_dict(state)
    assert ctl.state_dict() == {"value": 0.3, "target": 2.0, "horizon": 500}


@pytest.mark.parametrize(
    "state, match",
    [
        ({}, r"missing keys \['value'\]"),
        ({"value": 0.1, "target": 6.0}, r"unexpected keys \['target'\]"),
        ({"value": math.inf}, r"value=inf must be a finite number >= 0"),
    ],
)
def test_fixed_load_state_dict_validates(state, match):
    ctl = FixedKLController(0.3)
    with pytest.raises(ValueError, match=match):
        ctl.load_state_dict(state)
    assert ctl.value == 0.3


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (("constant", 0.1), {}, r"unknown KL controller kind 'constant'; use one of \('fixed', 'adaptive'\)"),
        (("Adaptive", 0.1), dict(target=6.0, horizon=10000), r"unknown KL controller kind 'Adaptive'"),
        (("adaptive", 0.1), {}, r"adaptive KL controller needs target and horizon"),
        (("adaptive", 0.1), dict(target=6.0), r"adaptive KL controller needs horizon;"),
        (("adaptive", 0.1), dict(horizon=10000), r"adaptive KL controller needs target;"),
        (("adaptive", -0.1), dict(target=6.0, horizon=10000), r"init_kl_coef=-0\.1 must be"),
        (("fixed", -0.1), {}, r"kl_coef=-0\.1 must be"),
    ],
)
def test_make_kl_controller_rejects_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_kl_controller(*args, **kwargs)
