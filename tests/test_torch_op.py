"""pyacl_moe.torch: the routing pair as torch operators, the forward differentiable in x.

The gradient is checked bit for bit against the NumPy reference's backward (the bit-exact
model of the kernel, conformance --exact's), eager and under torch.compile(backend="aot_eager").
NPU tensors run on torch_npu's stream: tests marked cann.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

import pyacl_moe as pm

torch = pytest.importorskip("torch", reason="torch (CPU build) is an extra: pip install -e '.[torch]' (README)")
pmt = pytest.importorskip("pyacl_moe.torch")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
N, K, H, E = 24, 3, 40, 6
# The forward's attributes for each scenario, and the backward's (top_k, drop_pad_mode, active_num).
SCENARIOS = {
    "dropless": ({"expert_tokens_count_or_cumsum_flag": 2}, (K, 0, 0)),
    "active": ({"active_num": 50, "expert_tokens_count_or_cumsum_flag": 1}, (K, 0, 50)),
    "drop-pad": ({"drop_pad_mode": 1, "expert_capacity": 9, "expert_tokens_before_capacity_flag": True}, (K, 1, 0)),
}


def _np(t):
    """A CPU tensor's values as NumPy, bfloat16 as ml_dtypes'."""
    t = t.detach()
    return t.view(torch.int16).numpy().view(pm.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((N, H), dtype=np.float32)).to(dtype)
    ids = torch.from_numpy(pm.routing.random_top_k(N, K, E, seed=seed))
    return x, ids


def _step(x, ids, w, attrs):
    r = pmt.moe_init_routing_v2(x, ids, expert_num=E, **attrs)
    return r, (r.expanded_x * w).sum()


def _bits_equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                                                                       np.ascontiguousarray(b).view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_x_grad_is_the_backward_of_the_incoming_gradient_bit_for_bit(device, scenario, dtype):
    attrs, grad_args = SCENARIOS[scenario]
    x, ids = _inputs(DTYPES[dtype])
    x.requires_grad_()
    want = pm.moe_init_routing_v2(_np(x), ids.numpy(), expert_num=E, **attrs)
    r, loss = _step(x, ids, torch.ones(1, dtype=x.dtype), attrs)
    for name, got in zip(pm.RoutingResult._fields, r):  # the forward's outputs: the NumPy call's
        ref = getattr(want, name)
        assert (got is None) == (ref is None), name
        if got is not None:
            assert isinstance(got, torch.Tensor) and _bits_equal(_np(got), ref), name
    w = torch.from_numpy(np.random.default_rng(1).standard_normal(tuple(r.expanded_x.shape), np.float32)).to(x.dtype)
    r, loss = _step(x, ids, w, attrs)
    loss.backward()
    # d loss / d expanded_x is w itself: x.grad must be the kernel's backward of w.
    expected = pm.reference.moe_init_routing_v2_grad(_np(w), _np(r.expanded_row_idx), *grad_args)
    assert x.grad.dtype == x.dtype and _bits_equal(_np(x.grad), expected)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_torch_compile_aot_eager_gives_the_same_result_and_gradient(device, scenario):
    attrs, _ = SCENARIOS[scenario]
    torch._dynamo.reset()
    for dtype in DTYPES.values():
        x, ids = _inputs(dtype, seed=2)
        w = torch.randn(pmt.moe_init_routing_v2(x, ids, expert_num=E, **attrs).expanded_x.shape).to(dtype)

        def step(x, ids, w):
            r, loss = _step(x, ids, w, attrs)
            return loss, r.expanded_x, r.expanded_row_idx

        results = []
        for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
            xi = x.clone().requires_grad_()
            loss, ex, row = fn(xi, ids, w)
            loss.backward()
            results.append((loss, ex, row, xi.grad))
        for eager, compiled in zip(*results):
            assert _bits_equal(_np(eager), _np(compiled))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_operators_pass_torch_library_opcheck(device, scenario):
    # Schema, fake (meta) implementation against the real one, autograd registration, and
    # AOT dispatch with dynamic shapes, as torch checks its own custom operators.
    attrs, grad_args = SCENARIOS[scenario]
    x, ids = _inputs(torch.float32, seed=3)
    full = {"active_num": 0, "expert_capacity": 0, "expert_num": E, "drop_pad_mode": 0,
            "expert_tokens_count_or_cumsum_flag": 0, "expert_tokens_before_capacity_flag": False, **attrs}
    torch.library.opcheck(torch.ops.pyacl_moe.moe_init_routing_v2.default,
                          (x.requires_grad_(), ids, *full.values()))
    r = pmt.moe_init_routing_v2(x.detach(), ids, expert_num=E, **attrs)
    g = torch.randn(r.expanded_x.shape, requires_grad=True)
    torch.library.opcheck(torch.ops.pyacl_moe.moe_init_routing_v2_grad.default, (g, r.expanded_row_idx, *grad_args))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_backward_alone_is_an_operator_with_a_derivative(device, scenario):
    attrs, grad_args = SCENARIOS[scenario]
    x, ids = _inputs(torch.bfloat16, seed=4)
    r = pmt.moe_init_routing_v2(x, ids, expert_num=E, **attrs)
    g = torch.randn(r.expanded_x.shape).to(torch.bfloat16).requires_grad_()
    grad_x = pmt.moe_init_routing_v2_grad(g, r.expanded_row_idx, *grad_args)
    assert _bits_equal(_np(grad_x), pm.reference.moe_init_routing_v2_grad(_np(g), _np(r.expanded_row_idx), *grad_args))
    # Its derivative gathers grad_x's gradient back to the rows each slot named: the
    # forward's own gather, so the gradient of g is the forward of v (zero where nothing lands).
    v = torch.randn(grad_x.shape).to(torch.bfloat16)
    (grad_x.float() * v.float()).sum().backward()
    gathered = pmt.moe_init_routing_v2(v, ids, expert_num=E, **attrs).expanded_x
    assert torch.equal(g.grad, gathered)


def test_bad_input_is_refused_by_parameter_name(device):
    x, ids = _inputs(torch.float32)
    with pytest.raises(pm.InvalidArgument, match="expert_idx: dtype must be int32"):
        pmt.moe_init_routing_v2(x, ids.to(torch.int16), expert_num=E)
    with pytest.raises(pm.InvalidArgument, match="x: dtype must be float16, bfloat16 or float32, the dtypes the op "
                                                 "computes in .*gradcheck"):
        pmt.moe_init_routing_v2(x.double(), ids, expert_num=E)
    with pytest.raises(pm.InvalidArgument, match="x: must be a torch tensor"):
        pmt.moe_init_routing_v2(x.numpy(), ids, expert_num=E)
    with pytest.raises(pm.InvalidArgument, match="expert_tokens_before_capacity_flag: must be a bool"):
        pmt.moe_init_routing_v2(x, ids, expert_num=E, expert_tokens_before_capacity_flag=1)
    with pytest.raises(pm.InvalidArgument, match="top_k: must be greater than 0"):
        pmt.moe_init_routing_v2_grad(x, ids.reshape(-1), 0)
    with pytest.raises(pm.InvalidArgument, match="expanded_row_idx: must be a torch tensor"):
        pmt.moe_init_routing_v2_grad(x, [1, 2], 1)


def test_the_int64_ids_topk_returns_are_taken_checked_and_converted_once(device):
    """torch users had to cast the ids topk returns: 'expert_idx: dtype must be int32, got int64'
    (issue: papercuts, 11)."""
    x, ids = _inputs(torch.float32)
    top = torch.randn(N, E, generator=torch.Generator().manual_seed(1)).topk(K, dim=1).indices
    assert top.dtype == torch.int64
    for given in (ids.long(), top):
        want = pmt.moe_init_routing_v2(x, given.to(torch.int32), expert_num=E, active_num=50)
        xg = x.clone().requires_grad_()
        got = pmt.moe_init_routing_v2(xg, given, expert_num=E, active_num=50)
        assert all(_bits_equal(_np(a), _np(b)) for a, b in zip(got[:2], want[:2]))
        got.expanded_x.sum().backward()  # the gradient goes through the converted ids
        assert xg.grad is not None and xg.grad.shape == x.shape
    assert given.dtype == torch.int64  # the caller's tensor is left as it was
    big = ids.long()
    big[3, 1] = 2**31
    with pytest.raises(pm.InvalidArgument, match=r"expert_idx: int64 ids must fit in int32 on Ascend910B3 "
                                                 r"\(Ascend910B\), whose op takes int32 .*got 2147483648"):
        pmt.moe_init_routing_v2(x, big, expert_num=E)


def test_on_a_chip_whose_forward_takes_int64_the_ids_go_to_the_op_as_they_are():
    code = """if True:
        import numpy as np, torch, pyacl_moe as pm, pyacl_moe.torch as pmt
        from pyacl_moe.op import moe_init_routing_v2 as m
        seen = []
        real = m.moe_init_routing_v2
        def spy(x, ids, *a, **k):
            seen.append(ids.dtype)
            return real(x, ids, *a, **k)
        pmt._routing = spy
        x = torch.randn(8, 16)
        ids = torch.randn(8, 4).topk(2, dim=1).indices
        r = pmt.moe_init_routing_v2(x, ids, expert_num=4)
        assert seen == [torch.int64], seen
        print(pm.device.chip().family)
    """
    env = {**os.environ, "PYACL_MOE_EMULATOR": "1", "PYACL_MOE_EMU_SOC": "Ascend950PR_9599",
           "PYACL_MOE_EMU_RELEASE": "9.1.0"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "Ascend950", r.stdout + r.stderr


def test_importing_the_package_imports_no_torch_and_pm_torch_is_the_module():
    code = ("import sys, pyacl_moe as pm; assert 'torch' not in sys.modules and 'pyacl_moe.torch' not in sys.modules; "
            "import pyacl_moe.torch as pmt; assert pm.torch is pmt and 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.cann
def test_npu_tensors_run_in_place_on_torch_npus_stream():
    torch_npu = pytest.importorskip("torch_npu")
    x, ids = _inputs(torch.bfloat16)
    attrs, grad_args = SCENARIOS["active"]
    xn = x.to("npu").requires_grad_()
    r = pmt.moe_init_routing_v2(xn, ids.to("npu"), expert_num=E, **attrs)
    assert r.expanded_x.device.type == "npu"
    w = torch.randn(r.expanded_x.shape).to(torch.bfloat16)
    (r.expanded_x * w.to("npu")).sum().backward()  # no synchronize: the same stream as torch's kernels
    torch_npu.npu.synchronize()
    expected = pm.reference.moe_init_routing_v2_grad(_np(w), _np(r.expanded_row_idx.cpu()), *grad_args)
    assert _bits_equal(_np(xn.grad.cpu()), expected)


def test_torch_npus_stream_is_borrowed_once_per_device_and_handle(device, monkeypatch):
    # On an Ascend host the operators queue on torch_npu's current stream: one borrowed
    # wrapper per (device, handle), kept, so that its workspace and executors are reused and
    # no dropped wrapper's close waits for torch's stream. torch_npu is stood in for here.
    import types

    own = [pm.Stream(device), pm.Stream(device)]
    current = {"stream": own[0]}
    npu = types.SimpleNamespace(current_device=lambda: 0,
                                current_stream=lambda index=None: types.SimpleNamespace(
                                    npu_stream=current["stream"].handle))
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu=npu))
    on_npu = types.SimpleNamespace(device=types.SimpleNamespace(type="npu", index=0))
    first = pmt._npu_stream(on_npu)
    assert first.handle == own[0].handle and pmt._npu_stream(on_npu) is first
    current["stream"] = own[1]
    second = pmt._npu_stream(on_npu)
    assert second.handle == own[1].handle and second is not first
    current["stream"] = own[0]
    assert pmt._npu_stream(on_npu) is first
    # Threads asking at once for a stream never seen get one wrapper between them.
    import threading

    current["stream"] = own2 = pm.Stream(device)
    got, barrier = [], threading.Barrier(8)

    def ask():
        barrier.wait()
        for _ in range(50):
            got.append(pmt._npu_stream(on_npu))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 400 and len({id(w) for w in got}) == 1 and got[0].handle == own2.handle


def test_a_gradient_torch_hands_over_strided_is_taken(device):
    # expanded_x.sum() hands the backward an expanded (stride 0) gradient of ones.
    x, ids = _inputs(torch.float16, seed=5)
    x.requires_grad_()
    r = pmt.moe_init_routing_v2(x, ids, expert_num=E)
    r.expanded_x.sum().backward()
    ones = np.ones(tuple(r.expanded_x.shape), np.float16)
    assert _bits_equal(_np(x.grad), pm.reference.moe_init_routing_v2_grad(ones, _np(r.expanded_row_idx), K))


def test_threads_train_through_the_operators_at_once(device):
    # Each thread its own tensors, the operators and the process's one device shared: every
    # gradient is still the kernel's, bit for bit. Bounded by iterations.
    import threading

    errors = []

    def worker(seed):
        try:
            for i in range(6):
                attrs, grad_args = list(SCENARIOS.values())[(seed + i) % 3]
                x, ids = _inputs(torch.bfloat16, seed=seed * 10 + i)
                x.requires_grad_()
                r = pmt.moe_init_routing_v2(x, ids, expert_num=E, **attrs)
                w = torch.randn(r.expanded_x.shape).to(torch.bfloat16)
                (r.expanded_x * w).sum().backward()
                want = pm.reference.moe_init_routing_v2_grad(_np(w), _np(r.expanded_row_idx), *grad_args)
                assert _bits_equal(_np(x.grad), want)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
