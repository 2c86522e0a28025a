"""pm.routing: the backward's expanded_row_idx and attributes from top-k ids, equal on the host
(the NumPy reference) and on the device (the forward op), right for the backward in every
scenario, and random top-k ids as a gate gives them."""

from __future__ import annotations

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe import routing

N, K, E = 12, 3, 5
SCENARIOS = {
    "dropless": lambda ids, **kw: routing.dropless(ids, E, **kw),
    "active": lambda ids, **kw: routing.active(ids, E, 20, **kw),
    "drop-pad": lambda ids, **kw: routing.drop_pad(ids, E, 4, **kw),
}


def _ids(seed: int) -> np.ndarray:
    """Even seeds: distinct experts per token (a gate's top-k); odd seeds: repeats within a
    token too. Either way many tokens share experts, so the order of equal ids matters."""
    if seed % 2 == 0:
        return routing.random_top_k(N, K, E, seed=seed)
    return np.random.default_rng(seed).integers(0, E, (N, K)).astype(np.int32)


def _kept(ids: np.ndarray, scenario: str) -> np.ndarray:
    """Kept slots per token from the documented rules, by plain loops over the slots i*K + t."""
    n, k = ids.shape
    slots = [(int(ids[i, t]), i * k + t) for i in range(n) for t in range(k)]
    kept = np.zeros(n, np.int64)
    taken = dict.fromkeys(range(E), 0)
    rank = {p: r for r, (_, p) in enumerate(sorted(slots))}
    for e, p in slots:
        if scenario == "drop-pad":
            keep = taken[e] < 4
            taken[e] += 1
        else:
            keep = scenario == "dropless" or rank[p] < 20
        kept[p // k] += keep
    return kept


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_host_and_device_give_the_same_routing(device, no_leaks, scenario):
    s = pm.Stream(device)
    for seed in range(4):
        ids = _ids(seed)
        host = SCENARIOS[scenario](ids)
        on_dev = SCENARIOS[scenario](pm.to_device(ids, stream=s), stream=s)
        assert not host.on_device and on_dev.on_device
        assert isinstance(on_dev.expanded_row_idx, pm.DeviceArray)
        back = on_dev.to_host(s)
        assert back.scenario == host.scenario == scenario
        assert back.grad_args == host.grad_args and back.forward_args == host.forward_args
        for name in ("expanded_row_idx", "expert_counts"):
            h, d = getattr(host, name), getattr(back, name)
            assert h.dtype == d.dtype == np.int32, name
            np.testing.assert_array_equal(h, d, err_msg=f"{name}, seed {seed}")
        np.testing.assert_array_equal(host.expert_counts, np.bincount(ids.ravel(), minlength=E))
    s.close()


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_routing_is_the_forwards_and_fits_the_backward(device, scenario):
    ids = _ids(1)
    x = np.random.default_rng(1).integers(-8, 8, (N, 16)).astype(np.float32)  # small integers: sums are exact
    r = SCENARIOS[scenario](ids)
    fwd = pm.moe_init_routing_v2(x, ids, **r.forward_args)
    np.testing.assert_array_equal(fwd.expanded_row_idx, r.expanded_row_idx)
    assert fwd.expanded_x.shape == r.expanded_shape(16)
    # Each token's row comes back once per slot the scenario keeps.
    back = pm.moe_init_routing_v2_grad(fwd.expanded_x, r.expanded_row_idx, **r.grad_args)
    np.testing.assert_array_equal(back, _kept(ids, scenario)[:, None] * x)
    g = np.random.default_rng(2).standard_normal(r.expanded_shape(16)).astype(np.float32)
    np.testing.assert_array_equal(pm.moe_init_routing_v2_grad(g, r.expanded_row_idx, **r.grad_args),
                                  pm.reference.moe_init_routing_v2_grad(g, r.expanded_row_idx, **r.grad_args))


def test_on_the_device_the_routing_feeds_the_backward_there(device):
    ids = _ids(0)
    x = np.random.default_rng(3).standard_normal((N, 8)).astype(np.float32)
    s = pm.Stream(device)
    r = routing.dropless(pm.to_device(ids, stream=s), E, stream=s)
    fwd = pm.moe_init_routing_v2(pm.to_device(x, stream=s), pm.to_device(ids, stream=s), **r.forward_args, stream=s)
    back = pm.moe_init_routing_v2_grad(fwd.expanded_x, r.expanded_row_idx, **r.grad_args, stream=s)
    np.testing.assert_array_equal(back.to_host(s), x * np.float32(K))  # backward(forward) = K x, exact for K = 3
    s.close()


def test_active_num_above_the_slots_keeps_them_all(device):
    ids = _ids(0)
    r = routing.active(ids, E, 1000)
    assert r.active_num == N * K and r.expanded_shape(4) == (N * K, 4)
    np.testing.assert_array_equal(r.expanded_row_idx, routing.dropless(ids, E).expanded_row_idx)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_rows_per_expert_are_each_experts_rows_of_expanded_x(device, scenario):
    ids = _ids(2)
    x = np.arange(N, dtype=np.float32)[:, None] + 1  # row i holds token i + 1; padding is 0
    r = SCENARIOS[scenario](ids)
    ex = pm.reference.moe_init_routing_v2(x, ids, **r.forward_args)[0]
    rows = r.rows_per_expert()
    if scenario == "drop-pad":
        np.testing.assert_array_equal(rows, (ex[..., 0] != 0).sum(axis=1))  # the filled rows come first
        assert all((ex[e, rows[e]:] == 0).all() for e in range(E))
        owned = [ex[e, :rows[e], 0] for e in range(E)]
    else:
        assert rows.sum() == len(ex)
        bounds = np.concatenate([[0], np.cumsum(rows)])
        owned = [ex[bounds[e]:bounds[e + 1], 0] for e in range(E)]
    for e, tokens in enumerate(owned):
        assert all(e in ids[int(t) - 1] for t in tokens), (e, tokens)
    with pytest.raises(TypeError, match="to_host"):
        SCENARIOS[scenario](pm.to_device(ids)).rows_per_expert()


def test_random_top_k_gives_distinct_experts_as_a_gate_does():
    ids = routing.random_top_k(500, 4, 9, seed=7)
    assert ids.shape == (500, 4) and ids.dtype == np.int32
    assert ids.min() >= 0 and ids.max() < 9
    assert all(len(set(row)) == 4 for row in ids.tolist())
    np.testing.assert_array_equal(ids, routing.random_top_k(500, 4, 9, seed=7))
    assert not np.array_equal(ids, routing.random_top_k(500, 4, 9, seed=8))
    assert sorted(routing.random_top_k(3, 9, 9, seed=0)[2].tolist()) == list(range(9))
    # Every expert is about as popular as the others, and comes first about as often.
    assert np.bincount(ids.ravel(), minlength=9).min() > 500 * 4 / 9 * 0.7
    assert np.bincount(ids[:, 0], minlength=9).min() > 500 / 9 * 0.5
    # More tokens than one block of scores (1024 tokens of 512 experts): the blocks go on from
    # one another.
    many = routing.random_top_k(2100, 2, 512, seed=1)
    assert (many[:, 0] != many[:, 1]).all() and not np.array_equal(many[:1024], many[1024:2048])


def test_random_top_k_follows_the_weights():
    w = np.array([8.0, 1, 1, 0, 1, 1])
    ids = routing.random_top_k(4000, 2, 6, seed=np.random.default_rng(3), weights=w)
    counts = np.bincount(ids.ravel(), minlength=6)
    assert counts[3] == 0  # weight 0: never drawn
    assert counts[0] > 3500 and counts[0] > 3 * counts[1:].max()  # the heavy expert is in almost every token


@pytest.mark.parametrize("call, name", [
    (lambda ids: routing.dropless(ids, 0), "expert_num"),
    (lambda ids: routing.dropless(ids, 2.0), "expert_num"),
    (lambda ids: routing.dropless(ids, 4), "expert_idx"),  # ids up to 4
    (lambda ids: routing.dropless(ids - 1, E), "expert_idx"),  # -1
    (lambda ids: routing.dropless(ids.astype(np.int64), E), "expert_idx"),
    (lambda ids: routing.dropless(ids.ravel(), E), "expert_idx"),
    (lambda ids: routing.dropless(ids[:0], E), "expert_idx"),
    (lambda ids: routing.active(ids, E, 0), "active_num"),
    (lambda ids: routing.drop_pad(ids, E, 0), "expert_capacity"),
    (lambda ids: routing.drop_pad(ids, E, N + 1), "expert_capacity"),
    (lambda ids: routing.dropless(ids, E, stream=pm.Device(0).default_stream), "stream"),
    (lambda ids: routing.dropless(pm.to_device(ids), E, stream="s"), "stream"),
    (lambda ids: routing.dropless(pm.to_device(ids.astype(np.int64)), E), "expert_idx"),
    (lambda ids: routing.dropless(ids, E).expanded_shape(0), "hidden"),
    (lambda ids: routing.random_top_k(4, 6, 5), "k"),
    (lambda ids: routing.random_top_k(4, 0, 5), "k"),
    (lambda ids: routing.random_top_k(-1, 2, 5), "n"),
    (lambda ids: routing.random_top_k(4, 2, 0), "expert_num"),
    (lambda ids: routing.random_top_k(4, 2, 5, seed=1.5), "seed"),
    (lambda ids: routing.random_top_k(4, 2, 5, weights=[1, 1]), "weights"),
    (lambda ids: routing.random_top_k(4, 2, 5, weights=["a"] * 5), "weights"),
    (lambda ids: routing.random_top_k(4, 2, 5, weights=[1, np.nan, 1, 1, 1]), "weights"),
    (lambda ids: routing.random_top_k(4, 2, 5, weights=[1, -1, 1, 1, 1]), "weights"),
    (lambda ids: routing.random_top_k(4, 2, 5, weights=[1, 0, 0, 0, 0]), "weights"),
    # Sizes that cannot be addressed: NumPy's ValueError before.
    (lambda ids: routing.dropless(ids, 2**62), "expert_num"),
    (lambda ids: routing.drop_pad(pm.to_device(ids), 2**62, 2), "expert_num"),
    (lambda ids: routing.random_top_k(2**62, 2, 5), "n"),
    (lambda ids: routing.random_top_k(4, 2, 2**62), "expert_num"),
])
def test_refusals_name_the_parameter(device, call, name):
    with pytest.raises(pm.InvalidArgument) as info:
        call(_ids(0))
    assert info.value.parameter == name, info.value


def test_torch_ids_give_torch_results(device):
    torch = pytest.importorskip("torch", reason="torch (CPU build) is a test extra")
    ids = _ids(0)
    r = routing.drop_pad(torch.from_numpy(ids), E, 4)
    assert isinstance(r.expanded_row_idx, torch.Tensor) and r.expanded_row_idx.dtype == torch.int32
    want = routing.drop_pad(ids, E, 4)
    np.testing.assert_array_equal(r.expanded_row_idx.numpy(), want.expanded_row_idx)
    np.testing.assert_array_equal(r.rows_per_expert().numpy(), want.rows_per_expert())
