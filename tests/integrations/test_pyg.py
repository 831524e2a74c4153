"""KernelGATConv: GATConv equivalence (Prop. 2), kernels, L^p, gradients, errors."""
import pytest
import torch

pytest.importorskip("torch_geometric")
from torch_geometric.nn import GATConv  # noqa: E402
from torch_geometric.utils import coalesce  # noqa: E402

from attnopt.analysis.decompose import decompose_gat  # noqa: E402
from attnopt.integrations.pyg import KernelGATConv  # noqa: E402
from attnopt.kernels import RBF, RandomFourier  # noqa: E402


def _graph(seed=0, n=7, e=16, f=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, f, generator=g, dtype=torch.float64)
    ei = torch.randint(0, n, (2, e), generator=g)
    return x, ei


def _copy_from_gat(conv, gat):
    with torch.no_grad():
        conv.lin.weight.copy_(gat.lin.weight)
        conv.att_src.copy_(gat.att_src)
        conv.att_dst.copy_(gat.att_dst)
        conv.bias.copy_(gat.bias)


@pytest.mark.parametrize("concat", [True, False])
def test_rbf_p2_reproduces_gatconv(concat):
    torch.manual_seed(0)
    x, ei = _graph()
    gat = GATConv(5, 3, heads=2, concat=concat).double()
    with torch.no_grad():
        gat.bias.normal_()
    conv = KernelGATConv(5, 3, heads=2, kernel="rbf", p=2.0, concat=concat).double()
    _copy_from_gat(conv, gat)
    torch.testing.assert_close(conv(x, ei), gat(x, ei), rtol=1e-10, atol=1e-10)
    ei_loop, alpha = conv.edge_weights(x, ei)
    _, (ei_g, alpha_g) = gat(x, ei, return_attention_weights=True)
    assert torch.equal(ei_loop, ei_g)
    torch.testing.assert_close(alpha, alpha_g)


def test_edge_weights_match_dense_decomposition_oracle():
    torch.manual_seed(1)
    x, _ = _graph(1, n=4)
    full = torch.tensor([[j, i] for i in range(4) for j in range(4) if i != j]).T  # complete graph
    conv = KernelGATConv(5, 2, heads=1, p=1.3).double()
    ei, alpha = conv.edge_weights(x, full)
    h = conv.lin(x).detach()
    att = torch.cat([conv.att_dst[0, 0], conv.att_src[0, 0]]).detach()
    sim, _ = decompose_gat(h, h, att)  # Prop. 2 similarity = RBF(l=1) through ca
    c_att = att.clone()
    dense = torch.zeros(4, 4, dtype=torch.float64)
    for i in range(4):
        for j in range(4):
            raw = att[:2] @ h[i] + att[2:] @ h[j]
            c = 1.0 if raw >= 0 else 0.2
            mag = 2 * (c * c_att).abs().pow(1.3).sum() ** (2 / 1.3) + h[i].abs().pow(1.3).sum() ** (2 / 1.3)
            mag = mag + h[j].abs().pow(1.3).sum() ** (2 / 1.3)
            dense[i, j] = sim[i, j] * torch.exp(mag / 2)
    dense = dense / dense.sum(1, keepdim=True)
    for e in range(ei.shape[1]):
        j, i = ei[0, e], ei[1, e]
        torch.testing.assert_close(alpha[e, 0], dense[i, j].detach())


def test_fourier_and_direct_kernels_are_normalized_and_train():
    x, ei = _graph(2)
    w = torch.randn(2, 4, 6, dtype=torch.float64) * 0.7  # per-head (H, R, 2F)
    for conv in (
        KernelGATConv(5, 3, heads=2, kernel=RandomFourier(w), p=1.0).double(),
        KernelGATConv(5, 3, heads=2, kernel="direct", p=0.8, num_samples=4).double(),
    ):
        ei2, alpha = conv.edge_weights(x, ei)
        sums = torch.zeros(7, 2, dtype=torch.float64).index_add_(0, ei2[1], alpha)
        torch.testing.assert_close(sums, torch.ones_like(sums))
        conv(x, ei).square().sum().backward()
        assert conv.lin.weight.grad.abs().sum() > 0
    assert conv.spectral_points.grad.abs().sum() > 0


def test_gradcheck_direct():
    x, ei = _graph(3, n=4, e=6, f=2)
    conv = KernelGATConv(2, 2, heads=1, kernel="direct", num_samples=2, p=1.5).double()
    assert torch.autograd.gradcheck(lambda t: conv(t, ei), (x.requires_grad_(),), fast_mode=True)


@pytest.mark.parametrize("kernel", ["direct", "mikan"])
def test_gradcheck_every_parameter(kernel):
    """float64 gradcheck w.r.t. every parameter (projection, a, spectral points / densities)."""
    from torch.func import functional_call

    x, ei = _graph(4, n=5, e=8, f=3)
    conv = KernelGATConv(3, 2, heads=2, kernel=kernel, num_samples=2, hidden=3, seed=0).double().eval()
    with torch.no_grad():  # densities' last layers start at 0: move them so their inputs get gradients
        for name, prm in conv.named_parameters():
            if "sampler" in name:
                prm.add_(0.3 * torch.randn_like(prm))
    names, vals = zip(*[(n, p.detach().clone().requires_grad_()) for n, p in conv.named_parameters()])

    def out(*ps):
        return functional_call(conv, dict(zip(names, ps)), (x, ei))

    assert torch.autograd.gradcheck(out, vals, fast_mode=True)


def test_direct_kernel_converges_to_its_expectation():
    """Independent w1, w2 ~ N(0, I/2): E f(x, y) = ½[e^{-‖x−y‖²/4} + e^{-(‖x‖²+‖y‖²)/4}] (docstring)."""
    from attnopt.kernels import NonStationaryFourier

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 6, 4, generator=g, dtype=torch.float64) * 0.8
    kern = NonStationaryFourier.gaussian(200_000, 4, 2**-0.5, 2**-0.5, generator=g, dtype=torch.float64)
    rbf = torch.exp(-(x - y).square().sum(-1) / 4)
    want = 0.5 * (rbf + torch.exp(-(x.square() + y.square()).sum(-1) / 4))
    torch.testing.assert_close(kern.paired(x, y), want, atol=1e-2, rtol=0)
    assert (kern.paired(x, y) - rbf).abs().max() > 0.03  # not the RBF unless w1 = w2


def test_small_p_makes_edges_sparse():
    x, ei = _graph(4, n=8, e=40)
    ei = coalesce(ei)  # duplicate edges would tie
    conv = KernelGATConv(5, 4, heads=1).double()
    maxes = []
    for p in (2.0, 0.3):
        conv.p = p
        ei2, alpha = conv.edge_weights(x * 3, ei)
        m = torch.zeros(8, dtype=torch.float64).scatter_reduce(0, ei2[1], alpha[:, 0], "amax")
        maxes.append(m.mean().item())
    assert maxes[1] > maxes[0] and maxes[1] > 0.95


def test_bad_arguments():
    with pytest.raises(ValueError, match="kernel"):
        KernelGATConv(4, 2, kernel="periodic")
    with pytest.raises(TypeError, match="kernel"):
        KernelGATConv(4, 2, kernel=3)
    with pytest.raises(ValueError, match="p must"):
        KernelGATConv(4, 2, p=-1.0)
    assert "RBF" in repr(KernelGATConv(4, 2, kernel=RBF(1.0)))


def test_import_attnopt_does_not_import_torch_geometric():
    import subprocess
    import sys

    code = "import attnopt, attnopt.nn, attnopt.kernels, sys; assert 'torch_geometric' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("kind", ["ikan", "mikan"])
def test_implicit_kernels_normalize_train_and_report_kl(kind):
    x, ei = _graph(3)
    conv = KernelGATConv(5, 3, heads=2, kernel=kind, p=1.5, num_samples=4, seed=0).double()
    assert kind in repr(conv)
    ei2, alpha = conv.edge_weights(x, ei)
    sums = torch.zeros(7, 2, dtype=torch.float64).index_add_(0, ei2[1], alpha)
    torch.testing.assert_close(sums, torch.ones_like(sums))
    out = conv(x, ei)
    assert conv.kl().item() == pytest.approx(0.0, abs=1e-12)  # the posterior starts at the prior
    assert conv.sampler is not None and conv.sampler.densities[0].nn1[2].weight.grad is None
    (out.square().sum() + conv.kl()).backward()
    assert conv.lin.weight.grad.abs().sum() > 0
    assert conv.sampler.densities[0].nn1[2].weight.grad.abs().sum() > 0  # density learns via the task loss
    with torch.no_grad():  # move the posterior away from the prior: the KL becomes positive
        conv.sampler.densities[0].nn1[2].bias.fill_(0.3)
    conv(x, ei)
    assert conv.kl().item() > 0
    if kind == "mikan":
        with torch.no_grad():
            conv.sampler.densities[0].nn1[2].bias.zero_()
            conv.sampler.copula.raw.normal_()  # correlated heads: log det C < 0 adds to the KL
        conv(x, ei)
        assert conv.kl().item() > 0
    conv.eval()
    torch.testing.assert_close(conv(x, ei), conv(x, ei))  # fixed evaluation noise


def test_fixed_kernels_have_zero_kl_and_sampled_kernel_needs_forward():
    x, ei = _graph(4)
    assert KernelGATConv(5, 3, heads=2).double().kl().item() == 0.0
    conv = KernelGATConv(5, 3, heads=2, kernel="ikan", num_samples=4)
    with pytest.raises(RuntimeError, match="forward"):
        conv.kl()
    with pytest.raises(ValueError, match="kernel"):
        KernelGATConv(5, 3, kernel="gauss")


@pytest.mark.parametrize("kind", ["rbf", "ikan", "mikan"])
@pytest.mark.parametrize("concat", [True, False])
def test_graph_without_nodes(kind, concat):
    # no node: an empty output and a finite KL (the mean of no node summary is 0, not NaN, which
    # made the sampled points non-finite and the layer raise)
    conv = KernelGATConv(5, 3, heads=2, kernel=kind, num_samples=4, seed=0, concat=concat).double()
    if conv.sampler is not None:
        with torch.no_grad():  # posterior away from the prior: the KL is a real number, not 0
            conv.sampler.densities[0].nn1[2].bias.fill_(0.3)
    x = torch.zeros(0, 5, dtype=torch.float64, requires_grad=True)
    out = conv(x, torch.zeros(2, 0, dtype=torch.long))
    assert out.shape == (0, 6 if concat else 3)
    kl = conv.kl()
    assert torch.isfinite(kl) and (kind == "rbf" or kl.item() > 0)
    (out.sum() + kl).backward()
    assert all(torch.isfinite(p.grad).all() for p in conv.parameters() if p.grad is not None)
